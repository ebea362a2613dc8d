"""bench/layernorm.py off GPU: it says it needs one and exits 0; its local shim is exact."""
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench", "layernorm.py")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_without_gpu_says_so_and_exits_0():
    done = subprocess.run([sys.executable, BENCH], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0 and "needs a CUDA GPU" in done.stdout, done.stderr


def test_bad_shape_is_one_clear_line():
    done = subprocess.run([sys.executable, BENCH, "--shapes", "8x10"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2 and "is not BxTxD" in done.stderr and "Traceback" not in done.stderr


def test_local_shim_matches_oracle():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        from layernorm import LocalSeparatedLayerNorm
    finally:
        sys.path.remove(os.path.join(ROOT, "bench"))
    from test_normgnorm import oracle
    shim = LocalSeparatedLayerNorm(24)
    with torch.no_grad():
        shim.weight.normal_()
        shim.bias.normal_()
    x = torch.randn(3, 5, 24, requires_grad=True)
    dy = torch.randn(3, 5, 24)
    y = shim(x)
    y.backward(dy)
    ref = oracle(x, shim.weight, shim.bias, dy)
    torch.testing.assert_close(y.double(), ref["y"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), ref["dx"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(shim.weight_sqgradnorm.double(), ref["sq_w"], rtol=1e-5, atol=0)
    torch.testing.assert_close(shim.bias_sqgradnorm.double(), ref["sq_b"], rtol=1e-5, atol=0)
    assert shim.example_count.item() == 3


def test_compile_only_reports_kernels_without_a_gpu():
    pytest.importorskip("triton")
    done = subprocess.run([sys.executable, BENCH, "--compile_only", "--arch", "80", "--shapes", "2x64x1000",
                           "--dtype", "float16"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "compiled for sm_80 with 108 multiprocessors" in done.stdout
    for kernel in ("_forward_kernel", "_backward_kernel", "_finish_kernel"):
        assert f"2x64x1000  {kernel}" in done.stdout, done.stdout
    assert "registers spilled to memory: none" in done.stdout
