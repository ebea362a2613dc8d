"""bench/layernorm.py off GPU: it says it needs one and exits 0; its local shim is exact."""
import itertools
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


def test_cpu_table_times_every_implementation_against_torch():
    done = subprocess.run([sys.executable, BENCH, "--device", "cpu", "--shapes", "2x3x8", "--iters", "2", "--warmup", "1"],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    rows = {line.split()[1]: line.split() for line in done.stdout.splitlines() if line.strip().startswith("2x3x8")}
    assert list(rows) == ["torch", "fused[cpu]", "fused[torch]", "separated"]
    assert rows["torch"][-2:] == ["0", "1.00x"]  # the reference row: no extra, ratio 1
    for name in ("fused[cpu]", "fused[torch]", "separated"):
        ms, extra_us, ratio = float(rows[name][-3]), float(rows[name][-2]), float(rows[name][-1].rstrip("x"))
        torch_ms = float(rows["torch"][-3])
        assert ms > 0 and extra_us == pytest.approx((ms - torch_ms) * 1e3, abs=2) and ratio == pytest.approx(ms / torch_ms, rel=0.02, abs=0.01)


def test_host_table_runs_the_gpu_route_with_its_launches_recorded():
    pytest.importorskip("triton")
    done = subprocess.run([sys.executable, BENCH, "--device", "cpu", "--host", "--shapes", "2x3x8", "--iters", "2",
                           "--warmup", "1"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines() if line.strip().startswith("2x3x8")]
    assert [row[1:3] for row in rows] == [["torch", "nn.LayerNorm"], ["fused[triton]", "LayerNorm"],
                                          ["torch", "nn.RMSNorm"], ["fused[triton]", "RMSNorm"]]
    for torch_row, fused_row in (rows[0:2], rows[2:4]):
        assert torch_row[-1] == "1.00x" and float(fused_row[3]) > 0
        assert fused_row[-1] == "2"  # launches per forward+backward: one forward, one backward


def test_host_without_device_cpu_is_one_line_and_exit_2():
    done = subprocess.run([sys.executable, BENCH, "--host"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2 and "--host is for --device cpu" in done.stderr and "Traceback" not in done.stderr


def test_cpu_with_a_gpu_only_option_is_one_line_and_exit_2():
    done = subprocess.run([sys.executable, BENCH, "--device", "cpu", "--sweep"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2 and "not --device cpu" in done.stderr and "Traceback" not in done.stderr


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
    for kernel in ("_forward_kernel", "_backward_kernel"):
        assert f"2x64x1000  {kernel}" in done.stdout, done.stdout
    assert "registers spilled to memory: none" in done.stdout


def test_sweep_groups_settings_by_their_launches():
    pytest.importorskip("triton")
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        from layernorm import SWEEP, sweep_settings
    finally:
        sys.path.remove(os.path.join(ROOT, "bench"))
    from nanogns.normgnorm import triton_kernels
    before = dict(triton_kernels.BACKWARD_TUNING)
    groups = sweep_settings((8, 1024, 768), torch.bfloat16, sm_count=132)
    assert triton_kernels.BACKWARD_TUNING == before  # left as it was
    assert before in groups[0][0]  # the current setting's group first
    every = [s for settings, _ in groups for s in settings]
    assert len(every) == len({tuple(s.values()) for s in every}) == 3 ** 5 == len(list(itertools.product(*SWEEP.values())))
    signatures = [[(l.name, l.grid, l.kwargs["num_warps"]) for l in launches] for _, launches in groups]
    assert len(groups) > 1
    # the groups differ in what they launch: work split (grid) or tile (warps, rows)
    assert len({str((sig, l[0].kwargs.get("ROWS"), l[0].args[-3:])) for sig, (_, l) in zip(signatures, groups)}) == len(groups)


# run in a fresh process: the Triton interpreter must be on before triton is imported
SWEEP_ON_CPU = """
import sys, torch
sys.path.insert(0, "bench")
import layernorm
from nanogns.normgnorm import triton_kernels

timed = []
def fake_timer(layer, x, dy, warmup, iters):
    y = layer(x)                         # really runs (the kernels, interpreted) ...
    torch.autograd.grad(y, [x] + list(layer.parameters()), dy)
    if not hasattr(layer, "weight_sqgradnorm"):
        return 1.0                       # torch's own LayerNorm
    t = dict(triton_kernels.BACKWARD_TUNING)   # ... with a made-up time that depends on the setting
    timed.append((2.0 + abs(t["min_rows_per_chunk"] - 16) + abs(t["values_per_thread"] - 16) / 4, t))
    return timed[-1][0]

shape = (2, 64, 16)
before = dict(triton_kernels.BACKWARD_TUNING)
best = layernorm.sweep([shape], torch.float32, 0, 1, device="cpu", timer=fake_timer)
groups = layernorm.sweep_settings(shape, torch.float32, 2)
assert len(timed) == len(groups) > 2, (len(timed), len(groups))  # each distinct launch timed once
assert timed[0][1] == before                                       # the current setting first
fastest = min(timed, key=lambda e: e[0])[1]
assert fastest != before and any(fastest in s and best in s for s, _ in groups), (fastest, best)
assert triton_kernels.BACKWARD_TUNING == before                    # put back
print("SWEEP OK")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter stands in for a GPU; bench/layernorm.py --sweep runs there")
def test_sweep_runs_and_picks_the_fastest_on_cpu():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-c", SWEEP_ON_CPU], capture_output=True, text=True, cwd=ROOT, env=env)
    assert done.returncode == 0 and "SWEEP OK" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    assert "over all shapes (geometric mean of the ratio to torch): now" in done.stdout
