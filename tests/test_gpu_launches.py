"""
The Triton launches on a CUDA GPU, where they are safe to run anyhow: repeated, on several
streams at once, inside CUDA graphs captured on one stream and replayed on two, and on a device
that is not the current one. Each launch's scratch and counters are its own, its sums have a
fixed order, and dγ, dβ are NaN until the last program writes them: so every result here is
equal, to the bit, to one launch's on one stream, and right.
"""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

import nanogns.normgnorm as normgnorm  # noqa: E402
from nanogns.layers import linear_kernel  # noqa: E402
from nanogns.normgnorm import triton_kernels  # noqa: E402

EPS = 1e-5
SHAPE = (8, 1024, 768)  # GPT-2 small's, split mode (each example's rows over several programs)
SHAPES = {"split": (SHAPE, torch.bfloat16, True), "whole examples, no bias": ((600, 4, 1000), torch.float16, False)}


def _inputs(shape, dtype, bias, seed, device="cuda"):
    g = torch.Generator(device=device).manual_seed(seed)
    D = shape[-1]
    x = torch.randn(shape, device=device, generator=g).to(dtype)
    dy = torch.randn(shape, device=device, generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(D, device=device, generator=g)).to(dtype)
    b = (0.1 * torch.randn(D, device=device, generator=g)).to(dtype) if bias else None
    return x, dy, weight, b


def _step(x, dy, weight, b):
    """One fused LayerNorm forward and backward on the current stream: (y, dx, dγ, dβ or None, and the
    buffers Σ_b ||dγ_b||², Σ_b ||dβ_b||² or None, example count)."""
    device = x.device
    bufs = [torch.zeros((), device=device), torch.zeros((), device=device) if b is not None else None,
            torch.zeros((), device=device)]
    leaves = [x.detach().requires_grad_(), weight.detach().requires_grad_()]
    if b is not None:
        leaves.append(b.detach().requires_grad_())
    y = normgnorm.layer_norm(leaves[0], leaves[1], leaves[2] if b is not None else None, *bufs, EPS, "triton")
    grads = torch.autograd.grad(y, leaves, dy)
    return (y.detach(), *grads, *(buf for buf in bufs if buf is not None))


def _assert_equal(got, expected):
    assert len(got) == len(expected)
    for i, (a, e) in enumerate(zip(got, expected)):
        assert a.dtype == e.dtype and a.shape == e.shape and torch.equal(a, e), f"result {i} differs"


def _oracle(x, dy, b):
    """dγ, dβ and Σ_b ||dγ_b||², Σ_b ||dβ_b||² in float64 from the inputs as given."""
    x, dy = x.double(), dy.double()
    xhat = (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + EPS)
    per_w = (dy * xhat).flatten(1, -2).sum(1)  # [B, D]
    per_b = dy.flatten(1, -2).sum(1)
    return per_w.sum(0), per_b.sum(0), per_w.square().sum(), per_b.square().sum()


@pytest.mark.parametrize("case", list(SHAPES))
def test_parameter_gradients_are_right_though_the_kernel_fills_them_with_nan_first(case):
    shape, dtype, bias = SHAPES[case]
    x, dy, weight, b = _inputs(shape, dtype, bias, seed=1)
    out = _step(x, dy, weight, b)
    dw, sq_w = out[2], out[4 if bias else 3]
    ref_dw, ref_db, ref_sq_w, ref_sq_b = _oracle(x, dy, b)
    assert torch.isfinite(dw).all()
    # dγ comes back in the weight's dtype: its own rounding, on float32 sums of the exact products
    torch.testing.assert_close(dw.double(), ref_dw.to(dtype).double(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(sq_w.double(), ref_sq_w, rtol=1e-4, atol=0)
    if bias:
        db, sq_b = out[3], out[5]
        assert torch.isfinite(db).all()
        torch.testing.assert_close(db.double(), ref_db.to(dtype).double(), rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(sq_b.double(), ref_sq_b, rtol=1e-4, atol=0)
    assert out[-1].item() == shape[0]


def test_a_hundred_layer_norm_backwards_agree_bit_for_bit():
    x, dy, weight, b = _inputs(SHAPE, torch.bfloat16, True, seed=2)
    expected = _step(x, dy, weight, b)
    for _ in range(100):
        _assert_equal(_step(x, dy, weight, b), expected)


@pytest.mark.parametrize("case", list(SHAPES))
def test_counters_are_back_at_zero_after_a_launch(case, monkeypatch):
    made = []
    real = triton_kernels._scratch

    def recorded(device, floats, counters):
        made.append(real(device, floats, counters))
        return made[-1]
    monkeypatch.setattr(triton_kernels, "_scratch", recorded)
    shape, dtype, bias = SHAPES[case]
    for seed in range(3):
        _step(*_inputs(shape, dtype, bias, seed=seed))
    torch.cuda.synchronize()
    assert len(made) == 3
    for work, counters in made:
        assert counters.dtype == torch.int32 and counters.numel() > 1 and counters.count_nonzero().item() == 0


def test_four_streams_at_once_each_get_the_one_stream_result():
    inputs = [_inputs(SHAPE, torch.bfloat16, True, seed=10 + i) for i in range(4)]
    expected = [_step(*args) for args in inputs]
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream() for _ in inputs]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    got = [[] for _ in inputs]
    for _ in range(10):  # each stream's launches queued behind one another, the streams side by side
        for i, s in enumerate(streams):
            with torch.cuda.stream(s):
                got[i].append(_step(*inputs[i]))
    torch.cuda.synchronize()
    for i in range(len(inputs)):
        for result in got[i]:
            _assert_equal(result, expected[i])


def test_two_cuda_graphs_captured_on_one_stream_replay_side_by_side_as_eager():
    """Captured one after the other on one stream, the graphs would have shared a kept workspace
    and its counters; replayed at once on two streams each must still give its eager result."""
    inputs = [_inputs(SHAPE, torch.bfloat16, True, seed=20 + i) for i in range(2)]
    expected = [_step(*args) for args in inputs]
    capture = torch.cuda.Stream()
    capture.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(capture):  # warm up off the default stream, as capture wants
        for args in inputs:
            _step(*args)
    torch.cuda.current_stream().wait_stream(capture)
    torch.cuda.synchronize()
    graphs = [torch.cuda.CUDAGraph() for _ in inputs]
    outputs = []
    for graph, args in zip(graphs, inputs):
        with torch.cuda.graph(graph, stream=capture):
            outputs.append(_step(*args))
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream() for _ in graphs]
    for _ in range(20):
        for graph, s in zip(graphs, streams):
            with torch.cuda.stream(s):
                graph.replay()
    torch.cuda.synchronize()
    for out, ref in zip(outputs, expected):
        _assert_equal(out, ref)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_a_launch_on_a_device_that_is_not_current_runs_on_its_tensors_device():
    args = _inputs(SHAPE, torch.bfloat16, True, seed=30, device="cuda:1")
    with torch.cuda.device(1):
        expected = _step(*args)
    with torch.cuda.device(0):
        got = _step(*args)
        w = torch.randn(2, 64, 96, device="cuda:1", dtype=torch.bfloat16)
        g = torch.randn(2, 64, 128, device="cuda:1", dtype=torch.bfloat16)
        linear = linear_kernel.per_example_weight_grad(w, g)
    torch.cuda.synchronize(1)
    _assert_equal(got, expected)
    with torch.cuda.device(1):
        _assert_equal(linear_kernel.per_example_weight_grad(w, g), linear)


def test_the_linear_kernel_repeated_agrees_bit_for_bit():
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(8, 1024, 768, device="cuda", generator=g).to(torch.bfloat16)
    dy = torch.randn(8, 1024, 3072, device="cuda", generator=g).to(torch.bfloat16)
    expected = linear_kernel.per_example_weight_grad(x, dy)  # its values: test_linear_kernel.py's GPU tests
    assert all(torch.isfinite(t).all() for t in expected)
    for _ in range(50):
        _assert_equal(linear_kernel.per_example_weight_grad(x, dy), expected)
