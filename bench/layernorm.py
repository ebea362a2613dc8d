"""
LayerNorm forward+backward on the GPU: torch's own nn.LayerNorm, the fused per-example-norm
op (normgnorm, each backend available) and the separated shim (normalise without affine, then
the affine part in PyTorch with per-example reductions), at GPT-like shapes.

Reports the median time of one forward+backward, launched from Python (eager) and replayed
from a CUDA graph (the GPU's time alone, without launch overhead), the effective bandwidth of
the latter (bytes that must move: read x, write y; read x and dy, write dx), each time's ratio
to torch, and the host's microseconds per call: forward+backward called in a row without
waiting for the GPU, which queues the launches. The aim: the fused op within 1.10x of torch's
LayerNorm, i.e. per-example norms for free, and its host time within 1.3x of torch's.

    python bench/layernorm.py
    python bench/layernorm.py --shapes 8x1024x768 8x2048x8192 --dtype float16 --iters 100

With --sweep (GPU) it times the fused Triton op over ways of sharing out the backward's work
(nanogns/normgnorm/triton_kernels.py BACKWARD_TUNING) and prints the fastest for each shape and over
all of them, to be written back into BACKWARD_TUNING.

    python bench/layernorm.py --sweep --iters 20

With --compile_only (no GPU needed) it compiles the Triton kernels each shape would launch for
a GPU architecture instead, and prints what ptxas made of them: registers, spills, how many
programs fit on a multiprocessor, and how many waves the grid takes.

    python bench/layernorm.py --compile_only --arch 90 --sms 132    # H100 SXM
    python bench/layernorm.py --compile_only --arch 80 --sms 108    # A100

With --device cpu it times the same on the CPU (float32 unless --dtype says otherwise), where the
fused op's backends are the native CPU kernel (nanogns/normgnorm/cpu_ext.py) and the PyTorch path: the
median wall time of a forward+backward in a loop, and each one's extra over nn.LayerNorm.

    OMP_NUM_THREADS=1 python bench/layernorm.py --device cpu

With --device cpu --host (no GPU needed) it reports the GPU route's host cost instead: the fused
layer's Triton route runs on CPU tensors with each kernel launch recorded, not run, so its time
is the host's alone, beside torch's nn.LayerNorm at the same (small) shape on the CPU, whose time
is its host's plus its small arithmetic; with the launches per forward+backward.

    OMP_NUM_THREADS=1 python bench/layernorm.py --device cpu --host
"""
import argparse
import contextlib
import itertools
import math
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fused_gns import PEGradNormFusedLayerNorm  # noqa: E402
from nanogns.layers import register_sqgradnorm_buffers  # noqa: E402

DEFAULT_SHAPES = ["8x1024x768", "8x1024x1600", "8x2048x2048", "8x1024x4096", "8x2048x8192"]
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class _ShimAffine(torch.autograd.Function):
    """y = x̂ ⊙ γ + β, whose backward also reduces dγ_b, dβ_b per example (float32)."""

    @staticmethod
    def forward(ctx, xhat, weight, bias, weight_sq, bias_sq, count):
        ctx.save_for_backward(xhat, weight)
        ctx.buffers = (weight_sq, bias_sq, count)
        return torch.addcmul(bias, xhat, weight)

    @staticmethod
    def backward(ctx, dy):
        xhat, weight = ctx.saved_tensors
        weight_sq, bias_sq, count = ctx.buffers
        B, D = dy.shape[0], dy.shape[-1]
        dw_b = (dy.float() * xhat.float()).view(B, -1, D).sum(1)
        db_b = dy.view(B, -1, D).sum(1, dtype=torch.float32)
        weight_sq.add_(dw_b.square().sum())
        bias_sq.add_(db_b.square().sum())
        count.add_(B)
        return dy * weight, dw_b.sum(0).to(weight.dtype), db_b.sum(0).to(weight.dtype), None, None, None


class LocalSeparatedLayerNorm(nn.LayerNorm):
    """The separated shim, for when buffered.PEGradNormSeparatedLayerNorm is not there."""

    def __init__(self, ndim):
        super().__init__(ndim)
        register_sqgradnorm_buffers(self)

    def forward(self, x):
        xhat = F.layer_norm(x, self.normalized_shape, None, None, self.eps)
        return _ShimAffine.apply(xhat, self.weight, self.bias, self.weight_sqgradnorm, self.bias_sqgradnorm,
                                 self.example_count)


def separated_layernorm(ndim):
    try:
        from nanogns.layers import PEGradNormSeparatedLayerNorm
        return PEGradNormSeparatedLayerNorm(ndim), "separated (nanogns/layers)"
    except ImportError:
        return LocalSeparatedLayerNorm(ndim), "separated (local shim)"


def fused_backends():
    """The fused op's GPU backends that can run here."""
    names = []
    try:
        import triton  # noqa: F401
        names.append("triton")
    except ImportError:
        print("(triton not installed: no fused[triton])")
    from nanogns.normgnorm import cuda_ext
    try:
        cuda_ext.build()
        names.append("cuda")
    except Exception as e:  # no toolkit or compiler: say why, measure the rest
        print(f"(CUDA extension unavailable: {str(e).splitlines()[0]})")
    return names


def fwd_bwd(layer, x, dy):
    """One step to time: y = layer(x) and the gradients of x and of the parameters."""
    inputs = [x] + [p for p in layer.parameters()]
    return lambda: torch.autograd.grad(layer(x), inputs, dy)


def time_fwd_bwd(layer, x, dy, warmup, iters):
    """Median milliseconds of one forward+backward launched from Python."""
    step = fwd_bwd(layer, x, dy)
    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def host_us(layer, x, dy, warmup, iters):
    """Median host microseconds of one forward+backward over runs of calls made without waiting
    for the GPU (its launch queue holds them), synchronised only between runs."""
    step = fwd_bwd(layer, x, dy)
    for _ in range(warmup):
        step()
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            step()
        times.append((time.perf_counter() - start) / iters * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def time_graphed(layer, x, dy, iters, replays=10):
    """
    Median milliseconds of one forward+backward replayed from a CUDA graph: the GPU's own time,
    without Python's launch overhead (as under torch.compile's "reduce-overhead" mode). None,
    with the reason printed, where the step cannot be captured.
    """
    step = fwd_bwd(layer, x, dy)
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # capture wants its warm-up off the default stream
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
    except Exception as e:  # a host sync or an uncapturable call: say so, keep the eager number
        print(f"  ({type(layer).__name__} not captured in a CUDA graph: {str(e).splitlines()[0]})")
        torch.cuda.synchronize()
        return None
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / replays)
    return statistics.median(times)


def compile_report(shapes, dtype, arch, sms):
    """The Triton kernels' launches for each shape, compiled for sm_<arch>; False if any spills."""
    from nanogns.normgnorm import triton_aot
    print(f"Triton kernels compiled for sm_{arch} with {sms} multiprocessors, {dtype} (nothing runs)")
    header = (f"{'shape':>16}  {'kernel':<24}{'grid':>12}{'warps':>6}{'regs':>6}{'spill B':>8}"
              f"{'per SM':>7}{'waves':>7}")
    print(header)
    print("-" * len(header))
    spills = []
    for B, T, D in shapes:
        shape = (B, T, D)
        launches = triton_aot.forward_launches(shape, dtype) + triton_aot.backward_launches(shape, dtype, sm_count=sms)
        for launch in launches:
            c = triton_aot.compile_launch(launch, arch)
            waves = math.prod(c.grid) / (sms * c.programs_per_sm) if c.programs_per_sm else float("inf")
            grid = "x".join(str(n) for n in c.grid)
            print(f"{f'{B}x{T}x{D}':>16}  {c.name:<24}{grid:>12}{c.num_warps:>6}{c.registers:>6}{c.stack_bytes:>8}"
                  f"{c.programs_per_sm:>7}{waves:>7.2f}")
            if c.stack_bytes:
                spills.append(f"{B}x{T}x{D} {c.name}")
    print("registers spilled to memory: " + (", ".join(spills) if spills else "none"))
    return not spills


# what --sweep tries: every combination, each timed once per distinct set of launches
SWEEP = dict(programs_per_sm=[2, 4, 8], min_rows_per_chunk=[16, 32, 64], max_tile=[2048, 4096, 8192],
             values_per_thread=[4, 8, 16], max_chunks=[32, 128, 512])


@contextlib.contextmanager
def tuning_restored():
    """normgnorm.triton_kernels.BACKWARD_TUNING, to change freely: put back as it was on exit."""
    from nanogns.normgnorm import triton_kernels
    tuning = triton_kernels.BACKWARD_TUNING
    saved = dict(tuning)
    try:
        yield tuning
    finally:
        tuning.clear()
        tuning.update(saved)


def sweep_settings(shape, dtype, sm_count):
    """
    The combinations of SWEEP grouped by the backward launches they make at this shape on a GPU
    with sm_count multiprocessors (many choices launch the same kernels): a list of
    (settings, launches), the current BACKWARD_TUNING's group first. Nothing runs.
    """
    from nanogns.normgnorm import triton_aot
    groups = {}
    with tuning_restored() as tuning:
        current = tuple(tuning[k] for k in SWEEP)
        for values in [current] + list(itertools.product(*SWEEP.values())):
            setting = dict(zip(SWEEP, values))
            tuning.update(setting)
            launches = triton_aot.backward_launches(shape, dtype, sm_count=sm_count)
            key = tuple((l.name, l.grid, tuple(sorted(l.kwargs.items())),
                         tuple(a for a in l.args if isinstance(a, int))) for l in launches)
            if setting not in groups.setdefault(key, ([], launches))[0]:
                groups[key][0].append(setting)
    return list(groups.values())


def _setting_text(setting):
    return " ".join(f"{k}={v}" for k, v in setting.items())


def gpu_time(layer, x, dy, warmup, iters):
    """The graph-replay time where the step can be captured, else the eager one."""
    ms = time_graphed(layer, x, dy, iters)
    return ms if ms is not None else time_fwd_bwd(layer, x, dy, warmup, iters)


def sweep(shapes, dtype, warmup, iters, device="cuda", timer=gpu_time):
    """
    Time the fused Triton op under each group of sweep_settings and print the fastest; returns
    the best setting over all shapes. (device and timer let the tests run it on CPU under the
    Triton interpreter.)
    """
    from nanogns.normgnorm import triton_kernels
    saved = dict(triton_kernels.BACKWARD_TUNING)
    if device == "cuda":
        sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        name = torch.cuda.get_device_name()
    else:
        sms, name = 2, device
    print(f"{name} ({sms} SMs), {dtype}, fused[triton] forward+backward replayed from a CUDA graph, "
          f"median of {iters}; now: {_setting_text(saved)}")
    ratios = {}  # each combination of SWEEP -> its time over torch's, per shape
    for B, T, D in shapes:
        torch.manual_seed(0)
        x = torch.randn(B, T, D, device=device, dtype=dtype, requires_grad=True)
        dy = torch.randn_like(x)
        torch_ms = timer(nn.LayerNorm(D).to(device=device, dtype=dtype), x, dy, warmup, iters)
        layer = PEGradNormFusedLayerNorm(D, backend="triton").to(device=device, dtype=dtype)
        timed = []
        with tuning_restored() as tuning:
            for settings, _ in sweep_settings((B, T, D), dtype, sms):
                tuning.update(settings[0])
                ms = timer(layer, x, dy, warmup, iters)
                timed.append((ms, settings))
                for setting in settings:
                    ratios.setdefault(tuple(setting.values()), []).append(ms / torch_ms)
        now_ms = timed[0][0]
        print(f"\n{B}x{T}x{D}: torch {torch_ms:.3f} ms, now {now_ms:.3f} ms ({now_ms / torch_ms:.2f}x); "
              f"{len(timed)} distinct launches, fastest:")
        for ms, settings in sorted(timed, key=lambda t: t[0])[:5]:
            print(f"  {ms:8.3f} ms {ms / torch_ms:5.2f}x  {_setting_text(settings[0])}"
                  + (f" (and {len(settings) - 1} equivalent)" if len(settings) > 1 else ""))
    complete = {k: v for k, v in ratios.items() if len(v) == len(shapes)}
    geomean = {k: math.exp(sum(map(math.log, v)) / len(v)) for k, v in complete.items()}
    best = min(geomean, key=geomean.get)
    now = tuple(saved[k] for k in SWEEP)
    print(f"\nover all shapes (geometric mean of the ratio to torch): now {geomean[now]:.3f}x, "
          f"best {geomean[best]:.3f}x with {_setting_text(dict(zip(SWEEP, best)))}")
    return dict(zip(SWEEP, best))


CPU_SHAPES = ["32x64x128", "16x256x384", "8x1024x768"]
HOST_SHAPES = ["1x8x64", "8x64x64"]  # small: torch's arithmetic on the CPU adds little to its host time


@contextlib.contextmanager
def launches_recorded():
    """The Triton kernels' launches counted instead of run, on CPU tensors: each kernel of
    normgnorm.triton_kernels is swapped for a stand-in whose compiled kernel's launcher does
    nothing but count (the first launch of a plan goes through the stand-in "JIT", as on a GPU
    through Triton's). Yields the list of launches; everything is put back on exit."""
    import triton
    from nanogns.normgnorm import triton_kernels
    launched = []

    class Compiled:
        function = packed_metadata = None

        def __init__(self, name):
            self.name = name

        def run(self, *args):
            launched.append(self.name)

    class Jit:
        def __init__(self, kernel):
            self.arg_names, self.name = kernel.arg_names, kernel.fn.__name__

        def __getitem__(self, grid):
            def launch(*args, **meta):
                launched.append(self.name)
                return Compiled(self.name)
            return launch

    kernels = {name: value for name, value in vars(triton_kernels).items()
               if isinstance(value, triton.runtime.JITFunction) and "_kernel" in name}
    caches = ("_forward_plans", "_backward_plans")
    kept = {name: getattr(triton_kernels, name) for name in caches}
    interpret = os.environ.get("TRITON_INTERPRET")
    try:
        os.environ["TRITON_INTERPRET"] = "1"  # lets the "triton" backend take CPU tensors
        for name, kernel in kernels.items():
            setattr(triton_kernels, name, Jit(kernel))
        for name in caches:
            setattr(triton_kernels, name, {})
        yield launched
    finally:
        for name, value in {**kernels, **kept}.items():
            setattr(triton_kernels, name, value)
        if interpret is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = interpret


def host_table(shapes, dtype, warmup, iters):
    """Host microseconds of a forward+backward on the CPU: torch's nn.LayerNorm and RMSNorm against
    the fused layers' GPU route (Triton's), its launches recorded instead of run."""
    from nanogns.layers import PEGradNormFusedRMSNorm
    print(f"cpu, {torch.get_num_threads()} threads, {dtype}, host µs of one forward+backward, median of {iters} "
          f"after {warmup} warmup.\ntorch's rows run their arithmetic on the CPU (small at these shapes); the "
          "fused rows run the GPU route's Python,\nthe kernels' launches recorded, not run (the launcher's own "
          "C call, a few µs on a GPU, not counted).")
    header = f"{'shape':>16}  {'implementation':<30}{'host µs':>9}{'vs torch':>9}{'launches':>9}"
    print(header)
    print("-" * len(header))
    for B, T, D in shapes:
        x = torch.randn(B, T, D, dtype=dtype, requires_grad=True)
        dy = torch.randn_like(x)
        for torch_name, reference, fused in [("nn.LayerNorm", nn.LayerNorm(D, bias=False),
                                              PEGradNormFusedLayerNorm(D, bias=False, backend="triton")),
                                             ("nn.RMSNorm", nn.RMSNorm(D), PEGradNormFusedRMSNorm(D, backend="triton"))]:
            torch_ms, = cpu_times([reference.to(dtype=dtype)], x, dy, warmup, iters)
            with launches_recorded() as launched:
                fused_ms, = cpu_times([fused.to(dtype=dtype)], x, dy, warmup, iters)
                del launched[:]
                fwd_bwd(fused, x, dy)()
                per_call = len(launched)
            rows = [(f"torch {torch_name}", torch_ms, ""), (f"fused[triton] {torch_name[3:]}", fused_ms, per_call)]
            for name, ms, launches in rows:
                print(f"{f'{B}x{T}x{D}':>16}  {name:<30}{ms * 1e3:9.1f}{ms / torch_ms:8.2f}x{launches:>9}")
        print()


def cpu_times(layers, x, dy, warmup, iters, turn=10):
    """Median milliseconds of one forward+backward on the CPU for each layer, the layers taking
    turns `turn` iterations at a time (so that the machine's drift and the first one's cold
    allocations fall on all alike)."""
    steps = [fwd_bwd(layer, x, dy) for layer in layers]
    for step in steps:
        for _ in range(warmup):
            step()
    times = [[] for _ in steps]
    for _ in range(max(1, iters // turn)):
        for step, kept in zip(steps, times):
            for _ in range(turn):
                start = time.perf_counter()
                step()
                kept.append((time.perf_counter() - start) * 1e3)
    return [statistics.median(kept) for kept in times]


def cpu_table(shapes, dtype, warmup, iters):
    """nn.LayerNorm, the fused op's CPU kernel and PyTorch path, and the separated layer, timed on
    the CPU for each shape."""
    print(f"cpu, {torch.get_num_threads()} threads, {dtype}, median of {iters} forward+backward after {warmup} warmup.")
    header = f"{'shape':>16}  {'implementation':<26}{'ms':>9}{'extra µs':>10}{'vs torch':>9}"
    print(header)
    print("-" * len(header))
    for B, T, D in shapes:
        torch.manual_seed(0)
        x = torch.randn(B, T, D, dtype=dtype, requires_grad=True)
        dy = torch.randn_like(x)
        shim, shim_name = separated_layernorm(D)
        layers = {"torch nn.LayerNorm": nn.LayerNorm(D), "fused[cpu]": PEGradNormFusedLayerNorm(D, backend="cpu"),
                  "fused[torch]": PEGradNormFusedLayerNorm(D, backend="torch"), shim_name: shim}
        times = cpu_times([layer.to(dtype=dtype) for layer in layers.values()], x, dy, warmup, iters)
        for name, ms in zip(layers, times):
            print(f"{f'{B}x{T}x{D}':>16}  {name:<26}{ms:9.3f}{(ms - times[0]) * 1e3:10.0f}{ms / times[0]:8.2f}x")
        print()


def parse_shape(text):
    try:
        B, T, D = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {text!r} is not BxTxD, e.g. 8x1024x768")
    return B, T, D


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", type=parse_shape,
                        help=f"input shapes BxTxD (default: {' '.join(DEFAULT_SHAPES)}; on CPU {' '.join(CPU_SHAPES)})")
    parser.add_argument("--dtype", choices=list(DTYPES), help="default: bfloat16 on the GPU, float32 on the CPU")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cuda (default) or cpu: the CPU kernel and the PyTorch path against nn.LayerNorm")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--sweep", action="store_true",
                        help="time the fused Triton op over ways of sharing out the backward's work (GPU)")
    parser.add_argument("--host", action="store_true",
                        help="with --device cpu: the host's µs of the fused layers' GPU route, launches recorded "
                             "instead of run, against torch's nn.LayerNorm and nn.RMSNorm (no GPU needed)")
    parser.add_argument("--compile_only", action="store_true",
                        help="compile the Triton kernels for --arch and report their resources; no GPU needed")
    parser.add_argument("--arch", type=int, choices=[80, 90], default=90,
                        help="with --compile_only: compute capability, 80 (A100) or 90 (H100) (default %(default)s)")
    parser.add_argument("--sms", type=int, default=None,
                        help="with --compile_only: multiprocessors, which set how the backward shares out rows "
                             "(default 108 for --arch 80, 132 for --arch 90)")
    args = parser.parse_args()
    defaults = (HOST_SHAPES if args.host else CPU_SHAPES) if args.device == "cpu" else DEFAULT_SHAPES
    args.shapes = args.shapes or [parse_shape(s) for s in defaults]
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    if args.device == "cpu":
        if args.sweep or args.compile_only:
            parser.error("--sweep and --compile_only are for the GPU's kernels, not --device cpu")
        if args.host:
            try:
                import triton  # noqa: F401
            except ImportError:
                parser.error("--host runs the Triton route's Python and needs triton (pip install triton)")
            host_table(args.shapes, DTYPES[args.dtype], args.warmup, args.iters)
        else:
            cpu_table(args.shapes, DTYPES[args.dtype], args.warmup, args.iters)
        return 0
    if args.host:
        parser.error("--host is for --device cpu; on a GPU the table's host µs column reports it")
    if args.compile_only:
        try:
            import triton  # noqa: F401
        except ImportError:
            parser.error("--compile_only needs triton (pip install triton)")
        sms = args.sms or {80: 108, 90: 132}[args.arch]
        return 0 if compile_report(args.shapes, DTYPES[args.dtype], args.arch, sms) else 1
    if not torch.cuda.is_available():
        print("bench/layernorm.py measures GPU kernels and needs a CUDA GPU; none here, nothing to do.\n"
              "(--compile_only compiles the Triton kernels for a GPU and reports their resources without one;\n"
              "--device cpu times the CPU's.)")
        return 0
    dtype = DTYPES[args.dtype]
    if args.sweep:
        sweep(args.shapes, dtype, args.warmup, args.iters)
        return 0
    backends = fused_backends()
    print(f"{torch.cuda.get_device_name()}, {args.dtype}, median of {args.iters} after {args.warmup} warmup.\n"
          "eager: each forward+backward launched from Python (launch overhead included, as in eager "
          "training);\ngraph: the same replayed from a CUDA graph (the GPU's time alone); GB/s of the graph time;\n"
          "host µs: the host's time per forward+backward, called in a row without waiting for the GPU.")
    header = (f"{'shape':>16}  {'implementation':<26}{'eager ms':>9}{'vs torch':>9}"
              f"{'graph ms':>10}{'GB/s':>7}{'vs torch':>9}{'host µs':>9}{'vs torch':>9}")
    print(header)
    print("-" * len(header))
    verdicts = {"graph": [], "eager": [], "host": []}
    for B, T, D in args.shapes:
        torch.manual_seed(0)
        x = torch.randn(B, T, D, device="cuda", dtype=dtype, requires_grad=True)
        dy = torch.randn_like(x)
        moved = 5 * x.numel() * x.element_size()  # x, y forward; x, dy, dx backward
        layers = [("torch nn.LayerNorm", nn.LayerNorm(D))]
        for name in backends:
            m = PEGradNormFusedLayerNorm(D, backend=name)
            layers.append((f"fused[{name}]", m))
        shim, shim_name = separated_layernorm(D)
        layers.append((shim_name, shim))
        reference = {}
        for name, layer in layers:
            layer = layer.to(device="cuda", dtype=dtype)
            times = {"eager": time_fwd_bwd(layer, x, dy, args.warmup, args.iters),
                     "graph": time_graphed(layer, x, dy, args.iters),
                     "host": host_us(layer, x, dy, args.warmup, args.iters)}
            cells = []
            for kind, ms in times.items():
                reference.setdefault(kind, ms)
                ratio = ms / reference[kind] if ms is not None and reference[kind] is not None else None
                if name.startswith("fused") and ratio is not None:
                    verdicts[kind].append((f"{B}x{T}x{D} {name}", ratio))
                cells.append((ms, ratio))
            (e_ms, e_ratio), (g_ms, g_ratio), (h_us, h_ratio) = cells
            graph_cells = (f"{g_ms:10.4f}{moved / g_ms / 1e6:7.0f}{g_ratio:8.2f}x" if g_ratio is not None
                           else f"{'n/a':>10}{'':>7}{'':>9}")
            print(f"{f'{B}x{T}x{D}':>16}  {name:<26}{e_ms:9.4f}{e_ratio:8.2f}x{graph_cells}{h_us:9.1f}{h_ratio:8.2f}x")
        print()
    for kind, found in verdicts.items():
        if found:
            aim = 1.30 if kind == "host" else 1.10
            within = [v for v in found if v[1] <= aim]
            print(f"fused within {aim:.2f}x of torch, {kind}: {len(within)} of {len(found)}"
                  + "".join(f"\n  over: {name} {ratio:.2f}x" for name, ratio in found if ratio > aim))
    return 0


if __name__ == "__main__":
    sys.exit(main())
