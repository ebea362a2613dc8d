"""
normgnorm: LayerNorm (and RMSNorm) whose backward also accumulates per-example Σ_b ||dγ_b||²,
Σ_b ||dβ_b||².

Every implementation is checked against two oracles, both in float64 from the same inputs:
torch's LayerNorm (or RMSNorm) autograd (output, dx, dγ, dβ) and the shared per-example oracle of
tests/gns_fixtures.py (the squared norms). The pure-PyTorch path and the CPU kernel run here; the
Triton kernels run on CPU under the Triton interpreter (small shapes); the CUDA sources are compiled
(no GPU here) and both GPU backends run against the oracles where a GPU exists.
"""
import os
import shutil
import subprocess
import sys
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nanogns.normgnorm as normgnorm
from gns_fixtures import output_grad_loss, sqgradnorm_sums
from nanogns.normgnorm import cpu_ext, cuda_ext
from nanogns.normgnorm.torch_path import rms_norm_eps

EPS = 1e-5
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_CUDA = torch.cuda.is_available()

# Outputs and gradients in low precision are compared with the float64 oracle after rounding
# to the dtype (about one unit in the last place); the squared-norm buffers are float32 sums of
# products of the same inputs, so they are tight whatever the input dtype.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5),
       torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
       torch.float16: dict(rtol=2e-3, atol=2e-3)}
BUFFER_TOL = dict(rtol=1e-4, atol=1e-6)


def oracle(x, weight, bias, dy, rms=False, eps=EPS, dtype=torch.float64):
    """float64: y, dx, dw, db by torch's LayerNorm (rms: RMSNorm) autograd; Σ_b ||dγ_b||², Σ_b ||dβ_b||²
    by the shared oracle. dtype: compute in another (float32: torch's eps=None is float32's)."""
    D = x.shape[-1]
    if rms:
        plain = nn.RMSNorm(D, eps, device=x.device, dtype=dtype)
    else:
        plain = nn.LayerNorm(D, eps, bias=bias is not None, device=x.device, dtype=dtype)
    with torch.no_grad():
        plain.weight.copy_(weight)
        if bias is not None:
            plain.bias.copy_(bias)
    xd = x.detach().to(dtype).requires_grad_()
    y = plain(xd)
    y.backward(dy.to(dtype))
    num_examples = x.shape[0] if x.dim() >= 2 else 1
    examples = xd.detach().reshape(num_examples, -1, D), dy.to(dtype).reshape(num_examples, -1, D)
    sq = sqgradnorm_sums(plain, output_grad_loss, [examples], mean=False)  # the layer sees dy: a sum, not a mean
    db = plain.bias.grad if bias is not None else None
    return dict(y=y.detach().double(), dx=xd.grad.double(), dw=plain.weight.grad.double(),
                db=None if db is None else db.double(), sq_w=sq["weight"], sq_b=sq.get("bias"), count=num_examples)


def make_inputs(shape, dtype, bias, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    D = shape[-1]
    x = (torch.randn(shape, generator=g) * 2 + 0.5).to(device=device, dtype=dtype)
    dy = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    weight = (1 + 0.5 * torch.randn(D, generator=g)).to(device=device, dtype=dtype)
    b = (0.1 * torch.randn(D, generator=g)).to(device=device, dtype=dtype) if bias else None
    return x, dy, weight, b


def sink_for(sq_w, sq_b, count):
    """A sink as the measured layers keep one: a float32 leaf whose gradient, the per-example sums
    [Σ_b ||dγ_b||², Σ_b ||dβ_b||², B], is added to the buffers as it lands."""
    sink = torch.zeros(3, device=count.device, requires_grad=True)

    def add(sink):
        grad, sink.grad = sink.grad, None
        for buf, part in zip((sq_w, sq_b, count), grad):
            if buf is not None:
                buf.add_(part)
    sink.register_post_accumulate_grad_hook(add)
    return sink


def through_sink(x, weight, b, sq_w, sq_b, count, eps, backend):
    """The compiled route, called eagerly: the Function given a sink, whose backward runs the torch
    path whatever the backend and hands the sums out as the sink's gradient."""
    return normgnorm._NormFn.apply(x, weight, b, sq_w, sq_b, count, sink_for(sq_w, sq_b, count), eps, backend or "",
                                   False)


def reference_call(x, weight, b, sq_w, sq_b, count, eps, backend):
    """PEGLayerNorm.apply with the reference implementation's seven arguments, then ours."""
    return normgnorm.PEGLayerNorm.apply(x, weight, b, sq_w, sq_b, (x.shape[-1],), eps, count, backend)


ENTRIES = {"eager": normgnorm.layer_norm, "sink": through_sink, "PEGLayerNorm": reference_call}


# RMSNorm's entries, called as the LayerNorm ones are (its bias and bias buffer are None)
def rms_eager(x, weight, b, sq_w, sq_b, count, eps, backend):
    assert b is None and sq_b is None
    return normgnorm.rms_norm(x, weight, sq_w, count, eps, backend)


def rms_through_sink(x, weight, b, sq_w, sq_b, count, eps, backend):
    """RMSNorm's compiled route, called eagerly (see through_sink)."""
    assert b is None and sq_b is None
    return normgnorm._NormFn.apply(x, weight, None, sq_w, None, count, sink_for(sq_w, None, count),
                                   rms_norm_eps(eps, x.dtype), backend or "", True)


RMS_ENTRIES = {"rms eager": rms_eager, "rms sink": rms_through_sink}
# the entries that run the backend asked for (the sink's run the torch path whatever the backend)
BACKEND_ENTRIES = ["eager", "PEGLayerNorm", "rms eager"]


def assert_close_summed(got, want, dtype):
    """A parameter gradient: a sum over every row of both micro-steps, each step's sum rounded to
    dtype before autograd adds them. Its rounding error scales with the summands, not with the
    entry (an entry that cancels to near zero keeps the error of its large parts), so the
    absolute tolerance is the dtype's, times the largest entry."""
    tol = TOL[dtype]
    scale = max(1.0, want.abs().max().item())
    torch.testing.assert_close(got.double(), want.to(dtype).double(), rtol=tol["rtol"], atol=tol["atol"] * scale)


def check_op(shapes, dtype, bias, backend, device="cpu", layer_norm=normgnorm.layer_norm):
    """Two calls (two gradient-accumulation micro-steps, different data) through the autograd op;
    an RMSNorm entry (bias False) against the RMSNorm oracle."""
    rms = layer_norm in RMS_ENTRIES.values()
    weight0 = make_inputs(shapes[0], dtype, bias, seed=0, device=device)[2]
    weight = weight0.clone().requires_grad_()
    b = make_inputs(shapes[0], dtype, bias, seed=0, device=device)[3]
    b = b.clone().requires_grad_() if bias else None
    f32 = dict(dtype=torch.float32, device=device)
    sq_w, sq_b, count = torch.zeros((), **f32), torch.zeros((), **f32) if bias else None, torch.zeros((), **f32)
    want = dict(dw=0, db=0, sq_w=0, sq_b=0, count=0)
    for call, shape in enumerate(shapes):
        x, dy, _, _ = make_inputs(shape, dtype, bias, seed=call + 1, device=device)
        x.requires_grad_()
        y = layer_norm(x, weight, b, sq_w, sq_b, count, EPS, backend)
        y.backward(dy)
        ref = oracle(x, weight, b, dy, rms)
        tol = TOL[dtype]
        assert y.dtype == dtype and x.grad.dtype == dtype
        torch.testing.assert_close(y.double(), ref["y"].to(dtype).double(), **tol)
        torch.testing.assert_close(x.grad.double(), ref["dx"].to(dtype).double(), **tol)
        for k in want:
            if ref.get(k) is not None:
                want[k] = want[k] + ref[k]
    assert_close_summed(weight.grad, want["dw"], dtype)
    assert sq_w.dtype == torch.float32
    torch.testing.assert_close(sq_w.double(), want["sq_w"], **BUFFER_TOL)
    if bias:
        assert_close_summed(b.grad, want["db"], dtype)
        torch.testing.assert_close(sq_b.double(), want["sq_b"], **BUFFER_TOL)
    assert count.item() == want["count"]


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = {"3d": [(3, 5, 40), (2, 7, 40)], "2d": [(6, 40), (4, 40)], "4d": [(2, 3, 2, 24), (2, 3, 2, 24)],
          "1d": [(40,), (40,)]}  # 1-D: one example of one token, as torch's LayerNorm takes it


# ---------------------------------------------------------------- the pure-PyTorch path (CPU)

@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_torch_path_matches_oracles(dtype, bias, shape, entry):
    check_op(SHAPES[shape], dtype, bias, backend="torch", layer_norm=ENTRIES[entry])


# ---------------------------------------------------------------- the CPU kernel (cpu_ext.py)

@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the C kernel's calls, so that a test knows it ran (and not the PyTorch path)."""
    if shutil.which(cpu_ext.compiler_command()[0]) is None:
        pytest.skip(f"no C compiler ({cpu_ext.compiler()})")
    fn, calls = cpu_ext.kernel(), []
    assert fn is not None, cpu_ext._kernel  # a compiler is here: the kernel must build

    def counted(*args):
        calls.append(args)
        return fn(*args)
    monkeypatch.setattr(cpu_ext, "_kernel", counted)
    return calls


@pytest.mark.parametrize("threads", [1, 2, 8])
@pytest.mark.parametrize("entry,bias", [(e, b) for e in ENTRIES if e in BACKEND_ENTRIES for b in (True, False)]
                         + [(e, False) for e in RMS_ENTRIES if e in BACKEND_ENTRIES])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_cpu_kernel_matches_oracles(kernel_calls, bias, shape, entry, threads):
    layer_norm = {**ENTRIES, **RMS_ENTRIES}[entry]
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check_op(SHAPES[shape], torch.float32, bias, backend="cpu", layer_norm=layer_norm)
    finally:
        torch.set_num_threads(saved)
    # two micro-steps: the kernel ran both, each on no more threads than that call has examples
    examples = [1 if len(s) == 1 else s[0] for s in SHAPES[shape]]
    assert [call[-1] for call in kernel_calls] == [min(threads, b) for b in examples]


def test_cpu_kernel_runs_fewer_examples_than_threads_one_thread_each(kernel_calls):
    # 3 examples on 8 threads: the kernel runs (on 3 threads) rather than the PyTorch path. Each
    # example is one thread's, summed in one order, so dx, dγ, dβ and the per-example gradients are
    # bitwise those of one thread; the squared norms' double sums split by feature, so to rounding.
    x, dy, weight, b = make_inputs((3, 5, 40), torch.float32, True, seed=13)
    mean = x.mean(-1, keepdim=True)
    rstd = x.var(-1, unbiased=False, keepdim=True).add(EPS).rsqrt()
    results = {}
    saved = torch.get_num_threads()
    try:
        for threads in (8, 1):
            torch.set_num_threads(threads)
            xg, wg, bg = (t.clone().requires_grad_() for t in (x, weight, b))
            bufs = [torch.zeros(()) for _ in range(3)]
            normgnorm.layer_norm(xg, wg, bg, *bufs, EPS, "cpu").backward(dy)
            alone = [torch.zeros(()), torch.zeros(())]
            with torch.no_grad():  # as in a separated layer's backward
                per_example = cpu_ext.per_example_grads(dy, x, mean, rstd, True, True, *alone)
            results[threads] = [xg.grad, wg.grad, bg.grad, bufs[2], *per_example], [*bufs[:2], *alone]
    finally:
        torch.set_num_threads(saved)
    assert [call[-1] for call in kernel_calls] == [3, 3, 1, 1]
    (exact8, sq8), (exact1, sq1) = results[8], results[1]
    for ours, one_thread in zip(exact8, exact1):
        assert torch.equal(ours, one_thread)
    torch.testing.assert_close(sq8, sq1, rtol=1e-6, atol=0)
    ref = oracle(x, weight, b, dy)
    for got, k in zip(exact8, ("dx", "dw", "db", "count")):
        torch.testing.assert_close(got.double(), torch.as_tensor(ref[k], dtype=torch.float64), **TOL[torch.float32])
    for got, k in zip(sq8, ("sq_w", "sq_b", "sq_w", "sq_b")):
        torch.testing.assert_close(got.double(), torch.as_tensor(ref[k], dtype=torch.float64), **BUFFER_TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cpu_backend_runs_the_pytorch_path_where_the_kernel_takes_no_input(kernel_calls, dtype):
    check_op(SHAPES["3d"], dtype, True, backend="cpu")
    assert kernel_calls == []


def test_cpu_kernel_is_the_default_in_eager_mode_and_matches_the_torch_path(kernel_calls):
    results = {}
    for backend in ("", "torch"):
        x, dy, weight, b = make_inputs((4, 9, 40), torch.float32, True, seed=5)
        x, weight, b = x.requires_grad_(), weight.requires_grad_(), b.requires_grad_()
        bufs = [torch.zeros(()) for _ in range(3)]
        normgnorm.layer_norm(x, weight, b, *bufs, EPS, backend).backward(dy)
        results[backend] = [x.grad, weight.grad, b.grad, *bufs]
    assert len(kernel_calls) == 1
    for ours, torchs in zip(results[""], results["torch"]):
        torch.testing.assert_close(ours, torchs, rtol=2e-6, atol=2e-6)


def test_cpu_kernel_without_a_compiler_warns_once_and_the_pytorch_path_runs(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(cpu_ext, "_kernel", None)
    with pytest.warns(UserWarning, match="the CPU kernel could not be built .*no-such-compiler.*PyTorch path runs") as seen:
        check_op(SHAPES["3d"], torch.float32, True, backend="cpu")
    assert len(seen) == 1 and isinstance(cpu_ext._kernel, str)


@pytest.mark.skipif(shutil.which(cpu_ext.compiler_command()[0]) is None, reason="no C compiler")
def test_cpu_kernel_is_built_once_into_a_file_named_by_its_source_and_cpu(tmp_path):
    path = cpu_ext.library_path(str(tmp_path))
    assert os.path.dirname(path) == str(tmp_path) and not os.path.exists(path)
    fn = cpu_ext.build(str(tmp_path))
    assert fn is not None and os.listdir(tmp_path) == [os.path.basename(path)]  # renamed into place, no leftovers
    built = os.path.getmtime(path)
    cpu_ext.build(str(tmp_path))
    assert os.path.getmtime(path) == built


def test_cpu_kernel_builds_from_two_threads_at_once_each_into_a_file_of_its_own(tmp_path, monkeypatch):
    import threading
    targets, both_started = [], threading.Barrier(2)

    def fake_compiler(cmd, **kwargs):  # both builds have chosen their file before either writes
        target = cmd[cmd.index("-o") + 1]
        targets.append(target)
        both_started.wait(timeout=10)
        with open(target, "w") as f:
            f.write("not a library")
        return subprocess.CompletedProcess(cmd, 0, "", "")
    monkeypatch.setattr(cpu_ext.subprocess, "run", fake_compiler)
    monkeypatch.setattr(cpu_ext.ctypes, "CDLL", lambda path: types.SimpleNamespace(
        normgnorm_cpu_backward=types.SimpleNamespace()))
    errors = []

    def build():
        try:
            cpu_ext.build(str(tmp_path))
        except Exception as e:  # noqa: BLE001 (reported below, from the test's thread)
            errors.append(e)
    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(targets) == 2 and targets[0] != targets[1]
    assert os.listdir(tmp_path) == [os.path.basename(cpu_ext.library_path(str(tmp_path)))]


def test_cpu_kernel_failed_build_leaves_nothing_behind(tmp_path, monkeypatch):
    # a compiler that writes part of its output, then fails
    compiler = tmp_path / "half-a-compiler"
    compiler.write_text('#!/bin/sh\nwhile [ "$1" != "-o" ]; do shift; done\necho partial > "$2"\nexit 1\n')
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    build_dir = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="exited with 1"):
        cpu_ext.build(str(build_dir))
    assert os.listdir(build_dir) == []


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_cpu_kernel_compiler_may_carry_arguments(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", f"{shutil.which('cc')} -w")  # as CC="ccache gcc" is written
    assert cpu_ext.build(str(tmp_path)) is not None


def test_cpu_kernel_entry_points_refuse_sizes_they_would_read_past():
    x, dy, weight, _ = make_inputs((2, 8, 40), torch.float32, False, seed=4)
    short = torch.ones(3)  # 3 statistics for B*T = 16 rows
    bufs = [torch.zeros(()) for _ in range(3)]
    with torch.no_grad():
        with pytest.raises(ValueError, match="rstd has 3 elements, not 16"):
            cpu_ext.backward(dy, x, weight, torch.zeros(16), short, 2, True, True, *bufs)
        with pytest.raises(ValueError, match="weight has 39 elements, not 40"):
            cpu_ext.backward(dy, x, weight[:39], None, torch.ones(16), 2, True, False, bufs[0], None, bufs[2])
        with pytest.raises(ValueError, match="mean has 3 elements, not 16"):
            cpu_ext.per_example_grads(dy, x, short, torch.ones(2, 8, 1), True, True, bufs[0], bufs[1])
        with pytest.raises(ValueError, match=r"dy \(2, 8, 39\) is not x's shape"):
            cpu_ext.per_example_grads(dy[..., :39], x, None, torch.ones(2, 8, 1), True, False, bufs[0], None)


def test_cpu_kernel_under_create_graph_runs_the_differentiable_path(kernel_calls):
    x, dy, weight, b = make_inputs((3, 5, 40), torch.float32, True, seed=2)
    x, weight = x.requires_grad_(), weight.requires_grad_()
    bufs = [torch.zeros(()) for _ in range(3)]
    (dx,) = torch.autograd.grad(normgnorm.layer_norm(x, weight, b, *bufs, EPS, "cpu"), x, dy, create_graph=True)
    assert dx.requires_grad and kernel_calls == []


@pytest.mark.parametrize("need", ["dw", "db", "both"])
@pytest.mark.parametrize("rms", [False, True], ids=["LayerNorm", "RMSNorm"])
def test_cpu_kernel_per_example_grads_alone_match_the_torch_path(kernel_calls, rms, need):
    # what the separated layers ask for: dγ_b, dβ_b and their squared norms, no dx
    need_dw, need_db = need in ("dw", "both"), need in ("db", "both") and not rms
    x, dy, _, _ = make_inputs((4, 9, 40), torch.float32, False, seed=21)
    mean = None if rms else x.mean(-1, keepdim=True)
    rstd = (x.square().mean(-1, keepdim=True) if rms else x.var(-1, unbiased=False, keepdim=True)).add(EPS).rsqrt()
    results = []
    for kernel in (True, False):
        bufs = [torch.zeros(()), torch.zeros(())]
        if kernel:
            with torch.no_grad():  # as in a backward
                grads = cpu_ext.per_example_grads(dy, x, mean, rstd, need_dw, need_db, *bufs)
        else:
            grads = normgnorm.torch_path.per_example_affine_grads(dy, x, mean, rstd, need_dw, need_db)
            for buf, g in zip(bufs, grads):
                if g is not None:
                    buf.add_(g.double().square().sum().float())
        results.append((grads, bufs))
    (ours, our_bufs), (torchs, torch_bufs) = results
    for a, b in zip(ours, torchs):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(our_bufs, torch_bufs, rtol=1e-5, atol=0)
    assert len(kernel_calls) == (1 if need_dw else 0)  # a frozen gain: the PyTorch path


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_parameter_gradients_of_long_sequences_within_their_rounding(dtype):
    """At a GPT's sizes dγ, dβ sum hundreds of rows per micro-step, each step rounded to the
    dtype: the check scales with the sum's parts (an entry-wise tolerance fails here, for torch's
    own LayerNorm too)."""
    check_op([(2, 256, 768), (2, 256, 768)], dtype, True, backend="torch")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_torch_path_one_example_at_a_time(monkeypatch, dtype):
    monkeypatch.setattr(normgnorm.torch_path, "CPU_CHUNK_NUMEL", 1)
    check_op(SHAPES["3d"], dtype, True, backend="torch")


@pytest.mark.parametrize("rms", [False, True])
def test_torch_path_scratch_shared_by_layers_of_one_shape(rms):
    """Two layers of one shape share the thread's scratch tensor in eager mode: each still gets
    its own exact norms, and a chunked pass writes the same scratch a slice at a time."""
    torch_path = normgnorm.torch_path
    x, dy, weight, b = make_inputs((3, 5, 40), torch.float32, not rms, seed=11)
    x2, dy2 = make_inputs((3, 5, 40), torch.float32, False, seed=12)[:2]
    refs = [oracle(x, weight, b, dy, rms=rms, dtype=torch.float32), oracle(x2, weight, b, dy2, rms=rms, dtype=torch.float32)]
    grads = []
    for inp, grad in ((x, dy), (x2, dy2)):
        bufs = torch.zeros(()), torch.zeros(()), torch.zeros(())
        xx, w = inp.clone().requires_grad_(), weight.clone().requires_grad_()  # dγ needed: the scratch is used
        y = (normgnorm.rms_norm(xx, w, bufs[0], bufs[2], None, "torch") if rms
             else normgnorm.layer_norm(xx, w, b, *bufs, EPS, "torch"))
        y.backward(grad)
        grads.append((xx.grad, bufs))
    kept = torch_path._scratch_of_thread.tensor
    assert kept.shape == (3, 5, 40)
    assert torch_path._scratch((3, 5, 40), torch.float32, x.device) is kept  # reused, not allocated again
    for (dx, bufs), ref in zip(grads, refs):
        torch.testing.assert_close(dx.double(), ref["dx"], **TOL[torch.float32])
        torch.testing.assert_close(bufs[0].double(), ref["sq_w"], **BUFFER_TOL)
    # per_example_affine_grads with and without the scratch, whole and one example at a time
    x3, dy3 = x.detach(), dy
    mean3 = None if rms else x3.mean(-1, keepdim=True)
    rstd3 = x3.var(-1, unbiased=False, keepdim=True).add(EPS).rsqrt()
    fresh = torch_path.per_example_affine_grads(dy3, x3, mean3, rstd3, True, not rms)
    for chunk in (torch_path.CPU_CHUNK_NUMEL, 1):
        torch_path.CPU_CHUNK_NUMEL, saved = chunk, torch_path.CPU_CHUNK_NUMEL
        try:
            reused = torch_path.per_example_affine_grads(dy3, x3, mean3, rstd3, True, not rms, reuse_scratch=True)
        finally:
            torch_path.CPU_CHUNK_NUMEL = saved
        for a, c in zip(fresh, reused):
            if a is not None:
                torch.testing.assert_close(c, a, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("rms", [False, True])
def test_torch_path_backward_with_create_graph(rms):
    """A backward that records its own graph (create_graph=True, e.g. a gradient penalty) gets the
    same dx and norms: the scratch, written with out=, which autograd cannot record, is not used."""
    x, dy, weight, b = make_inputs((3, 5, 40), torch.float32, not rms, seed=13)
    ref = oracle(x, weight, b, dy, rms=rms, dtype=torch.float32)
    bufs = torch.zeros(()), torch.zeros(()), torch.zeros(())
    xx, w = x.clone().requires_grad_(), weight.clone().requires_grad_()
    y = (normgnorm.rms_norm(xx, w, bufs[0], bufs[2], None, "torch") if rms
         else normgnorm.layer_norm(xx, w, b, *bufs, EPS, "torch"))
    dx, = torch.autograd.grad(y, xx, dy, create_graph=True)
    torch.testing.assert_close(dx.detach().double(), ref["dx"], **TOL[torch.float32])
    torch.testing.assert_close(bufs[0].double(), ref["sq_w"], **BUFFER_TOL)


# -- autocast: each normalisation's output dtype is the one torch's own op gives on that device

def torch_op_upcasts_under_cpu_autocast(rms, dtype):
    """What torch itself does under CPU autocast: a half-precision input with a float32 gain, a float32 output?"""
    x, weight = torch.randn(2, 3, 8).to(dtype), torch.ones(8)
    with torch.autocast("cpu", dtype=dtype):
        y = torch.rms_norm(x, (8,), weight) if rms else torch.layer_norm(x, (8,), weight)
    return y.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_cpu_autocast_rule_and_output_dtype_are_torchs(rms, dtype, backend):
    upcasts = torch_op_upcasts_under_cpu_autocast(rms, dtype)
    assert normgnorm.autocast_runs_in_float32("cpu", rms) == upcasts
    x, _, weight, b = make_inputs((2, 3, 8), torch.float32, not rms, seed=4)
    sq_w, sq_b, count = torch.zeros(()), torch.zeros(()), torch.zeros(())
    with torch.autocast("cpu", dtype=dtype):
        h = F.linear(x, torch.eye(8))  # half precision, as a model's Linear gives it
        y = (normgnorm.rms_norm(h, weight, sq_w, count, None, backend) if rms
             else normgnorm.layer_norm(h, weight, b, sq_w, sq_b, count, EPS, backend))
        want = torch.rms_norm(h, (8,), weight) if rms else torch.layer_norm(h, (8,), weight, b, EPS)
    assert h.dtype == dtype and y.dtype == want.dtype == (torch.float32 if upcasts else dtype)
    torch.testing.assert_close(y, want, **TOL[y.dtype])


def test_cuda_autocast_rule_is_torchs_for_the_installed_version():
    """torch's CUDA autocast runs layer_norm in float32, and rms_norm since torch 2.12 (2.11 left it in
    the input's dtype: its nn.RMSNorm returned bfloat16 under bfloat16 autocast, and so does ours there)."""
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    assert normgnorm.autocast_runs_in_float32("cuda", rms=False)
    assert normgnorm.autocast_runs_in_float32("cuda", rms=True) == ((major, minor) >= (2, 12))


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_autocast_upcasts_on_any_device_whose_autocast_runs_the_op_in_float32(monkeypatch, rms, backend):
    """Not only CUDA's: torch's autocast runs layer_norm in float32 on XPU and MPS too. Here the CPU's rule
    is made so: the layer computes from float32 copies and returns float32, as torch's op would."""
    monkeypatch.setitem(normgnorm.AUTOCAST_FLOAT32, ("cpu", rms), True)
    x, dy, weight, b = make_inputs((2, 3, 8), torch.float32, not rms, seed=5)
    h, weight = x.bfloat16().requires_grad_(), weight.requires_grad_()
    sq_w, sq_b, count = torch.zeros(()), torch.zeros(()), torch.zeros(())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = (normgnorm.rms_norm(h, weight, sq_w, count, None, backend) if rms
             else normgnorm.layer_norm(h, weight, b, sq_w, sq_b, count, EPS, backend))
    want = F.rms_norm(h.float(), (8,), weight) if rms else F.layer_norm(h.float(), (8,), weight, b, EPS)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, want)
    y.backward(dy)
    ref = oracle(h.detach().float(), weight.detach(), b, dy, rms=rms, eps=rms_norm_eps(None, torch.float32) if rms else EPS)
    assert h.grad.dtype == torch.bfloat16
    torch.testing.assert_close(sq_w.double(), ref["sq_w"], **BUFFER_TOL)


def test_torch_path_scratch_is_per_thread():
    """autograd may run two backward passes at once on two threads: each has its own scratch."""
    import threading
    torch_path = normgnorm.torch_path
    seen = {}
    thread = threading.Thread(target=lambda: seen.update(other=torch_path._scratch((4, 4), torch.float32, torch.device("cpu"))))
    mine = torch_path._scratch((4, 4), torch.float32, torch.device("cpu"))
    thread.start()
    thread.join(timeout=60)
    assert seen["other"] is not mine and seen["other"].data_ptr() != mine.data_ptr()


def test_a_sink_takes_the_sums_and_the_buffers_stay_untouched(kernel_calls):
    """Given a sink, the backward returns the per-example sums as its gradient, runs the torch path
    (not the kernel asked for) and writes nothing into the buffers."""
    x, dy, weight, b = make_inputs((3, 5, 40), torch.float32, True, seed=2)
    x.requires_grad_()
    bufs = [torch.zeros(()) for _ in range(3)]
    sink = torch.zeros(3, requires_grad=True)
    y = normgnorm._NormFn.apply(x, weight.requires_grad_(), b.requires_grad_(), *bufs, sink, EPS, "cpu", False)
    assert type(y.grad_fn).__name__ == "_NormFnBackward"  # not the reference adapter
    y.backward(dy)
    ref = oracle(x, weight, b, dy)
    assert [buf.item() for buf in bufs] == [0, 0, 0] and not kernel_calls
    torch.testing.assert_close(sink.grad.double(), torch.stack([ref["sq_w"], ref["sq_b"], torch.tensor(3.0).double()]),
                               **BUFFER_TOL)


@pytest.mark.parametrize("bias", [True, False])
def test_peglayernorm_called_as_the_reference_does(bias):
    """Seven arguments, no example counter: the same outputs, gradients and buffers as layer_norm."""
    x, dy, weight, b = make_inputs((3, 5, 40), torch.float32, bias, seed=6)
    x.requires_grad_()
    w = weight.clone().requires_grad_()
    bb = b.clone().requires_grad_() if bias else None
    sq_w, sq_b = torch.zeros(()), torch.zeros(()) if bias else None
    y = normgnorm.PEGLayerNorm.apply(x, w, bb, sq_w, sq_b, (40,), EPS)
    y.backward(dy)
    ref = oracle(x, weight, b, dy)
    torch.testing.assert_close(y.double(), ref["y"], **TOL[torch.float32])
    torch.testing.assert_close(x.grad.double(), ref["dx"], **TOL[torch.float32])
    torch.testing.assert_close(w.grad.double(), ref["dw"], **TOL[torch.float32])
    torch.testing.assert_close(sq_w.double(), ref["sq_w"], **BUFFER_TOL)
    if bias:
        torch.testing.assert_close(bb.grad.double(), ref["db"], **TOL[torch.float32])
        torch.testing.assert_close(sq_b.double(), ref["sq_b"], **BUFFER_TOL)


@pytest.mark.parametrize("normalized_shape,weight_size", [((8,), 8), (8, 8), ((4, 8), 8), ((4,), 4), ((8,), 4)])
def test_peglayernorm_normalizes_the_last_dimension_only(normalized_shape, weight_size):
    x = torch.randn(2, 4, 8, requires_grad=True)
    weight = torch.ones(weight_size, requires_grad=True)
    sq_w, count = torch.zeros(()), torch.zeros(())
    call = lambda: normgnorm.PEGLayerNorm.apply(x, weight, None, sq_w, None, normalized_shape, EPS, count)
    if normalized_shape in ((8,), 8) and weight_size == 8:
        call().sum().backward()
        assert count.item() == 2
    else:
        with pytest.raises(ValueError, match="last dimension only"):
            call()


def check_peglayernorm_compiled(shape, backend, pairs=False):
    """PEGLayerNorm.apply called directly, eager and under torch.compile (one graph: fullgraph):
    the same input and parameter gradients, buffers and example count. pairs: the reference's
    [sum, count] buffers, and no example_count."""
    torch._dynamo.reset()
    x, dy, weight, b = make_inputs(shape, torch.float32, True, seed=7)
    results = []
    for compiled in (False, True):
        w, bb = weight.clone().requires_grad_(), b.clone().requires_grad_()
        bufs = (torch.zeros(2), torch.zeros(2)) if pairs else (torch.zeros(()), torch.zeros(()), torch.zeros(()))
        xi = x.clone().requires_grad_()

        def step(xi):
            y = normgnorm.PEGLayerNorm.apply(xi, w, bb, bufs[0], bufs[1], shape[-1:], EPS,
                                             None if pairs else bufs[2], backend)
            return (y * dy).sum()
        if compiled:
            step = torch.compile(step, backend="aot_eager", fullgraph=True)
        step(xi).backward()
        results.append((xi.grad, w.grad, bb.grad) + bufs)
    for eager_value, compiled_value in zip(*results):
        torch.testing.assert_close(compiled_value, eager_value)
    if pairs:
        assert results[1][-1][0].item() > 0 and results[1][-1][1].item() == shape[0]
    else:
        assert results[1][-1].item() == shape[0]
    torch._dynamo.reset()


@pytest.mark.parametrize("pairs", [False, True])
def test_peglayernorm_compiles_without_graph_breaks(pairs):
    check_peglayernorm_compiled((3, 5, 40), "torch", pairs)


@pytest.mark.parametrize("example_count", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_peglayernorm_with_the_references_sum_count_pairs(bias, example_count):
    """The reference's buffers, torch.zeros(2) each: after each backward [Σ_b ||dγ_b||², B] is added
    to the weight's and [Σ_b ||dβ_b||², B] to the bias's, as the reference adds them; two micro-steps.
    Without a bias its pair is left alone. An example_count given as well counts too."""
    shapes = SHAPES["3d"]
    weight0, b0 = make_inputs(shapes[0], torch.float32, bias, seed=0)[2:]
    w = weight0.clone().requires_grad_()
    bb = b0.clone().requires_grad_() if bias else None
    w_pair, b_pair, count = torch.zeros(2), torch.zeros(2), torch.zeros(())
    want_w = want_b = 0
    for call, shape in enumerate(shapes):
        x, dy, _, _ = make_inputs(shape, torch.float32, bias, seed=call + 1)
        x.requires_grad_()
        extra = (count,) if example_count else ()
        normgnorm.PEGLayerNorm.apply(x, w, bb, w_pair, b_pair, (40,), EPS, *extra).backward(dy)
        ref = oracle(x, w, bb, dy)
        torch.testing.assert_close(x.grad.double(), ref["dx"], **TOL[torch.float32])
        want_w, want_b = want_w + ref["sq_w"], want_b + (ref["sq_b"] if bias else 0)
    B = sum(shape[0] for shape in shapes)
    torch.testing.assert_close(w_pair[0].double(), want_w, **BUFFER_TOL)
    assert w_pair[1].item() == B and w_pair.dtype == torch.float32
    if bias:
        torch.testing.assert_close(b_pair[0].double(), want_b, **BUFFER_TOL)
        assert b_pair[1].item() == B
    else:
        assert b_pair.tolist() == [0.0, 0.0]
    assert count.item() == (B if example_count else 0)


def test_peglayernorm_without_buffers_still_trains():
    # the reference lets either buffer be None: not measured, the gradients as ever
    x, dy, weight, b = make_inputs((3, 5, 40), torch.float32, True, seed=8)
    w, bb, x = weight.clone().requires_grad_(), b.clone().requires_grad_(), x.requires_grad_()
    normgnorm.PEGLayerNorm.apply(x, w, bb, None, None, (40,), EPS).backward(dy)
    ref = oracle(x, weight, b, dy)
    torch.testing.assert_close(w.grad.double(), ref["dw"], **TOL[torch.float32])
    torch.testing.assert_close(bb.grad.double(), ref["db"], **TOL[torch.float32])


@pytest.mark.parametrize("bad", [torch.zeros(3), torch.zeros(1), torch.zeros(2, 2), torch.zeros(2, dtype=torch.float64),
                                 torch.zeros((), dtype=torch.float16), torch.zeros(2, dtype=torch.int64)],
                         ids=["3", "1", "2x2", "float64 pair", "float16", "int64 pair"])
@pytest.mark.parametrize("which", ["weight", "bias", "count"])
def test_peglayernorm_other_buffer_layouts_are_one_line_errors(bad, which):
    x = torch.randn(2, 3, 8, requires_grad=True)
    w, bb = torch.ones(8, requires_grad=True), torch.zeros(8, requires_grad=True)
    bufs = dict(weight=torch.zeros(2), bias=torch.zeros(2), count=None)
    bufs[which] = bad
    with pytest.raises(ValueError, match=f"{which if which != 'count' else 'example_count'}.* not ") as error:
        normgnorm.PEGLayerNorm.apply(x, w, bb, bufs["weight"], bufs["bias"], (8,), EPS, bufs["count"])
    assert "\n" not in str(error.value)


def test_layer_norm_takes_zero_dim_buffers_only():
    x = torch.randn(2, 3, 8, requires_grad=True)
    w = torch.ones(8, requires_grad=True)
    with pytest.raises(ValueError, match="weight_sqgradnorm must be a float32 0-dim tensor, not"):
        normgnorm.layer_norm(x, w, None, torch.zeros(2), None, torch.zeros(()))


@pytest.mark.parametrize("name,hint", [("layernorm_fwd", "PEGLayerNorm"), ("layernorm_bwd", "per_example_affine_grads"),
                                       ("normgnorm_cuda", "backend='cuda'"), ("current_dir", "normgnorm.__file__"),
                                       ("exists", "is not None")])
def test_reference_names_not_kept_say_what_to_use(name, hint):
    from nanogns.refusals import ReferenceNameError
    with pytest.raises(ReferenceNameError, match=rf"normgnorm\.{name} is the reference .*: (use|write) .*{hint}"):
        exec(f"from normgnorm import {name}", {})
    assert getattr(normgnorm, "no_such_name", None) is None
    from nanogns.normgnorm import plan  # noqa: F401  (submodules still import)


def test_oracle_per_example_norms_by_loop():
    # the shared vmap oracle itself against a second, independent one: single-example backward passes
    x, dy, weight, b = make_inputs((3, 4, 10), torch.float64, True, seed=5)
    ref = oracle(x, weight, b, dy)
    sq_w = sq_b = 0
    for i in range(3):
        w_i, b_i = weight.clone().requires_grad_(), b.clone().requires_grad_()
        (F.layer_norm(x[i], (10,), w_i, b_i, EPS) * dy[i]).sum().backward()
        sq_w, sq_b = sq_w + w_i.grad.square().sum(), sq_b + b_i.grad.square().sum()
    torch.testing.assert_close(ref["sq_w"], sq_w)
    torch.testing.assert_close(ref["sq_b"], sq_b)


on_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


@pytest.mark.parametrize("rms", [False, True], ids=["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=on_gpu), pytest.param("cuda", marks=on_gpu)])
def test_rows_with_variance_near_eps(backend, rms):
    """x's spread ~1e-3 (variance, or RMSNorm's mean square, ~1e-6 against eps 1e-5): eps sets
    most of rstd, so an implementation that dropped or misplaced it fails here (the other inputs
    have variance ~4)."""
    if backend == "cuda" and cuda_ext.find_cuda_home() is None:
        pytest.skip("no CUDA toolkit to build the extension")
    device = "cpu" if backend == "torch" else "cuda"
    x, dy, weight, b = make_inputs((3, 4, 24), torch.float32, not rms, seed=4, device=device)
    x = (x * 5e-4).requires_grad_()
    f32 = dict(dtype=torch.float32, device=device)
    sq_w, count = torch.zeros((), **f32), torch.zeros((), **f32)
    sq_b = None if rms else torch.zeros((), **f32)
    w, bias = weight.clone().requires_grad_(), None if rms else b.clone().requires_grad_()
    y = (rms_eager if rms else normgnorm.layer_norm)(x, w, bias, sq_w, sq_b, count, EPS, backend)
    y.backward(dy)
    ref = oracle(x, weight, b, dy, rms)
    torch.testing.assert_close(y.double(), ref["y"], **TOL[torch.float32])
    torch.testing.assert_close(x.grad.double(), ref["dx"], rtol=1e-4, atol=1e-3)  # dx ~ rstd ~ 300
    torch.testing.assert_close(sq_w.double(), ref["sq_w"], **BUFFER_TOL)
    if not rms:
        torch.testing.assert_close(sq_b.double(), ref["sq_b"], **BUFFER_TOL)


@pytest.mark.parametrize("layer_norm", list(ENTRIES.values()), ids=list(ENTRIES))
@pytest.mark.parametrize("frozen", ["weight", "bias"])
def test_only_parameters_with_gradients_are_measured(layer_norm, frozen):
    x, dy, weight, b = make_inputs((3, 4, 24), torch.float32, True, seed=1)
    sq_w, sq_b, count = torch.zeros(()), torch.zeros(()), torch.zeros(())
    (b if frozen == "weight" else weight).requires_grad_()
    x.requires_grad_()
    layer_norm(x, weight, b, sq_w, sq_b, count, EPS, "").backward(dy)
    ref = oracle(x, weight, b, dy)
    measured, unmeasured = (sq_b, sq_w) if frozen == "weight" else (sq_w, sq_b)
    assert (weight if frozen == "weight" else b).grad is None and unmeasured.item() == 0
    torch.testing.assert_close(measured.double(), ref["sq_b" if frozen == "weight" else "sq_w"], **BUFFER_TOL)
    assert count.item() == 3


def test_backend_choice_off_gpu():
    x = torch.zeros(2, 3)
    assert normgnorm.resolve_backend("", x) == "cpu"  # eager on CPU: the native backward
    for name in ("triton", "cuda", "cpu"):  # off GPU the GPU's names mean the CPU's path: never Triton
        assert normgnorm.resolve_backend(name, x) == "cpu"
    assert normgnorm.resolve_backend("torch", x) == "torch"  # pure PyTorch, asked for
    with pytest.raises(ValueError, match="unknown normgnorm backend"):
        normgnorm.resolve_backend("cudnn", x)


def test_cpu_path_needs_no_triton():
    # with triton unimportable (and asked for), importing and running everything on CPU works
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch, normgnorm, fused_gns\n"
            "m = fused_gns.PEGradNormFusedLayerNorm(8, backend='triton')\n"
            "m(torch.randn(2, 3, 8, requires_grad=True)).sum().backward()\n"
            "r = fused_gns.PEGradNormFusedRMSNorm(8, backend='triton')\n"
            "r(torch.randn(2, 3, 8, requires_grad=True)).pow(2).sum().backward()\n"
            "assert m.example_count.item() == r.example_count.item() == 2\n"
            "assert 'normgnorm.triton_kernels' not in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("layer_norm", [*ENTRIES.values(), *RMS_ENTRIES.values()], ids=[*ENTRIES, *RMS_ENTRIES])
def test_empty_input(layer_norm):
    x = torch.zeros(0, 5, 8, requires_grad=True)
    weight = torch.ones(8, requires_grad=True)
    sq_w, count = torch.zeros(()), torch.zeros(())
    layer_norm(x, weight, None, sq_w, None, count, EPS, "").sum().backward()
    assert x.grad.shape == x.shape and weight.grad.abs().sum() == 0 and sq_w.item() == 0 and count.item() == 0
    x = torch.zeros(3, 0, 8, requires_grad=True)  # three examples of no tokens still count
    layer_norm(x, weight, None, sq_w, None, count, EPS, "").sum().backward()
    assert sq_w.item() == 0 and count.item() == 3


# ---------------------------------------------------------------- RMSNorm: the same code without the centring

@pytest.mark.parametrize("entry", list(RMS_ENTRIES))
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_torch_path_rms_norm_matches_oracles(dtype, shape, entry):
    check_op(SHAPES[shape], dtype, False, backend="torch", layer_norm=RMS_ENTRIES[entry])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_eps_none_is_torchs_default(dtype):
    """eps None is torch's rms_norm default, float32's machine epsilon (1.2e-7) for all these
    dtypes (the type it computes in): with rows of mean square ~1e-8 it sets most of rstd, so
    another eps fails. The oracle is torch's own RMSNorm(eps=None) in float32 on the same values."""
    x, dy, weight, _ = make_inputs((3, 4, 24), dtype, False, seed=9)
    x = (x.float() * 5e-5).to(dtype).requires_grad_()
    w = weight.clone().requires_grad_()
    sq_w, count = torch.zeros(()), torch.zeros(())
    y = normgnorm.rms_norm(x, w, sq_w, count, None, "torch")  # the op takes the eps rms_norm resolved
    y.backward(dy)
    ref = oracle(x, weight, None, dy, rms=True, eps=None, dtype=torch.float32)
    torch.testing.assert_close(y.double(), ref["y"].to(dtype).double(), **TOL[dtype])
    scale = ref["dx"].abs().max()  # dx ~ rstd ~ 3000
    torch.testing.assert_close(x.grad.double() / scale, ref["dx"].to(dtype).double() / scale, **TOL[dtype])
    torch.testing.assert_close(sq_w.double(), ref["sq_w"], **BUFFER_TOL)
    assert count.item() == 3


@pytest.mark.parametrize("entry", list(RMS_ENTRIES))
def test_rms_norm_frozen_gain_is_not_measured(entry):
    x, dy, weight, _ = make_inputs((3, 4, 24), torch.float32, False, seed=1)
    x.requires_grad_()
    sq_w, count = torch.zeros(()), torch.zeros(())
    RMS_ENTRIES[entry](x, weight, None, sq_w, None, count, EPS, "").backward(dy)
    assert weight.grad is None and sq_w.item() == 0 and count.item() == 3
    torch.testing.assert_close(x.grad.double(), oracle(x, weight, None, dy, rms=True)["dx"], **TOL[torch.float32])


def test_rms_norm_takes_a_last_dimension_gain_and_zero_dim_buffers_only():
    x = torch.randn(2, 3, 8, requires_grad=True)
    w = torch.ones(8, requires_grad=True)
    with pytest.raises(ValueError, match="last dimension only"):
        normgnorm.rms_norm(x, torch.ones(3), torch.zeros(()), torch.zeros(()))
    with pytest.raises(ValueError, match="rms_norm's weight_sqgradnorm must be a float32 0-dim tensor, not"):
        normgnorm.rms_norm(x, w, torch.zeros(2), torch.zeros(()))
    with pytest.raises(ValueError, match="rms_norm's example_count must be a float32 0-dim tensor, not"):
        normgnorm.rms_norm(x, w, torch.zeros(()), torch.zeros((), dtype=torch.int64))


# ---------------------------------------------------------------- torch.compile

def _layer(bias=True):
    from fused_gns import PEGradNormFusedLayerNorm
    torch.manual_seed(0)
    m = PEGradNormFusedLayerNorm(40, bias=bias)
    with torch.no_grad():
        m.weight.normal_()
        if bias:
            m.bias.normal_()
    return m


def _rms_layer(eps=EPS):
    from fused_gns import PEGradNormFusedRMSNorm
    torch.manual_seed(0)
    m = PEGradNormFusedRMSNorm(40, eps=eps)
    with torch.no_grad():
        m.weight.normal_()
    return m


LAYERS = {"LayerNorm": _layer, "LayerNorm without bias": lambda: _layer(bias=False), "RMSNorm": _rms_layer,
          "RMSNorm, eps None": lambda: _rms_layer(eps=None)}


@pytest.mark.parametrize("layer", ["LayerNorm", "RMSNorm"])
def test_compile_no_graph_breaks(layer):
    m = LAYERS[layer]()
    x = torch.randn(3, 5, 40, requires_grad=True)
    explanation = torch._dynamo.explain(lambda x: m(x).sin().sum())(x)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


def check_layer_compiled(make, backend=None, compiler="aot_eager", device="cpu"):
    """A fused layer eager and under torch.compile (fullgraph: one graph, no break), two
    micro-steps: the same input and parameter gradients, buffers and example count."""
    torch._dynamo.reset()
    eager, compiled = make().to(device), make().to(device)
    eager.backend = compiled.backend = backend
    step = torch.compile(lambda m, x: m(x).sin().sum(), backend=compiler, fullgraph=True)
    for call in range(2):
        x = torch.randn(3, 5, 40, generator=torch.Generator().manual_seed(call)).to(device)
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        eager(x1).sin().sum().backward()
        step(compiled, x2).backward()
        torch.testing.assert_close(x2.grad, x1.grad)
    for name, p in eager.named_parameters():
        torch.testing.assert_close(getattr(compiled, name).grad, p.grad)
        torch.testing.assert_close(getattr(compiled, f"{name}_sqgradnorm"), getattr(eager, f"{name}_sqgradnorm"))
        assert getattr(eager, f"{name}_sqgradnorm").item() > 0
    assert compiled.example_count.item() == eager.example_count.item() == 6
    torch._dynamo.reset()


@pytest.mark.parametrize("layer", ["RMSNorm", "RMSNorm, eps None"])
def test_compile_matches_eager(layer):
    check_layer_compiled(LAYERS[layer])


@pytest.mark.slow
@pytest.mark.parametrize("layer", list(LAYERS))
def test_compile_inductor_matches_eager(layer):
    check_layer_compiled(LAYERS[layer], compiler="inductor")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which(cpu_ext.compiler_command()[0]) is None, reason="no C compiler")
@pytest.mark.parametrize("layer", ["LayerNorm without bias", "RMSNorm"])
def test_compiled_route_matches_the_eager_kernel(layer):
    """A layer asking for the CPU's C kernel runs it eagerly and the compiled route (the torch path,
    fused by inductor) compiled: the same gradients and buffers."""
    check_layer_compiled(LAYERS[layer], "cpu", compiler="inductor")


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("layer", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_gpu_compiled_matches_the_eager_kernels(layer, backend):
    """On a GPU the compiled layer runs the compiled route (the torch path fused by inductor), the
    eager one the kernels: the same results."""
    if backend == "triton":
        pytest.importorskip("triton")
    elif cuda_ext.find_cuda_home() is None:
        pytest.skip("no CUDA toolkit to build the extension")
    check_layer_compiled(LAYERS[layer], backend, "inductor", device="cuda")


def record_graphs(graphs):
    """A torch.compile backend that keeps each graph and runs nothing (there is no GPU to run it on)."""
    def backend(gm, example_inputs):
        graphs.append(gm)
        outputs = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
        return lambda *args: [torch.zeros(()) for _ in outputs]
    return backend


# ---------------------------------------------------------------- Triton kernels, interpreted on CPU

def test_triton_kernels_interpreted():
    """
    tests/normgnorm_triton_interpreted.py, in a fresh process with TRITON_INTERPRET=1: the
    interpreter must be on before triton itself is first imported, which in this process
    (torch._inductor imports it) may already have happened.
    """
    pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
    if HAS_CUDA:  # the kernels run for real below; and Triton 3.6's interpreter fails with numpy >= 2.4
        pytest.skip("a CUDA GPU runs the kernels themselves (test_gpu_backends_*)")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           os.path.join(ROOT, "tests", "normgnorm_triton_interpreted.py")],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and " skipped" not in done.stdout, done.stdout[-3000:]


# ---------------------------------------------------------------- Triton kernels, compiled for GPUs (no GPU needed)

# (shape, dtype, bias, need_db, launcher arguments): between them every kernel, dtype and plan
AOT_CASES = {
    "GPT-2 small, split": ((8, 1024, 768), torch.bfloat16, True, True, {}),
    "widest row in registers, split": ((8, 2048, 8192), torch.bfloat16, True, True, {}),
    "odd D, whole examples, no bias": ((600, 4, 1000), torch.float16, False, False, {}),
    "2-D float32, no dβ wanted": ((4096, 768), torch.float32, True, False, {}),
    "looped rows": ((4, 64, 12288), torch.bfloat16, True, True, {}),
    # RMSNorm: the same kernels without the mean (constexpr RMS)
    "RMSNorm, widest row in registers, split": ((8, 2048, 8192), torch.bfloat16, False, False, dict(rms=True)),
    "RMSNorm, odd D, whole examples": ((600, 4, 1000), torch.float16, False, False, dict(rms=True)),
    "RMSNorm, looped rows": ((4, 64, 12288), torch.float32, False, False, dict(rms=True)),
}


def aot_compiled(arch):
    from nanogns.normgnorm import triton_aot
    compiled = []
    for shape, dtype, bias, need_db, kwargs in AOT_CASES.values():
        launches = (triton_aot.forward_launches(shape, dtype, bias, **kwargs)
                    + triton_aot.backward_launches(shape, dtype, bias, need_db=need_db, **kwargs))
        compiled += [(shape, triton_aot.compile_launch(launch, arch)) for launch in launches]
    return compiled


@pytest.mark.parametrize("arch", [80, 90])
def test_triton_kernels_compile_for_gpus_without_spilling(arch):
    """
    Every launch the kernels would get at these shapes, compiled by Triton's GPU compiler for
    A100 (sm_80) and H100 (sm_90): code that lowers under the interpreter but not to GPU code
    fails here, and so does a tile that no longer fits in registers (ptxas spills to memory).
    """
    pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
    from nanogns.normgnorm import triton_aot
    compiled = aot_compiled(arch)
    assert {c.name for _, c in compiled} == set(triton_aot.KERNELS)
    spilled = [f"{shape}: {c}" for shape, c in compiled if c.stack_bytes]
    assert not spilled, "\n".join(spilled)
    assert all(c.programs_per_sm >= 1 for _, c in compiled)


def test_triton_aot_records_launches_and_sees_spills():
    """The recorder leaves the real kernels in place, and a tile too big for registers is reported."""
    pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
    from nanogns.normgnorm import triton_aot, triton_kernels
    launches = triton_aot.backward_launches((2, 10, 40), torch.float32, target_programs=8, min_rows_per_chunk=3)
    assert [l.name for l in launches] == ["_backward_kernel"]
    assert launches[0].grid == (8,) and launches[0].kwargs["WHOLE"] is False
    assert all(type(getattr(triton_kernels, name)).__name__ == "JITFunction" for name in triton_aot.KERNELS)
    # a whole 64k-wide float32 row held by one program's registers cannot fit: ptxas spills
    huge = triton_aot.forward_launches((2, 4, 65536), torch.float32, max_block_d=65536)[0]
    assert triton_aot.compile_launch(huge, 80).stack_bytes > 0


def test_programs_per_sm():
    from nanogns.normgnorm.triton_aot import programs_per_sm
    assert programs_per_sm(90, registers=40, num_warps=16, shared_bytes=2048) == 3   # 1280 registers a warp
    assert programs_per_sm(90, registers=76, num_warps=16, shared_bytes=8192) == 1   # 2560: 25 warps
    assert programs_per_sm(80, registers=32, num_warps=4, shared_bytes=0) == 16      # the 64-warp limit
    assert programs_per_sm(80, registers=16, num_warps=1, shared_bytes=0) == 32      # the 32-program limit
    assert programs_per_sm(80, registers=32, num_warps=4, shared_bytes=100 * 1024) == 1  # shared memory


# ---------------------------------------------------------------- CUDA sources (compiled, no GPU needed)

needs_nvcc = pytest.mark.skipif(cuda_ext.find_cuda_home() is None, reason="no CUDA toolkit (nvcc) found")


@pytest.fixture(scope="module")
def cuda_build_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("normgnorm_cuda"))


@pytest.mark.slow
@needs_nvcc
def test_cuda_kernels_compile(cuda_build_dir):
    # both architectures at once, with build()'s own command, into the files build() looks for
    objects = {arch: cuda_ext.kernel_object(arch, cuda_build_dir) for arch in ("sm_80", "sm_90")}
    compilers = {arch: subprocess.Popen(cuda_ext.nvcc_command(arch, obj), stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True)
                 for arch, obj in objects.items()}
    for arch, compiler in compilers.items():
        output = compiler.communicate()[0]
        assert compiler.returncode == 0, f"{arch}: {output}"
        assert "warning" not in output.lower(), f"{arch}: {output}"
        assert os.path.getsize(objects[arch]) > 0
        spilled = cuda_kernels_with_spills(objects[arch])
        if spilled is not None:
            # rows up to 4096 features (ITEMS = 4 a thread) and the reductions never spill; the
            # wider rows' kernels, bound to 64 registers by 1024-thread blocks, may (sm_80 does
            # a little from ITEMS = 8 on, sm_90 only at ITEMS = 32)
            assert not [name for name in spilled if "Li4E" in name or "Li" not in name], f"{arch}: {spilled}"


def cuda_kernels_with_spills(obj):
    """Mangled names of the object's kernels with a stack frame (register spills), by the
    cuobjdump that ships with Triton; None without Triton."""
    try:
        import triton
    except ImportError:
        return None
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    text = subprocess.run([tool, "--dump-resource-usage", obj], capture_output=True, text=True, check=True).stdout
    spilled, name = [], None
    for line in text.splitlines():
        if line.strip().startswith("Function "):
            name = line.strip()[len("Function "):].rstrip(":")
        elif "STACK:" in line and int(line.split("STACK:")[1].split()[0]) > 0:
            spilled.append(name)
    return spilled


@pytest.mark.slow
@needs_nvcc
@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
def test_cuda_binding_builds_and_loads(cuda_build_dir):
    # the binding needs only torch's stable C++ headers and libcudart: it builds and loads here,
    # without a GPU (against the sm_80 object of the test above when that ran first)
    ops = cuda_ext.build("sm_80", build_dir=cuda_build_dir)
    assert ops.max_d() == cuda_ext.MAX_D and ops.column_block() == 32


def test_cuda_backend_refuses_cpu_tensors_before_the_binding():
    # an error raised inside the binding crashed the process under torch 2.11: the wrapper refuses first
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="contiguous CUDA tensors; x is on cpu"):
        cuda_ext.forward(x, torch.ones(8), None, EPS)
    with pytest.raises(ValueError, match="contiguous CUDA tensors; dy is on cpu"):
        cuda_ext.backward(x, x, torch.ones(8), torch.zeros(2), torch.ones(2), 1, True, False,
                          torch.zeros(()), None, torch.zeros(()))


# ---------------------------------------------------------------- on a GPU: both GPU backends

GPU_SHAPES = {
    "gpt": [(4, 256, 768), (4, 256, 768)],
    "odd D": [(3, 100, 1000), (2, 37, 1000)],
    "many examples, 2-D": [(2000, 96), (1000, 96)],
    "one example, 1-D": [(768,), (768,)],
    "wide rows": [(2, 40, 20000), (2, 40, 20000)],
    "wider than the CUDA kernels": [(2, 8, 40000), (1, 8, 40000)],
}


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_gpu_backends_match_oracles(backend, shape):
    if backend == "triton":
        pytest.importorskip("triton")
    elif cuda_ext.find_cuda_home() is None:
        pytest.skip("no CUDA toolkit to build the extension")
    for dtype in DTYPES:
        for bias in (True, False):
            check_op(GPU_SHAPES[shape], dtype, bias, backend=backend, device="cuda")
        check_op(GPU_SHAPES[shape], dtype, False, backend=backend, device="cuda", layer_norm=rms_eager)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("rms", [False, True], ids=["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_gpu_backends_agree_with_torch_path(backend, rms):
    if backend == "cuda" and cuda_ext.find_cuda_home() is None:
        pytest.skip("no CUDA toolkit to build the extension")
    x, dy, weight, b = make_inputs((8, 512, 768), torch.bfloat16, not rms, seed=7, device="cuda")
    results = {}
    for name in ("torch", backend):
        bufs = [torch.zeros((), device="cuda") for _ in range(3)]
        xi = x.clone().requires_grad_()
        if rms:
            normgnorm.rms_norm(xi, weight.clone().requires_grad_(), bufs[0], bufs[2], EPS, name).backward(dy)
        else:
            normgnorm.layer_norm(xi, weight, b.clone().requires_grad_(), *bufs, EPS, name).backward(dy)
        results[name] = bufs
    for a, c in zip(results[backend], results["torch"]):
        torch.testing.assert_close(a, c, rtol=1e-4, atol=0)


def test_sharded_input_refused_in_one_line():
    # a LayerNorm under torch's SequenceParallel is handed DTensors: every measured normalisation class
    # measures it (torch's normalisation, the sums from the local tensors: tests/test_tensor_parallel.py),
    # the fused functions refuse one in one line (the CPU kernel, handed one, crashed the process), and
    # the CPU kernel itself never takes a tensor whose memory is not its values
    code = ("import torch, torch.distributed as dist, torch.nn as nn\n"
            "from torch.distributed.device_mesh import init_device_mesh\n"
            "from torch.distributed.tensor import distribute_tensor, Shard, Replicate\n"
            "from torch.distributed.tensor.parallel import parallelize_module, SequenceParallel\n"
            "import nanogns.layers as L\n"
            "import nanogns.normgnorm as ng\n"
            "from nanogns.normgnorm import cpu_ext\n"
            "dist.init_process_group('gloo', rank=0, world_size=1, store=dist.HashStore())\n"
            "mesh = init_device_mesh('cpu', (1,))\n"
            "for cls in (L.PEGradNormSeparatedLayerNorm, L.PEGradNormFusedLayerNorm,\n"
            "            L.PEGradNormSeparatedRMSNorm, L.PEGradNormFusedRMSNorm):\n"
            "    model = parallelize_module(nn.Sequential(cls(8)), mesh, {'0': SequenceParallel()})\n"
            "    model(torch.randn(2, 4, 8)).to_local().sum().backward()\n"
            "    print(cls.__name__, 'measured', model[0].example_count.item())\n"
            "x = distribute_tensor(torch.randn(2, 4, 8), mesh, [Shard(1)])\n"
            "w = distribute_tensor(torch.ones(8), mesh, [Replicate()])\n"
            "bufs = [torch.zeros(()) for _ in range(3)]\n"
            "for call in (lambda: ng.layer_norm(x, w, w, *bufs), lambda: ng.rms_norm(x, w, bufs[0], bufs[2])):\n"
            "    try:\n"
            "        call()\n"
            "    except TypeError as e:\n"
            "        print(e)\n"
            "torch.set_grad_enabled(False)  # as in a backward, where the kernel runs\n"
            "print('kernel takes a DTensor:', cpu_ext._takes((x,), ()))\n"
            "print('kernel takes a tensor:', cpu_ext._takes((x.to_local(),), ()))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 8, done.stdout
    assert lines[:4] == [f"PEGradNorm{kind}{norm} measured 2.0" for norm in ("LayerNorm", "RMSNorm")
                         for kind in ("Separated", "Fused")]
    for line, name in ((lines[4], "LayerNorm"), (lines[5], "RMSNorm")):
        assert f"a measured {name} was handed a DTensor" in line and "measure(model)" in line
    assert lines[6:] == ["kernel takes a DTensor: False", "kernel takes a tensor: True"]
