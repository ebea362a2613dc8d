import csv
import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import tracker as tracker_module
from csv_tools import load_log
from tracker import LogWrapper

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


def test_rows_columns_in_order_of_first_appearance_with_empty_cells(tmp_path):
    log = LogWrapper(out_dir=tmp_path)
    log.log({"a": 1, "b": 2.5})
    log.step()
    log.log({"b": 3.5, "c": "x"})
    log.step()
    log.step()  # nothing logged: no row, but the step number advances
    log.log({"a": 4})
    log.step()
    log.close()
    assert read_csv(tmp_path / "log.csv") == [
        ["step", "a", "b", "c"], ["0", "1", "2.5", ""], ["1", "", "3.5", "x"], ["3", "4", "", ""]]


def test_nothing_is_written_without_step(tmp_path):
    log = LogWrapper(out_dir=tmp_path)
    log.log({"a": 1})
    assert not (tmp_path / "log.csv").exists()
    with pytest.warns(UserWarning, match="not written"):
        log.close()
    assert not (tmp_path / "log.csv").exists()


def test_values_round_trip_exactly(tmp_path):
    values = {"f": 0.1 + 0.2, "tiny": 1.2345678901234567e-30, "t": torch.tensor(2.5), "i": torch.tensor(7),
              "np": np.float32(0.1), "big": 2 ** 40, "nan": float("nan")}
    with LogWrapper(out_dir=tmp_path) as log:
        log.log(values)
        log.step()
    df, _ = load_log(tmp_path)
    assert df["f"][0] == 0.1 + 0.2 and df["tiny"][0] == 1.2345678901234567e-30
    assert df["t"][0] == 2.5 and df["i"][0] == 7 and df["big"][0] == 2 ** 40
    assert df["np"][0] == pytest.approx(0.1, rel=1e-7) and np.isnan(df["nan"][0])


def test_config_json_and_logf(tmp_path):
    rows = []
    config = {"batch_size": 12, "out_dir": str(tmp_path), "dtype": "float16", "betas": (0.9, 0.95)}
    log = LogWrapper(logf=rows.append, config=config, out_dir=tmp_path)
    log.log({"iter_num": 0, "train/loss": 1.0})
    log.step()
    log.log({"iter_num": 1})
    log.step()
    log.close()
    assert json.loads((tmp_path / "config.json").read_text()) == {**config, "betas": [0.9, 0.95]}
    assert rows == [{"step": 0, "iter_num": 0, "train/loss": 1.0}, {"step": 1, "iter_num": 1}]


def test_step_is_reserved():
    with pytest.raises(ValueError, match="'step'"):
        LogWrapper().log({"step": 3})


def test_print_resolves_underscores_to_slashes(capsys):
    log = LogWrapper()
    log.log({"iter_num": 3, "train/lossf": 1.23454, "dt": 0.5, "lr": 6e-4, "train/gns/total/gns": 12.0})
    assert log.print("{iter_num=}: {train_lossf=:.4f}") == "iter_num=3: train/lossf=1.2345"
    assert capsys.readouterr().out == "iter_num=3: train/lossf=1.2345\n"
    assert log.format("dt={dt:.3f}s, {lr=:.1e}, {{literal}}, {iter_num!r}") == "dt=0.500s, lr=6.0e-04, {literal}, 3"
    assert log.format("{train_gns_total_gns=:.1f}") == "train/gns/total/gns=12.0"


def test_print_prefix_exact_first_ambiguity_and_missing():
    log = LogWrapper()
    log.log({"train/loss": 2.0, "val/loss": 3.0})
    with pytest.warns(UserWarning, match="'train/gns_total'"):
        assert log.format("{loss=:.1f} {gns_total=}", prefix="train/") == "loss=2.0 gns_total=n/a"
    # the exact key wins over a '_' -> '/' reading
    log.log({"val_loss": 4.0})
    assert log.format("{val_loss=}") == "val_loss=4.0"
    assert log.format("{loss=}", prefix="val/") == "loss=3.0"
    # two keys that both read as a_b_c: an error, not a guess
    log.log({"a/b_c": 1, "a_b/c": 2})
    with pytest.raises(ValueError, match="several logged keys"):
        log.format("{a_b_c=}")
    # not logged yet: n/a, and one warning per name
    with pytest.warns(UserWarning, match="nothing logged under 'train/mfu'"):
        assert log.format("{mfu=:.2f}%", prefix="train/") == "mfu=n/a%"
    # values are the most recent ever logged, also after step()
    log.step()
    assert log.format("{train_loss:.1f}") == "2.0"


def test_a_crash_during_a_header_rewrite_leaves_the_old_file_whole(tmp_path, monkeypatch):
    log = LogWrapper(out_dir=tmp_path)
    for step in range(3):
        log.log({"a": step})
        log.step()
    before = (tmp_path / "log.csv").read_text()

    def crash(*args):
        raise KeyboardInterrupt("killed between writing log.csv.tmp and the rename")
    monkeypatch.setattr(tracker_module.os, "replace", crash)
    log.log({"a": 3, "new": 1.0})
    with pytest.raises(KeyboardInterrupt):
        log.step()
    assert (tmp_path / "log.csv").read_text() == before
    monkeypatch.undo()
    # a resumed run redoes step 3 with the new column
    log = LogWrapper(out_dir=tmp_path, resume_step=3)
    log.log({"a": 3, "new": 1.0})
    log.step()
    log.close()
    assert read_csv(tmp_path / "log.csv") == [["step", "a", "new"], ["0", "0", ""], ["1", "1", ""],
                                              ["2", "2", ""], ["3", "3", "1.0"]]


CHILD = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    from tracker import LogWrapper
    log = LogWrapper(out_dir={out!r}, resume_step={resume})
    for step in range({start}, 10 ** 9):
        row = {{"iter_num": step, "loss": step / 7}}
        if step % 25 == 0:                   # a new column every 25 steps: header rewrites
            row[f"col{{step}}"] = step
        row["payload"] = "x" * (step % 3000)  # long rows: a kill can land mid-write
        log.log(row)
        log.step()
        print(step, flush=True)
""")


def run_and_kill(out, start, resume, n_steps):
    """Run a logging loop in a child and SIGKILL it once it has reported n_steps completed steps."""
    child = subprocess.Popen([sys.executable, "-c", CHILD.format(root=ROOT, out=str(out), start=start, resume=resume)],
                             stdout=subprocess.PIPE, text=True)
    last = None
    for line in child.stdout:
        last = int(line)
        if last >= start + n_steps:
            break
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    child.stdout.close()
    assert child.returncode == -signal.SIGKILL
    return last


def check_log(out, last_reported):
    df, _ = load_log(out)
    steps = df["step"].tolist()
    raw_steps = [int(r[0]) for r in read_csv(out / "log.csv")[1:] if r]
    assert raw_steps[:len(steps)] == steps == list(range(len(steps))), "every step once in the file, none lost"
    assert steps[-1] >= last_reported, "every step reported done by step() is on disk"
    assert (df["iter_num"] == df["step"]).all() and np.allclose(df["loss"], df["step"] / 7)
    assert (df["payload"].fillna("").str.len() == df["step"] % 3000).all()
    for step in range(0, steps[-1] + 1, 25):
        assert df[f"col{step}"].dropna().tolist() == [step]
    return steps[-1]


def test_sigkill_loses_no_completed_step_and_resume_neither_duplicates_nor_loses(tmp_path):
    last = check_log(tmp_path, run_and_kill(tmp_path, 0, None, 300))
    # resume from a "checkpoint" some steps back: the rows from there on are redone, once
    resume = last - 40
    last = check_log(tmp_path, run_and_kill(tmp_path, resume, resume, 100))
    assert last >= resume + 100


def test_resume_keeps_earlier_rows_and_drops_later_ones(tmp_path):
    log = LogWrapper(out_dir=tmp_path)
    for step in range(10):
        log.log({"a": step, **({"late": 1} if step == 8 else {})})
        log.step()
    log.close()
    with open(tmp_path / "log.csv", "a") as f:
        f.write("10,10,")  # a write cut short by a kill
    log = LogWrapper(out_dir=tmp_path, resume_step=6)
    assert log.step_count == 6
    for step in range(6, 12):
        log.log({"a": 100 + step, "b": step})
        log.step()
    log.close()
    assert [r[0] for r in read_csv(tmp_path / "log.csv")[1:]] == [str(s) for s in range(12)]
    df, _ = load_log(tmp_path)
    assert list(df.columns) == ["step", "a", "late", "b"]
    assert df["step"].tolist() == list(range(12))
    assert df["a"].tolist() == list(range(6)) + [100 + s for s in range(6, 12)]
    assert df["late"].isna().all() and df["b"].isna().sum() == 6


def test_resume_without_a_log_and_a_fresh_run_replacing_an_old_log(tmp_path):
    log = LogWrapper(out_dir=tmp_path, resume_step=5)
    log.log({"a": 1})
    log.step()
    log.close()
    assert read_csv(tmp_path / "log.csv") == [["step", "a"], ["5", "1"]]
    log = LogWrapper(out_dir=tmp_path)
    assert (tmp_path / "log.csv").exists(), "the old log stays until the new run's first step"
    log.log({"b": 2})
    log.step()
    log.close()
    assert read_csv(tmp_path / "log.csv") == [["step", "b"], ["0", "2"]]


def test_step_after_close_keeps_the_rows(tmp_path):
    log = LogWrapper(out_dir=tmp_path)
    log.log({"a": 1})
    log.step()
    log.close()
    log.log({"a": 2})
    log.step()
    log.close()
    assert read_csv(tmp_path / "log.csv") == [["step", "a"], ["0", "1"], ["1", "2"]]


def test_wandb_offline(tmp_path, monkeypatch):
    try:
        import wandb  # noqa: F401
    except Exception as e:  # an optional dependency
        pytest.skip(f"wandb cannot be imported: {e}")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    log = LogWrapper(config={"lr": 0.1}, out_dir=out, wandb_log=True, wandb_project="test", wandb_run_name="run")
    assert log.wandb_run is not None and log.wandb_run.name == "run"
    for step in range(3):
        log.log({"train/loss": 1.0 / (step + 1)})
        log.step()
    log.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    assert load_log(out)[0]["train/loss"].tolist() == [1.0, 0.5, 1.0 / 3]


# ---------------------------------------------------------------- what must reach the disk, and when

def _record_fsyncs_and_replaces(monkeypatch):
    """Every os.fsync (by the file's name) and os.replace the tracker makes, in order."""
    events = []
    fsync, replace = os.fsync, os.replace

    def spy_fsync(fd):
        events.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        return fsync(fd)

    def spy_replace(src, dst):
        events.append(("replace", os.path.basename(src), os.path.basename(dst)))
        return replace(src, dst)
    monkeypatch.setattr(tracker_module.os, "fsync", spy_fsync)
    monkeypatch.setattr(tracker_module.os, "replace", spy_replace)
    return events


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names open files through /proc")
def test_every_row_is_on_disk_when_step_returns(tmp_path, monkeypatch):
    out = tmp_path / "out"
    log = LogWrapper(out_dir=out)
    events = _record_fsyncs_and_replaces(monkeypatch)
    log.log({"a": 1})
    log.step()  # first row: the whole file, written beside and swapped in, directory synced
    assert events == [("fsync", "log.csv.tmp"), ("replace", "log.csv.tmp", "log.csv"), ("fsync", "out")]
    for step in range(1, 4):  # same columns: appended, and synced each time
        del events[:]
        log.log({"a": step})
        log.step()
        assert events == [("fsync", "log.csv")]
    log.close()


def test_resume_over_an_empty_log_starts_afresh(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "log.csv").write_text("")
    log = LogWrapper(out_dir=out, resume_step=3)
    log.log({"a": 1})
    log.step()
    log.close()
    assert read_csv(out / "log.csv") == [["step", "a"], ["3", "1"]]


@pytest.mark.parametrize("text, error", [("iter,a\n0,1\n5,2\n", "not 'step'"),
                                         ("step,a\n0,1\nx,2\n1,3\n", "cannot resume")])
def test_resume_refuses_a_file_that_is_not_its_log_and_leaves_it_alone(tmp_path, text, error):
    out = tmp_path / "out"
    out.mkdir()
    (out / "log.csv").write_text(text)
    with pytest.raises(ValueError, match=error):
        LogWrapper(out_dir=out, resume_step=3)
    assert (out / "log.csv").read_text() == text


def test_config_json_is_rewritten_on_resume_and_takes_any_value(tmp_path):
    out = tmp_path / "out"
    LogWrapper(out_dir=out, config={"lr": 1}).close()
    LogWrapper(out_dir=out, config={"lr": 2, "dtype": torch.float16}, resume_step=0).close()
    assert json.loads((out / "config.json").read_text()) == {"lr": 2, "dtype": "torch.float16"}


def test_wandb_gets_the_csv_step_numbers(monkeypatch):
    calls = []

    class FakeRun:
        def log(self, row, **kwargs):
            calls.append((row, kwargs))

        def finish(self):
            pass
    fake = type(sys)("wandb")
    fake.init = lambda **kwargs: FakeRun()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    log = LogWrapper(wandb_log=True, resume_step=5)
    log.log({"a": 1})
    log.step()
    log.step()  # nothing logged: no row, but the step counts
    log.log({"a": 2})
    log.step()
    log.close()
    assert calls == [({"a": 1}, {"step": 5}), ({"a": 2}, {"step": 7})]
