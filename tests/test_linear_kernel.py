"""
linear_gns_kernel: a Linear's weight gradient and each example's squared norm of it in one Triton
GEMM, checked against brute force (every W_b = dy_b^T x_b formed in float64).

The kernel's tests run where the kernel does: on a GPU, or on the CPU under the Triton
interpreter, which test_kernel_interpreted starts in a fresh process with TRITON_INTERPRET=1
(it must be set before triton is first imported, and this process has imported it). Shapes are
tiny there: the interpreter takes milliseconds per program. The rest (the plan, the op's tracing,
the compile for GPUs, buffered's CPU path) runs in this process.
"""
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

import nanogns.layers as buffered  # noqa: E402
import nanogns.layers.linear as linear_module  # noqa: E402  (where the Linear maths is patched)
import nanogns.layers.linear_kernel as linear_gns_kernel  # noqa: E402
from nanogns.layers.linear_kernel import per_example_weight_grad, plan, reference  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu" if INTERPRETED else None

kernel_runs = pytest.mark.skipif(DEVICE is None, reason="the kernel runs on a GPU, or in test_kernel_interpreted's "
                                                       "process (TRITON_INTERPRET=1)")
this_process = pytest.mark.skipif(INTERPRETED, reason="runs in the parent process, without the interpreter")
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
KERNEL_ROUTE = "kernel 16x16 t16 w4 s1"  # a route of buffered's routes table: small tiles for the interpreter


def brute_force(x, dy):
    """(dW, [B] squared norms) in float64 from every W_b = dy_b^T x_b, of x and dy as given (already rounded)."""
    per_example = torch.bmm(dy.double().mT, x.double())
    return per_example.sum(0), per_example.square().sum((1, 2))


def rtol(dtype):
    """The inputs are exact in their dtype and the kernel accumulates in float32; the tolerance is
    the dtype's own rounding (float32: a few ulps of the sums)."""
    return 2e-5 if dtype == torch.float32 else torch.finfo(dtype).eps


def assert_close(got, want, dtype):
    tol = rtol(dtype)
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * want.abs().max().item())


def inputs(B, T, K, L, dtype, seed=0, device=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, K, generator=g).to(dtype)
    dy = torch.randn(B, T, L, generator=g).to(dtype)
    return x.to(device or DEVICE), dy.to(device or DEVICE)


# ---------------------------------------------------------------- the kernel against brute force

# (B, T, K, L, configuration): between them every mask, a single example and token, the token
# loop's last block partial, the examples split into runs, several tile shapes
CASES = {
    "tiles fit exactly": (2, 4, 32, 32, dict(block_l=16, block_k=16, block_t=16)),
    "K, L not multiples of the tile": (3, 5, 40, 33, dict(block_l=16, block_k=32, block_t=16)),
    "T = 1": (3, 1, 20, 24, dict(block_l=16, block_k=16, block_t=16)),
    "B = 1": (1, 5, 40, 17, dict(block_l=32, block_k=16, block_t=16)),
    "two token blocks, the last partial": (2, 20, 17, 24, dict(block_l=16, block_k=32, block_t=16)),
    "examples in two runs (2 + 1)": (3, 4, 24, 40, dict(block_l=32, block_k=16, block_t=16, n_splits=2)),
    "one tile wider than K and L": (2, 3, 20, 24, dict(block_l=32, block_k=32, block_t=32)),
}


@kernel_runs
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_brute_force(case, dtype):
    B, T, K, L, config = CASES[case]
    x, dy = inputs(B, T, K, L, dtype)
    dw, sq = linear_gns_kernel._launch(x, dy, True, **config)
    want_dw, want_sq = brute_force(x, dy)
    assert dw.dtype == sq.dtype == torch.float32 and dw.shape == (L, K) and sq.shape == (B,)
    assert_close(dw, want_dw, dtype)
    assert_close(sq, want_sq, dtype)


@kernel_runs
def test_norms_alone_and_deterministic():
    """Without dW (a shim layer's call) the norms are the same bits; two runs agree to the bit."""
    B, T, K, L, config = CASES["examples in two runs (2 + 1)"]
    x, dy = inputs(B, T, K, L, torch.float32)
    dw, sq = linear_gns_kernel._launch(x, dy, True, **config)
    again_dw, again_sq = linear_gns_kernel._launch(x, dy, True, **config)
    none_dw, none_sq = linear_gns_kernel._launch(x, dy, False, **config)
    assert torch.equal(dw, again_dw) and torch.equal(sq, again_sq) and torch.equal(sq, none_sq)
    assert none_dw.numel() == 1  # a placeholder


@kernel_runs
def test_strided_inputs():
    """x and dy are read through their strides: views (a transposed x, a slice of dy's features)
    give what their contiguous copies give."""
    x_t, dy_wide = inputs(2, 24, 3, 40, torch.float32)  # x_t [B, K, T] seen as x [B, T, K]
    x = x_t.mT
    dy = dy_wide[:, :3, 5:30]  # [2, 3, 25], strides of the wider tensor
    config = dict(block_l=16, block_k=16, block_t=16)
    dw, sq = linear_gns_kernel._launch(x, dy, True, **config)
    want_dw, want_sq = linear_gns_kernel._launch(x.contiguous(), dy.contiguous(), True, **config)
    torch.testing.assert_close(dw, want_dw, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sq, want_sq, rtol=1e-6, atol=0)
    # the gradient of y.sum(): one value broadcast, every stride 0
    ones = torch.ones((), device=DEVICE).expand(2, 3, 25)
    dw, sq = linear_gns_kernel._launch(x, ones, True, **config)
    want_dw, want_sq = brute_force(x, ones)
    torch.testing.assert_close(dw.double(), want_dw, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(sq.double(), want_sq, rtol=1e-5, atol=0)


@kernel_runs
def test_entry_point_runs_the_kernel(monkeypatch):
    """per_example_weight_grad launches the kernel (TUNING's plan) and agrees with the reference."""
    launches = []
    launch = linear_gns_kernel._launch
    monkeypatch.setattr(linear_gns_kernel, "_launch", lambda *a, **k: launches.append(1) or launch(*a, **k))
    x, dy = inputs(2, 3, 20, 24, torch.bfloat16)
    dw, sq = per_example_weight_grad(x, dy)
    assert launches and linear_gns_kernel.supports(x, dy)
    want_dw, want_sq = brute_force(x, dy)
    assert_close(dw, want_dw, torch.bfloat16)
    assert_close(sq, want_sq, torch.bfloat16)
    assert per_example_weight_grad(x, dy, need_dw=False)[0] is None


@kernel_runs
@pytest.mark.parametrize("fused", [True, False], ids=["gns", "shim"])
def test_buffered_materialise_runs_the_kernel(monkeypatch, fused):
    """A measured Linear whose "materialise" method runs the kernel (as it does on a GPU; here the
    CPU under the interpreter stands in) fills its buffer and .grad as the torch.bmm path does."""
    cls = buffered.PEGradNormLinear if fused else buffered.PEGradNormShimLinear
    x, dy = inputs(3, 5, 20, 24, torch.float32, seed=1)
    results, launches = {}, []
    launch = linear_gns_kernel._launch
    monkeypatch.setattr(linear_gns_kernel, "_launch", lambda *a, **k: launches.append(1) or launch(*a, **k))
    for on_kernel in (False, True):
        monkeypatch.setattr(linear_module, "materialised_route", lambda *a: KERNEL_ROUTE if on_kernel else "bmm")
        launches.clear()
        torch.manual_seed(0)
        layer = cls(20, 24).to(DEVICE)
        layer.per_example_mode = "materialise"
        (layer(x) * dy).sum().backward()
        assert len(launches) == on_kernel
        results[on_kernel] = layer.weight_sqgradnorm.clone(), layer.weight.grad.clone()
    torch.testing.assert_close(results[True][0], results[False][0], rtol=1e-5, atol=0)
    torch.testing.assert_close(results[True][1], results[False][1], rtol=1e-5, atol=1e-5)


@kernel_runs
def test_a_tied_head_runs_the_kernel_and_gives_its_rows_at_the_ids(monkeypatch):
    """A tied head (ids given) runs the kernel too: its norm and gradient from it, and W_b's rows at
    the embedding's ids (for the cross term) from the ghost path's gather, the bmm path's values."""
    x, dy = inputs(2, 3, 8, 12, torch.float32)
    ids = torch.randint(0, 12, (2, 3), device=DEVICE)
    results, launches = {}, []
    launch = linear_gns_kernel._launch
    monkeypatch.setattr(linear_gns_kernel, "_launch", lambda *a, **k: launches.append(1) or launch(*a, **k))
    for on_kernel in (False, True):
        route = KERNEL_ROUTE if on_kernel else "bmm"
        results[on_kernel] = linear_module._weight_sqnorm_materialised(x, dy, 1 << 24, True, ids, route)
        assert len(launches) == on_kernel
    for got, want in zip(results[True], results[False]):
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-5, atol=1e-6)
    assert results[True][2].shape == (2, 3, 8)


@kernel_runs
def test_a_tiling_route_runs_the_kernel_with_its_tiling(monkeypatch):
    """A kernel route of the routes table ("kernel <tiling>") launches the kernel with that tiling, and
    its norms and gradient are brute force's."""
    configs = []
    launch = linear_gns_kernel._launch
    monkeypatch.setattr(linear_gns_kernel, "_launch", lambda *a, **k: configs.append(k) or launch(*a, **k))
    x, dy = inputs(3, 5, 40, 33, torch.bfloat16)
    sq, dw, _ = linear_module._weight_sqnorm_materialised(x, dy, 1 << 24, True, route="kernel 16x32 t16 w4 s2 split2")
    assert configs == [dict(block_l=16, block_k=32, block_t=16, num_warps=4, num_stages=2, n_splits=2)]
    want_dw, want_sq = brute_force(x, dy)
    assert_close(dw, want_dw, torch.bfloat16)
    assert_close(sq, want_sq.sum(), torch.bfloat16)


@kernel_runs
def test_a_tied_gpt_on_the_kernel_measures_what_the_bmm_path_measures(monkeypatch):
    """The whole GPT, every layer measured with its head tied to the embedding, materialised: the
    per-example sums of every parameter (the tied weight's cross term included) and the gradients
    agree with the kernel and without it."""
    from gns_fixtures import gpt_batches, tiny_gpt
    from nanogns.layers.config import classes_for_flags
    layers = classes_for_flags(linearclass="gns", embeddingclass="gns", lnclass="shim")
    results = {}
    for on_kernel in (False, True):
        monkeypatch.setattr(linear_module, "materialised_route", lambda *a: KERNEL_ROUTE if on_kernel else "bmm")
        model = tiny_gpt(**layers).to(DEVICE)
        buffered.set_per_example_mode(model, "materialise")
        for ids, targets in gpt_batches(2, 3):
            _, loss = model(ids.to(DEVICE), targets.to(DEVICE))
            (loss / 2).backward()
        results[on_kernel] = ({name: sq.clone() for name, _, sq, _ in buffered.find_sqgradnorm_buffers(model)},
                              {name: p.grad.clone() for name, p in model.named_parameters()})
    assert "transformer.wte.weight" in results[True][0]
    for name, sq in results[False][0].items():
        torch.testing.assert_close(results[True][0][name], sq, rtol=1e-5, atol=0, msg=name)
    for name, grad in results[False][1].items():
        torch.testing.assert_close(results[True][1][name], grad, rtol=1e-5, atol=1e-6, msg=name)


# ---------------------------------------------------------------- on a GPU, at GPT-2 small's size

@needs_cuda
def test_gpu_gpt2_small_mlp_shape_bfloat16():
    """GPT-2 small's MLP up-projection (B 8, T 1024, K 768, L 3072) in bfloat16, TUNING's plan."""
    x, dy = inputs(8, 1024, 768, 3072, torch.bfloat16, device="cuda")
    dw, sq = per_example_weight_grad(x, dy)
    want_dw, want_sq = brute_force(x, dy)
    assert_close(dw, want_dw, torch.bfloat16)
    assert_close(sq, want_sq, torch.bfloat16)
    # torch's own weight GEMM, in float32 from the same bfloat16 inputs
    torch_dw = dy.float().reshape(-1, 3072).mT @ x.float().reshape(-1, 768)
    assert_close(dw, torch_dw.double(), torch.bfloat16)


@needs_cuda
def test_gpu_compiled_matches_eager():
    """Under torch.compile (Inductor, one graph) the op runs the kernel, with eager's results."""
    x, dy = inputs(4, 64, 96, 160, torch.bfloat16, device="cuda")
    compiled = torch.compile(per_example_weight_grad, fullgraph=True)
    for need_dw in (True, False):
        dw, sq = compiled(x, dy, need_dw)
        want_dw, want_sq = per_example_weight_grad(x, dy, need_dw)
        torch.testing.assert_close(sq, want_sq, rtol=1e-6, atol=0)
        if need_dw:
            torch.testing.assert_close(dw, want_dw, rtol=1e-6, atol=1e-6)
        else:
            assert dw is None
    torch._dynamo.reset()


@needs_cuda
@pytest.mark.parametrize("fused", [True, False], ids=["gns", "shim"])
def test_gpu_buffered_materialise_against_ghost(fused, monkeypatch):
    """On a GPU a measured Linear's "materialise" (the kernel) and "ghost" methods give one norm."""
    monkeypatch.setattr(linear_module, "materialised_route", lambda *a: "kernel 64x64 t32 w4 s3")
    cls = buffered.PEGradNormLinear if fused else buffered.PEGradNormShimLinear
    x, dy = inputs(4, 32, 64, 96, torch.float32, device="cuda")
    sums = {}
    for method in ("materialise", "ghost"):
        torch.manual_seed(0)
        layer = cls(64, 96).cuda()
        layer.per_example_mode = method
        (layer(x) * dy).sum().backward()
        sums[method] = layer.weight_sqgradnorm.item()
    assert sums["materialise"] == pytest.approx(sums["ghost"], rel=1e-4)


# ---------------------------------------------------------------- in this process

@this_process
def test_kernel_interpreted():
    """This file's kernel tests, in a fresh process with TRITON_INTERPRET=1 (the CPU stands in for a GPU)."""
    if HAS_CUDA:
        pytest.skip("a CUDA GPU runs the kernel itself")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           os.path.abspath(__file__), "-k", "not gpu"],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    ran = sum(1 for name in CASES for _ in DTYPES) + 8
    assert f"{ran} passed" in done.stdout, done.stdout[-3000:]


@this_process
def test_reference_matches_brute_force():
    x, dy = inputs(3, 4, 10, 7, torch.float64, device="cpu")
    dw, sq = reference(x, dy)
    want_dw, want_sq = brute_force(x, dy)
    assert dw.dtype == sq.dtype == torch.float32
    torch.testing.assert_close(dw.double(), want_dw, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sq.double(), want_sq, rtol=1e-6, atol=0)
    assert reference(x, dy, need_dw=False)[0] is None


@this_process
def test_off_gpu_the_reference_runs(monkeypatch):
    """On the CPU without the interpreter the entry point is the torch reference, never the kernel."""
    monkeypatch.setattr(linear_gns_kernel, "_launch", lambda *a, **k: pytest.fail("the kernel ran"))
    x, dy = inputs(2, 3, 6, 5, torch.float32, device="cpu")
    assert not linear_gns_kernel.supports(x, dy)
    dw, sq = per_example_weight_grad(x, dy)
    torch.testing.assert_close(sq.double(), brute_force(x, dy)[1], rtol=1e-5, atol=0)


@this_process
@pytest.mark.parametrize("fused", [True, False], ids=["gns", "shim"])
def test_buffered_cpu_path_unchanged(monkeypatch, fused):
    """On the CPU a measured Linear's "materialise" never reaches the kernel's module, and its norm
    is, to the bit, the sum of squares of torch.bmm's per-example gradients (one chunk here)."""
    monkeypatch.setattr(linear_gns_kernel, "per_example_weight_grad", lambda *a, **k: pytest.fail("the kernel ran"))
    cls = buffered.PEGradNormLinear if fused else buffered.PEGradNormShimLinear
    x, dy = inputs(3, 5, 20, 24, torch.float32, device="cpu")
    torch.manual_seed(0)
    layer = cls(20, 24)
    layer.per_example_mode = "materialise"
    (layer(x) * dy).sum().backward()
    assert buffered.materialised_route(5, 20, 24, x.dtype, x.device) == "bmm"
    assert torch.equal(layer.weight_sqgradnorm, buffered.sum_of_squares(torch.bmm(dy.mT, x)))


@this_process
def test_plan_splits_examples_only_where_tiles_are_few(monkeypatch):
    monkeypatch.setattr(linear_gns_kernel, "_plans", {})
    monkeypatch.setattr(linear_gns_kernel, "_multiprocessors", lambda device: 132)  # an H100's
    cuda = torch.device("cuda")
    # GPT-2 small's attention output (768 x 768): 36 tiles of 128 x 128 fill 132 multiprocessors
    # in 3 runs of examples; its MLP (3072 x 768): 144 tiles, no split
    assert plan(8, 768, 768, torch.bfloat16, cuda)[0] == (6, 6, 3)
    assert plan(8, 768, 768, torch.bfloat16, cuda)[1] == 3  # runs of 3, 3, 2
    assert plan(8, 768, 3072, torch.bfloat16, cuda)[0] == (24, 6, 1)
    assert plan(1, 768, 768, torch.bfloat16, cuda)[0] == (6, 6, 1)  # never more runs than examples
    # a split into runs that would leave one empty takes fewer: 4 examples in 3 runs is 2 + 2
    assert plan(4, 20, 20, torch.float32, cuda, block_l=16, block_k=16, n_splits=3)[:2] == ((2, 2, 2), 2)
    grid, _, meta = plan(8, 768, 768, torch.float32, cuda)
    assert (meta["BLOCK_L"], meta["BLOCK_K"], meta["num_warps"]) == (64, 64, 4)
    with pytest.raises(TypeError, match="unknown kernel configuration"):
        plan(8, 768, 768, torch.float32, cuda, block_m=64)


@this_process
def test_float32_precision_follows_torch():
    """float32 tiles go through tl.dot as torch's matmuls go: TF32 only where torch allows it."""
    allowed = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        assert not linear_gns_kernel._tf32(torch.float32)
        torch.backends.cuda.matmul.allow_tf32 = True
        assert linear_gns_kernel._tf32(torch.float32) and not linear_gns_kernel._tf32(torch.bfloat16)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed


@this_process
def test_op_is_one_node_under_torch_compile():
    """torch.compile sees the registered op as one node: no graph break (fullgraph), no mutated
    input; its fake (the traced implementation) gives the outputs' shapes. The graph is only traced
    here: on the CPU there is no GPU to run it on."""
    x, dy = inputs(2, 3, 20, 24, torch.bfloat16, device="cpu")
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return lambda *args: [t.clone() for t in reference(x, dy)]

    torch._dynamo.reset()
    compiled = torch.compile(lambda x, dy: linear_gns_kernel._op(x, dy, True), fullgraph=True, backend=record)
    compiled(x, dy)
    torch._dynamo.reset()
    targets = [node.target for node in graphs[0].graph.nodes if node.op == "call_function"]
    op = torch.ops.linear_gns.per_example_weight_grad.default
    assert targets.count(op) == 1
    assert op._schema.is_mutable is False
    from torch.fx.experimental.proxy_tensor import make_fx
    traced = make_fx(lambda x, dy: linear_gns_kernel._op(x, dy, False), tracing_mode="fake")(x, dy)
    outputs = [node for node in traced.graph.nodes if node.op == "output"][0].args[0]
    assert [tuple(o.meta["val"].shape) for o in outputs] == [(1,), (2,)]
    # a tiling of the routes table (the examples in 2 runs): the op takes it, its dW partials summed
    config = linear_gns_kernel.config_of("16x16 t16 w4 s1 split2")
    traced = make_fx(lambda x, dy: linear_gns_kernel._op(x, dy, True, **config), tracing_mode="fake")(x, dy)
    outputs = [node for node in traced.graph.nodes if node.op == "output"][0].args[0]
    assert [tuple(o.meta["val"].shape) for o in outputs] == [(24, 20), (2,)]


class LaunchRecorder:
    """Stands in for the kernel in linear_gns_kernel._launch: keeps each launch, as the eager launch makes
    it (fused multiply-add said explicitly), for triton_aot to compile."""
    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        from nanogns.normgnorm.triton_aot import Launch
        return lambda *args, **kwargs: self.launches.append(
            Launch(linear_gns_kernel._weight_grad_kernel, tuple(grid), args, dict(kwargs, enable_fp_fusion=True)))


@this_process
@pytest.mark.parametrize("arch", [80, 90])
def test_kernel_compiles_for_gpus_without_spilling(arch):
    """The launches TUNING gives GPT-2 small's MLP, compiled by Triton's GPU compiler for A100
    (sm_80) and H100 (sm_90) with no GPU here: code that the interpreter runs but that does not
    lower (tl.dot's shapes and dtypes) fails, and so does a tile that spills its registers."""
    from nanogns.normgnorm.triton_aot import compile_launch

    recorder = LaunchRecorder()
    allowed = torch.backends.cuda.matmul.allow_tf32
    try:
        # bfloat16; float32 in full precision, and as TF32 (train.py allows it)
        for dtype, tf32 in ((torch.bfloat16, False), (torch.float32, False), (torch.float32, True)):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            x = torch.empty(8, 1024, 768, dtype=dtype, device="meta")
            dy = torch.empty(8, 1024, 3072, dtype=dtype, device="meta")
            linear_gns_kernel._launch(x, dy, True, kernel=recorder)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed
    assert [launch.kwargs["TF32"] for launch in recorder.launches] == [False, False, True]
    compiled = [compile_launch(launch, arch) for launch in recorder.launches]
    spilled = [str(c) for c in compiled if c.stack_bytes]
    assert not spilled, "\n".join(spilled)
    assert all(c.programs_per_sm >= 1 for c in compiled)


@this_process
def test_kernel_offsets_are_64_bit():
    """Every offset the kernel multiplies out is int64 in its compiled code (Triton's IR: no 32-bit
    tensor multiply is left): a transposed input's token or feature stride times its index can
    pass 2^31, which 32 bits would wrap. Compiled for sm_90, with dy a transposed view (no stride 1)."""
    from nanogns.normgnorm.triton_aot import compile_launch

    recorder = LaunchRecorder()
    x = torch.empty(8, 1024, 768, dtype=torch.bfloat16, device="meta")
    dy = torch.empty(3072, 8, 1024, dtype=torch.bfloat16, device="meta").permute(1, 2, 0)
    linear_gns_kernel._launch(x, dy, True, kernel=recorder)
    ttir = compile_launch(recorder.launches[0], 90).asm["ttir"]
    multiplies = [line.strip() for line in ttir.splitlines() if "arith.muli" in line and "tensor<" in line]
    assert multiplies and not [m for m in multiplies if "xi32>" in m], "\n".join(multiplies)


@this_process
def test_tiling_labels_name_plans_configurations():
    """The sweep's table names a kernel route by its tiling: config_of reads it, label_of writes it back,
    and anything else is one line that says how to write one."""
    assert linear_gns_kernel.config_of("128x256 t64 w8 s4") == dict(block_l=128, block_k=256, block_t=64, num_warps=8,
                                                                   num_stages=4)
    for label in ("128x128 t32 w8 s3", "64x64 t32 w4 s3 split2"):
        assert linear_gns_kernel.label_of(linear_gns_kernel.config_of(label)) == label
    for bad in ("128x128", "128x128 w8 t32 s3", "128x128 t32 w8 s3 split", "big"):
        with pytest.raises(ValueError, match="write it as 'LxK tT wW sS'"):
            linear_gns_kernel.config_of(bad)


@this_process
def test_the_sweeps_tilings_compile_for_an_h100_and_only_the_widest_spill():
    """The tilings bench/gpu_check.py's linear sweep times, compiled for sm_90 at GPT-2 small's MLP in
    bfloat16: each compiles; the 128 x 256 tiles hold two float32 accumulators of 32K values each,
    more than the registers of 8 warps, so they spill (the sweep times them all the same) and the
    others do not."""
    from nanogns.normgnorm.triton_aot import Launch, compile_launch
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import gpu_check
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(
                Launch(linear_gns_kernel._weight_grad_kernel, tuple(grid), args, dict(kwargs, enable_fp_fusion=True)))

    tilings = sorted({label.split(" split")[0] for label in gpu_check.LINEAR_TILINGS})  # a split is no new compile
    for label in tilings:
        x = torch.empty(8, 1024, 768, dtype=torch.bfloat16, device="meta")
        dy = torch.empty(8, 1024, 3072, dtype=torch.bfloat16, device="meta")
        linear_gns_kernel._launch(x, dy, True, kernel=Recorder(), **linear_gns_kernel.config_of(label))
    spilled = [label for label, launch in zip(tilings, launches) if compile_launch(launch, 90).stack_bytes]
    assert spilled == [label for label in tilings if label.startswith("128x256")]
