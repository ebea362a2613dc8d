"""bench/gpu_check.py: its plan within one budget, its steps and the summary it writes, and the one
folder of at most MAX_FILES files it leaves (on CPU: the steps fail, and say so)."""
import csv
import os
import stat
import sys
import time

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
        "broken": (30, "log.txt", lambda a, limit: [[sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"], ok]),
        "fine": (30, "log.txt", lambda a, limit: [ok]),
    })
    assert gpu_check.main(["--out", str(tmp_path)]) == 1
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    assert summary[0].startswith("broken") and "exit 3, ok" in summary[0]
    assert summary[1].startswith("fine") and "1 passed" in summary[1]
    log = (tmp_path / "log.txt").read_text()  # both steps' output, one after the other
    assert "boom" in log and log.index("==== broken") < log.index("==== fine")


def test_a_step_past_its_limit_is_stopped_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "STEPS", {"slow": (1, "slow.txt", lambda a, limit: [
        [sys.executable, "-c", "import time; time.sleep(30)"], [sys.executable, "-c", "pass"]])})
    assert gpu_check.main(["--out", str(tmp_path)]) == 1
    line = (tmp_path / "summary.txt").read_text()
    assert "stopped after 1 s" in line and "not run (no time left)" in line


def test_every_step_names_commands_that_exist(tmp_path):
    args = gpu_check.argparse.Namespace(python=sys.executable, out=str(tmp_path), settings="nn", rounds=1,
                                        compiled_settings="nn", repo_flags=[], scratch=str(tmp_path))
    for name, (limit, file, commands) in gpu_check.STEPS.items():
        assert limit > 0
        for cmd in commands(args, limit):
            scripts = [part for part in cmd if part.endswith(".py")]
            assert all(os.path.exists(os.path.join(ROOT, s)) for s in scripts), (name, scripts)


def test_the_linear_step_times_the_kernel_and_the_tests_step_runs_its_tests():
    assert "tests/test_linear_kernel.py" in gpu_check.TESTS
    args = gpu_check.argparse.Namespace(python=sys.executable, out="gpu-check")
    assert gpu_check.STEPS["linear"][2](args, 40) == [[sys.executable, "bench/gpu_check.py", "--out", "gpu-check",
                                                        "--time_linear"]]
    assert gpu_check.STEPS["linear"][1] == "kernels.txt"


def test_time_linear_without_a_gpu_is_one_line_and_exit_2(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is here")
    done = gpu_check.subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_check.py"), "--out",
                                     str(tmp_path), "--time_linear"], capture_output=True, text=True)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == "bench/gpu_check.py: error: --time_linear needs a CUDA GPU\n"


def test_the_linear_sweep_writes_the_routes_table_that_chooses_them(tmp_path):
    """The linear step's sweep, run here on the CPU under the Triton interpreter at tiny shapes: every
    route (the GEMM, the cuBLAS routes, the kernel at each tiling, the ghost norm where its Gram
    matrices are the smaller) at every shape, each against float64, into the file nanogns/layers reads
    (named by the device: linear-routes-cpu.csv here, by compute capability on a GPU), which ranks the
    exact routes of each shape fastest first."""
    pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
    import nanogns.layers as buffered
    code = ("import sys; sys.path.insert(0, 'bench'); import gpu_check; "
            f"sys.exit(gpu_check.time_linear({str(tmp_path)!r}, batch=2, tokens=3, reps=1, "
            "shapes={'toy': {'a': (20, 24), 'b': (40, 17)}}, tilings=('16x16 t16 w4 s1', '16x32 t16 w4 s1 split2'), "
            "device='cpu'))")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    done = gpu_check.subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert os.listdir(tmp_path) == ["linear-routes-cpu.csv"]
    with open(tmp_path / "linear-routes-cpu.csv", newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert tuple(reader.fieldnames) == buffered.ROUTE_COLUMNS
    routes = ["gemm", "bmm", "bmm-f32", "kernel 16x16 t16 w4 s1", "kernel 16x32 t16 w4 s1 split2", "ghost"]
    assert [(r["layer"], r["route"]) for r in rows] == [(layer, route) for layer in "ab" for route in routes]
    assert all((r["model"], r["T"], r["dtype"], r["card"]) == ("toy", "3", "bfloat16", "cpu") for r in rows)
    for r in rows:
        # float32 sums of exact bfloat16 products; "bmm" rounds each W_b to bfloat16 first
        bound = buffered.ROUTE_TOLERANCE if r["route"] == "bmm" else 1e-5
        assert r["norm_err"] == "" if r["route"] == "gemm" else float(r["norm_err"]) < bound, r
        assert float(r["grad_err"]) < (1e-2 if r["route"] in ("gemm", "ghost", "bmm") else 1e-5), r
    table = buffered.read_route_table(tmp_path / "linear-routes-cpu.csv")
    for layer, shape in (("a", (20, 24)), ("b", (40, 17))):
        timed = sorted((float(r["ms"]), r["route"]) for r in rows if r["layer"] == layer and r["route"] != "gemm")
        assert table[(*shape, "bfloat16")] == {3: [route for _, route in timed]}
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("fastest exact route (time over the GEMM's): toy a ") and "; toy b " in last


def test_the_throughput_steps_end_their_runs_in_time_and_keep_their_rows(tmp_path):
    args = gpu_check.argparse.Namespace(
        python="python", settings="nn,ln-fused", compiled_settings="nn", rounds=10, repo_flags=[],
        scratch=str(tmp_path))
    for name, compiled in (("eager", False), ("compiled", True)):
        cmd, = gpu_check.STEPS[name][2](args, 85)
        assert cmd[cmd.index("--time_limit") + 1] == str(85 - gpu_check.TABLE_SECONDS)
        assert cmd[cmd.index("--csv") + 1] == str(tmp_path / f"{name}.csv")
        assert cmd[cmd.index("--modes") + 1] == name and gpu_check.STEPS[name][1] == "throughput.txt"
    assert "--profile_only" in gpu_check.STEPS["profile"][2](args, 40)[0]


FAKE_PYTHON = """#!{python}
# every command of the steps, faked: its CSV, the Linear timing's CSV, a pytest count
import csv, os, sys
args = sys.argv[1:]
if args[:1] == ["-c"]:
    sys.exit(1)  # `import xdist`: not here
if "--csv" in args:
    with open(args[args.index("--csv") + 1], "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["setting", "ms_per_iter", "ratio", "compile"])
        writer.writerow(["nn", "25.0", "1.0", "--modes compiled" in " ".join(args)])
        writer.writerow(["nn-null", "25.5", "0.98", "--modes compiled" in " ".join(args)])
if "--time_linear" in args:
    open(os.path.join(args[args.index("--out") + 1], "linear.csv"), "w").write("layer,ms\\n")
print("1 passed in 0.1s")
"""


def test_a_whole_run_leaves_one_folder_of_at_most_max_files_with_its_summary(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON.format(python=sys.executable))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "out"
    gpu_check.main(["--out", str(out), "--python", str(fake)])  # nvidia-smi may be missing: env fails
    files = sorted(os.listdir(out))
    assert len(files) <= gpu_check.MAX_FILES == 8
    assert files == ["kernels.txt", "linear.csv", "profile.txt", "summary.txt", "tests.txt", "throughput.csv",
                     "throughput.txt"]
    summary = (out / "summary.txt").read_text()
    for name in gpu_check.STEPS:
        assert f"\n{name} " in "\n" + summary, name
    assert "nn 25.00 ms/iter; tokens/s vs nn: nn-null 0.980x" in summary and "7 files in" in summary
    with open(out / "throughput.csv") as f:  # eager's rows, then compiled's
        assert [(r["setting"], r["compile"]) for r in csv.DictReader(f)] == [
            ("nn", "False"), ("nn-null", "False"), ("nn", "True"), ("nn-null", "True")]


def test_an_out_folder_holding_files_is_refused_and_dry_run_runs_nothing(tmp_path, capsys):
    (tmp_path / "old.txt").write_text("another run's")
    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--out", str(tmp_path)])
    assert e.value.code == 2 and "holds files already" in capsys.readouterr().err
    fresh = tmp_path / "fresh"
    assert gpu_check.main(["--out", str(fresh), "--dry_run"]) == 0
    printed = capsys.readouterr().out
    assert not fresh.exists() and "compiled    145 s  -> throughput.txt" in printed and "--time_limit 130" in printed


def test_a_stopped_step_leaves_no_process_behind(tmp_path, monkeypatch):
    """pytest's workers, or train.py under the bench, must not outlive their step: the next step times the GPU."""
    pid_file = tmp_path / "child.pid"
    child = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    parent = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(60)"
    monkeypatch.setattr(gpu_check, "STEPS", {"slow": (8, "slow.txt", lambda a, limit: [[sys.executable, "-c", parent]])})
    assert gpu_check.main(["--out", str(tmp_path / "out")]) == 1
    pid = int(pid_file.read_text())
    for _ in range(50):  # killed; reaped by init soon after
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the step's grandchild {pid} is still running")


def test_every_test_that_needs_a_gpu_is_one_the_tests_step_runs():
    """A test skipped here for want of a CUDA GPU runs only where gpu_check runs it: each test file with
    such a skip is in TESTS, whole or by the node ids of those tests."""
    import re
    covered = {entry.split("::")[0] for entry in gpu_check.TESTS}
    missing = []
    for name in sorted(os.listdir(os.path.join(ROOT, "tests"))):
        if not name.startswith("test_") or not name.endswith(".py") or name == "test_bench_gpu_check.py":
            continue
        text = open(os.path.join(ROOT, "tests", name)).read()
        if re.search(r"skipif\(not torch\.cuda\.is_available\(\)|skipif\(not HAS_CUDA", text) and \
                f"tests/{name}" not in covered:
            missing.append(name)
    assert missing == []
