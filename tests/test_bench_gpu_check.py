"""bench/gpu_check.py: its steps and the summary it writes (on CPU: the steps fail, and say so)."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import gpu_check  # noqa: E402


def test_unknown_step_is_one_line_and_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--out", str(tmp_path), "--steps", "env,bogus"])
    assert e.value.code == 2
    assert "unknown step(s) bogus" in capsys.readouterr().err


def test_repo_without_train_py_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--out", str(tmp_path), "--repo", str(tmp_path)])
    assert e.value.code == 2 and "there is no train.py" in capsys.readouterr().err


def test_a_failing_step_is_written_down_and_the_next_still_runs(tmp_path, monkeypatch):
    # two made-up steps: one whose command fails, one that succeeds after it
    ok = [sys.executable, "-c", "print('1 passed in 0.1s')"]
    monkeypatch.setattr(gpu_check, "STEPS", {
        "broken": (30, lambda a: [[sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"], ok]),
        "fine": (30, lambda a: [ok]),
    })
    assert gpu_check.main(["--out", str(tmp_path)]) == 1
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    assert summary[0].startswith("broken") and "exit 3, ok" in summary[0]
    assert summary[1].startswith("fine") and "1 passed" in summary[1]
    assert "boom" in (tmp_path / "broken.txt").read_text()


def test_a_step_past_its_limit_is_stopped_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "STEPS", {"slow": (1, lambda a: [[sys.executable, "-c", "import time; time.sleep(30)"],
                                                                    [sys.executable, "-c", "pass"]])})
    assert gpu_check.main(["--out", str(tmp_path)]) == 1
    line = (tmp_path / "summary.txt").read_text()
    assert "stopped after 1 s" in line and "not run (no time left)" in line


def test_every_step_names_commands_that_exist(tmp_path):
    args = gpu_check.argparse.Namespace(python=sys.executable, out=str(tmp_path), settings="nn", rounds=1,
                                        compiled_settings="nn", repo_flags=[])
    for name, (limit, commands) in gpu_check.STEPS.items():
        assert limit > 0
        for cmd in commands(args):
            scripts = [part for part in cmd if part.endswith(".py")]
            assert all(os.path.exists(os.path.join(ROOT, s)) for s in scripts), (name, scripts)


def test_the_linear_step_times_the_kernel_and_the_tests_step_runs_its_tests():
    assert "tests/test_linear_gns_kernel.py" in gpu_check.TESTS
    args = gpu_check.argparse.Namespace(python=sys.executable, out="gpu-check")
    assert gpu_check.STEPS["linear"][1](args) == [[sys.executable, "bench/gpu_check.py", "--out", "gpu-check",
                                                    "--time_linear"]]


def test_time_linear_without_a_gpu_is_one_line_and_exit_2(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is here")
    done = gpu_check.subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_check.py"), "--out",
                                     str(tmp_path), "--time_linear"], capture_output=True, text=True)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == "bench/gpu_check.py: error: --time_linear needs a CUDA GPU\n"


def test_time_linear_table_and_csv(tmp_path):
    """The linear step's timing, run here on the CPU under the Triton interpreter at tiny shapes:
    every way at every shape is timed and its norm compared with the bmm path's."""
    pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
    code = ("import sys; sys.path.insert(0, 'bench'); import gpu_check; "
            f"sys.exit(gpu_check.time_linear({str(tmp_path)!r}, batch=2, tokens=3, reps=1, "
            "shapes={'a': (20, 24), 'b': (40, 17)}, configs={'16x16': dict(block_l=16, block_k=16, block_t=16)}, "
            "device='cpu'))")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    done = gpu_check.subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = list(gpu_check.csv.DictReader(open(tmp_path / "linear.csv")))
    methods = ["torch GEMM dy^T x", "kernel: dW + norms", "kernel: norms (shim)", "bmm chunks: dW + norms",
               "ghost: norms", "kernel 16x16"]
    assert [(r["layer"], r["method"]) for r in rows] == [(layer, m) for layer in "ab" for m in methods]
    # bfloat16: the bmm path rounds each W_b to bfloat16 before squaring, the others square in float32
    assert all(abs(float(r["norm_vs_bmm"])) < 2e-3 for r in rows if r["norm_vs_bmm"])
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("kernel dW + norms: ") and "the bmm path" in last


def test_the_steps_share_one_budget_and_the_summary_says_what_was_not_run(tmp_path, monkeypatch):
    """The steps' own limits sum to more than one device command may run: --budget bounds them all, so the
    summary is written in time, naming each step there was no time left for."""
    sleep = [sys.executable, "-c", "import time; time.sleep(30)"]
    ok = [sys.executable, "-c", "print('1 passed in 0.1s')"]
    monkeypatch.setattr(gpu_check, "MIN_STEP_SECONDS", 1)
    monkeypatch.setattr(gpu_check, "STEPS", {"first": (60, lambda a: [ok]), "slow": (60, lambda a: [sleep]),
                                             "late": (60, lambda a: [ok])})
    assert gpu_check.main(["--out", str(tmp_path), "--budget", "3"]) == 1
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    assert summary[0].startswith("first") and "1 passed" in summary[0]
    assert summary[1].startswith("slow") and "stopped after" in summary[1]  # given what was left, not its 60 s
    assert summary[2].startswith("late") and "not run: the --budget of 3 s was spent" in summary[2]


def test_the_default_budget_leaves_a_minute_of_ten():
    assert gpu_check.BUDGET + 60 <= 600  # all of it within 10 minutes, with a minute for python, imports and the summary
