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
