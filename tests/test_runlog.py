import contextlib
import csv
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch

import nanogns.runlog as tracker_module
from nanogns.logread import load_log
from nanogns.maths import WRITER, WRITER_KEY
from nanogns.refusals import ReferenceNameError
from nanogns.runlog import LogWrapper, LogWriteError, NotALogError, transform_format_string

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
    assert log.logf == rows.append and log.config is config and log.out_dir == tmp_path
    log.log({"iter_num": 0, "train/loss": 1.0})
    log.step()
    log.log({"iter_num": 1})
    log.step()
    log.close()
    # the run's settings, and whose log it is (gns-analysis.py reads that, never guesses)
    assert json.loads((tmp_path / "config.json").read_text()) == {**config, "betas": [0.9, 0.95], WRITER_KEY: WRITER}
    # as the reference implementation calls it: the values of the step, without a "step" key
    assert rows == [{"iter_num": 0, "train/loss": 1.0}, {"iter_num": 1}]


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
    from nanogns.runlog import LogWrapper
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
        if line.startswith("note: "):  # a resume's rows moved aside
            continue
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
    with pytest.warns(UserWarning, match="log.csv is empty: steps 0 to 2 are missing"):
        log = LogWrapper(out_dir=out, resume_step=3)
    log.log({"a": 1})
    log.step()
    log.close()
    assert read_csv(out / "log.csv") == [["step", "a"], ["3", "1"]]


@pytest.mark.parametrize("content", [b"iter,a\n0,1\n5,2\n", b"\x00\x9f\xff\xfe,binary\n\x00\x01\n",
                                     "\ufeffstep,a\n0,1\n".encode("utf-16"), b"no newline at all"])
def test_resume_refuses_a_file_that_is_not_its_log_and_leaves_it_alone(tmp_path, content):
    out = tmp_path / "out"
    out.mkdir()
    (out / "log.csv").write_bytes(content)
    with pytest.raises(NotALogError, match=r"(not 'step'|\(binary, or not UTF-8 text\)): not a log this program wrote; "
                                           "move it away or use another out_dir$") as error:
        LogWrapper(out_dir=out, resume_step=3)
    assert isinstance(error.value, ValueError) and "\n" not in str(error.value)
    assert (out / "log.csv").read_bytes() == content
    assert sorted(os.listdir(out)) == ["log.csv"]


def test_config_json_is_rewritten_on_resume_and_takes_any_value(tmp_path):
    out = tmp_path / "out"
    LogWrapper(out_dir=out, config={"lr": 1}).close()
    LogWrapper(out_dir=out, config={"lr": 2, "dtype": torch.float16}, resume_step=0).close()
    assert json.loads((out / "config.json").read_text()) == {"lr": 2, "dtype": "torch.float16", WRITER_KEY: WRITER}


def test_the_last_row_written_is_read_back_from_the_log_as_the_file_holds_it(tmp_path):
    """A checkpoint keeps LogWrapper.last_row(); a resume finds that row in log.csv (logged_row) whatever
    was rewritten since: a longer header pads the older rows, a resume cuts the ones after it."""
    from nanogns.runlog import logged_row
    out = tmp_path / "out"
    log = LogWrapper(out_dir=out, numbers_only=True)
    assert log.last_row() is None
    for step in range(3):
        log.log({"iter_num": step, "train/lossf": 1 / (step + 1), **({"grad_norm": 0.1 + 0.2} if step else {})})
        log.step()
    kept = log.last_row()
    assert kept == (2, {"iter_num": "2", "train/lossf": repr(1 / 3), "grad_norm": repr(0.1 + 0.2)})
    log.log({"iter_num": 3, "val/loss": 2.5})  # a new column: the file is rewritten, its rows padded
    log.step()
    log.close()
    assert logged_row(out / "log.csv", 2) == kept[1] and logged_row(out / "log.csv", 3) == {"iter_num": "3", "val/loss": "2.5"}
    LogWrapper(out_dir=out, resume_step=3, numbers_only=True).close()  # rows of step 3 on moved aside
    assert logged_row(out / "log.csv", 2) == kept[1] and logged_row(out / "log.csv", 3) is None
    assert logged_row(out / "log.csv", 9) is None and logged_row(tmp_path / "nowhere.csv", 2) is None


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


# ---------------------------------------------------------------- the reference implementation's names

def test_reference_log_dict_ordered_keys_step_count_and_print(capsys):
    log = LogWrapper()
    assert not log.log_dict and log.ordered_keys == [] and log.step_count == 0
    log.log({"iter_num": 3, "train/lossf": 1.23454})
    log.log({"mfu": 0.5})
    assert log.log_dict == {"iter_num": 3, "train/lossf": 1.23454, "mfu": 0.5}
    assert log.ordered_keys == ["iter_num", "train/lossf", "mfu"]
    iter_num = 3
    # the reference's train.py: an f-string part and a format part
    log.print(f"{iter_num=}: " + "{train_lossf=:.4f}, {mfu=:.2f}%", prefix=None)
    assert capsys.readouterr().out == "iter_num=3: train/lossf=1.2345, mfu=0.50%\n"
    log.print("{lossf=:.1f}", prefix="train/")
    assert capsys.readouterr().out == "lossf=1.2\n"
    log.step()
    assert log.log_dict == {} and not log.log_dict and log.step_count == 1  # what `if tracker.log_dict:` tests
    log.step()
    log.log({"lr": 0.1, "iter_num": 5})
    assert log.ordered_keys == ["iter_num", "train/lossf", "mfu", "lr"] and log.step_count == 2


def test_logf_and_wandb_get_the_row_without_no_sync_keys(monkeypatch):
    logged, wandb_calls = [], []

    class FakeRun:
        def log(self, row, **kwargs):
            wandb_calls.append((row, kwargs))

        def finish(self):
            pass
    fake = type(sys)("wandb")
    fake.init = lambda **kwargs: FakeRun()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    log = LogWrapper(logf=logged.append, wandb_log=True)
    assert log.no_sync_keyword == "no_sync"
    log.log({"a": 1, "debug/no_sync/x": 2})
    log.step()
    log.log({"no_sync_only": 1})
    log.step()  # the reference calls logf even when every key is filtered out
    log.close()
    assert logged == [{"a": 1}, {}]
    assert wandb_calls == [({"a": 1}, {"step": 0}), ({}, {"step": 1})]


def test_no_sync_keys_still_reach_the_csv(tmp_path):
    with LogWrapper(out_dir=tmp_path, logf=lambda row: None) as log:
        log.log({"a": 1, "x/no_sync": 2})
        log.step()
    assert read_csv(tmp_path / "log.csv") == [["step", "a", "x/no_sync"], ["0", "1", "2"]]


def test_transform_format_string():
    assert transform_format_string("Value is {x=}") == "Value is x={x}"
    assert transform_format_string("Formatted value is {x=:.2f}") == "Formatted value is x={x:.2f}"
    s = transform_format_string("{a=}, {b_c=:,.0f} and {d} {e:>3}")
    assert s == "a={a}, b_c={b_c:,.0f} and {d} {e:>3}"
    assert s.format(a=1, b_c=12345.6, d="d", e=7) == "a=1, b_c=12,346 and d   7"


@pytest.mark.parametrize("name, hint", [
    ("setup_csv_writer", "first step"), ("write_config", "config="), ("update_header", "step()"),
    ("finalize_csv", "close()"), ("csv_writer", ".path"), ("csv_data_file", ".path"),
    ("csv_header_file", ".path"), ("csv_data_path", ".path"), ("csv_header_path", ".path"),
    ("header_updated", ".ordered_keys"), ("is_finalized", "complete after every step")])
def test_reference_csv_machinery_is_refused_with_what_to_use(tmp_path, name, hint):
    log = LogWrapper(out_dir=tmp_path)
    with pytest.raises(ReferenceNameError, match=f"LogWrapper.{name} is the reference implementation's.*{re.escape(hint)}"):
        getattr(log, name)
    log.close()


def test_module_exists_is_refused():
    with pytest.raises(ReferenceNameError, match=r"tracker\.exists .*is not None"):
        from nanogns.runlog import exists  # noqa: F401
    assert not hasattr(tracker_module, "something_else")


def test_tracker_does_not_import_pandas():
    code = "import sys, tracker; print('pandas' in sys.modules, 'numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


# ---------------------------------------------------------------- one write per row, and a kill in the middle of one

def test_each_row_is_appended_with_one_write_of_the_whole_line(tmp_path, monkeypatch):
    log = LogWrapper(out_dir=tmp_path)
    log.log({"a": 0, "payload": ""})
    log.step()
    writes = []
    write = os.write

    def spy(fd, data):
        writes.append(bytes(data))
        return write(fd, data)
    monkeypatch.setattr(tracker_module.os, "write", spy)
    for step in range(1, 4):
        log.log({"a": step, "payload": "x" * 300_000})  # several pages: a buffered writer splits it
        log.step()
        assert writes == [f"{step},{step},{'x' * 300_000}\r\n".encode()]
        del writes[:]
    log.close()


KILLED_MID_WRITE = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {root!r})
    import nanogns.runlog as tracker
    log = tracker.LogWrapper(out_dir={out!r})
    write = os.write

    def torn_write(fd, data):
        # the kernel took the first part of the row when the process was killed
        write(fd, bytes(data[:len(data) // 2]))
        os.kill(os.getpid(), signal.SIGKILL)
    for step in range(10):
        log.log({{"iter_num": step, "payload": "x" * 50_000}})
        if step == 7:
            tracker.os.write = torn_write
        log.step()
""")


def kill_mid_write(out):
    p = subprocess.run([sys.executable, "-c", KILLED_MID_WRITE.format(root=ROOT, out=str(out))])
    assert p.returncode == -signal.SIGKILL
    raw = (out / "log.csv").read_bytes()
    assert raw.endswith(b"x" * 1000) and raw.count(b"\n") == 8  # header and steps 0-6, step 7 torn
    assert load_log(out)[0]["step"].tolist() == list(range(7)), "readers drop the torn row"
    return raw


def test_a_row_torn_by_a_kill_is_dropped_and_the_resumed_run_redoes_it(tmp_path, capsys):
    raw = kill_mid_write(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the torn row is the step being redone: nothing to report
        log = LogWrapper(out_dir=tmp_path, resume_step=7)
    assert (tmp_path / "log.csv").read_bytes() == raw[:raw.rindex(b"\n") + 1]
    # set aside under its header, never deleted
    assert (tmp_path / "log.csv.rejected").read_bytes() == raw[:raw.index(b"\n") + 1] + raw[raw.rindex(b"\n") + 1:] + b"\r\n"
    assert capsys.readouterr().out == f"note: {tmp_path / 'log.csv'}: 1 row from step 7 on, which the run redoes, moved to log.csv.rejected\n"
    for step in range(7, 9):
        log.log({"iter_num": step, "payload": "y"})
        log.step()
    log.close()
    df, _ = load_log(tmp_path)
    assert df["step"].tolist() == df["iter_num"].tolist() == list(range(9))


def test_a_torn_row_before_the_resume_step_is_reported_and_kept_aside(tmp_path):
    raw = kill_mid_write(tmp_path)
    torn = raw[raw.rindex(b"\n") + 1:]
    with pytest.warns(UserWarning) as caught:
        LogWrapper(out_dir=tmp_path, resume_step=9).close()
    messages = [str(w.message) for w in caught]
    assert messages == [f"{tmp_path / 'log.csv'} line 9: a row cut short by a kill or a full disk; moved to log.csv.rejected",
                        f"{tmp_path / 'log.csv'}: steps 7 to 8 are missing (the log ends before step 9, where the run resumes)"]
    assert (tmp_path / "log.csv.rejected").read_bytes() == torn + b"\r\n"
    assert (tmp_path / "log.csv").read_bytes() == raw[:-len(torn)]


# ---------------------------------------------------------------- a full disk

def enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def assert_disk_full_error(error, path):
    assert isinstance(error, OSError) and error.errno == errno.ENOSPC and error.filename == str(path)
    message = str(error)
    assert "\n" not in message and str(path) in message and "the disk is full" in message
    assert error.__cause__ is None and error.__suppress_context__, "one error, not a chain"


def test_a_failed_append_leaves_the_complete_rows_and_the_step_can_be_retried(tmp_path, monkeypatch):
    log = LogWrapper(out_dir=tmp_path)
    for step in range(3):
        log.log({"a": step})
        log.step()
    before = (tmp_path / "log.csv").read_bytes()
    write = os.write
    calls = []

    def half_then_full(fd, data):
        # the disk fills in the middle of the row: part of it lands, then the rest fails
        calls.append(len(data))
        if len(calls) == 1:
            return write(fd, bytes(data[:len(data) // 2]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(tracker_module.os, "write", half_then_full)
    log.log({"a": 3})
    with pytest.raises(LogWriteError) as error:
        log.step()
    assert_disk_full_error(error.value, tmp_path / "log.csv")
    assert "appending the row of step 3" in str(error.value)
    assert len(calls) == 2 and (tmp_path / "log.csv").read_bytes() == before, "the half row is cut back"
    assert log.log_dict == {"a": 3} and log.step_count == 3
    # an fsync that fails after the write is cut back the same way
    monkeypatch.setattr(tracker_module.os, "write", write)
    monkeypatch.setattr(tracker_module.os, "fsync", enospc)
    with pytest.raises(LogWriteError):
        log.step()
    assert (tmp_path / "log.csv").read_bytes() == before
    monkeypatch.undo()
    log.step()  # room again: the same step, once
    log.close()
    assert read_csv(tmp_path / "log.csv") == [["step", "a"], ["0", "0"], ["1", "1"], ["2", "2"], ["3", "3"]]


@pytest.mark.parametrize("fail", ["write", "fsync", "replace"])
def test_a_failed_header_rewrite_leaves_the_old_file_and_no_tmp(tmp_path, monkeypatch, fail):
    log = LogWrapper(out_dir=tmp_path)
    log.log({"a": 0})
    log.step()
    before = (tmp_path / "log.csv").read_bytes()
    if fail == "write":  # the .tmp is written through a buffered file: fail its writes
        real_open = open
        monkeypatch.setattr(tracker_module, "open", lambda path, mode="r", *a, **k: (
            FullFile(real_open(path, mode, *a, **k)) if mode == "wb" else real_open(path, mode, *a, **k)), raising=False)
    else:
        monkeypatch.setattr(tracker_module.os, fail, enospc)
    log.log({"a": 1, "new": 2})
    with pytest.raises(LogWriteError) as error:
        log.step()
    assert_disk_full_error(error.value, tmp_path / "log.csv")
    assert "rewriting it with a new column" in str(error.value)
    assert (tmp_path / "log.csv").read_bytes() == before and sorted(os.listdir(tmp_path)) == ["log.csv"]
    monkeypatch.undo()
    log.step()
    log.close()
    assert read_csv(tmp_path / "log.csv") == [["step", "a", "new"], ["0", "0", ""], ["1", "1", "2"]]


class FullFile:
    """A binary file whose writes fail as on a full disk."""

    def __init__(self, f):
        self.f = f

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def test_a_failed_config_write_keeps_the_old_config_and_no_tmp(tmp_path, monkeypatch):
    LogWrapper(out_dir=tmp_path, config={"lr": 1}).close()
    monkeypatch.setattr(tracker_module.os, "fsync", enospc)
    with pytest.raises(LogWriteError) as error:
        LogWrapper(out_dir=tmp_path, config={"lr": 2}, resume_step=0)
    assert_disk_full_error(error.value, tmp_path / "config.json")
    assert json.loads((tmp_path / "config.json").read_text()) == {"lr": 1, WRITER_KEY: WRITER}
    assert sorted(os.listdir(tmp_path)) == ["config.json"]


def test_other_write_errors_say_what_failed(tmp_path, monkeypatch):
    log = LogWrapper(out_dir=tmp_path)
    log.log({"a": 0})
    log.step()
    monkeypatch.setattr(tracker_module.os, "write", lambda *a: (_ for _ in ()).throw(OSError(errno.EIO, "Input/output error")))
    log.log({"a": 1})
    with pytest.raises(LogWriteError, match=r"log\.csv: appending the row of step 1 failed, Input/output error; "
                                            r"the file is left as it was$") as error:
        log.step()
    assert error.value.errno == errno.EIO


def write_log(out, rows, header="step,a"):
    out.mkdir(exist_ok=True)
    text = header + "\r\n" + "".join(f"{r}\r\n" for r in rows)
    (out / "log.csv").write_bytes(text.encode())
    return text.encode()


def test_resume_cuts_the_file_in_place_without_a_second_copy(tmp_path, monkeypatch):
    out = tmp_path / "out"
    raw = write_log(out, [f"{s},{s * 10}" for s in range(20)])

    def no_copy(*args, **kwargs):
        raise AssertionError("a resume with an unchanged header must not copy the file")
    real_open = open
    monkeypatch.setattr(tracker_module.os, "replace", no_copy)
    monkeypatch.setattr(tracker_module, "open", lambda path, mode="r", *a, **k: (
        no_copy() if "w" in mode or "a" in mode else real_open(path, mode, *a, **k)), raising=False)
    log = LogWrapper(out_dir=out, resume_step=12)
    assert (out / "log.csv").read_bytes() == raw[:raw.index(b"12,120")]
    log.log({"a": -12})
    log.step()
    log.close()
    monkeypatch.undo()
    assert [r[0] for r in read_csv(out / "log.csv")[1:]] == [str(s) for s in range(13)]
    assert sorted(os.listdir(out)) == ["log.csv", "log.csv.rejected"]  # the cut rows, appended there
    assert (out / "log.csv.rejected").read_bytes() == raw[:raw.index(b"\n") + 1] + raw[raw.index(b"12,120"):]


# ---------------------------------------------------------------- resume checks the log it continues

def test_resume_moves_malformed_rows_aside_and_reports_each(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    rows = [b"0,0", b"1,1,extra", b"x,2", b"2,2", b"2,22", b"1,3", b"3,\xff\xfe", b"4,a\x00b", b"5,5", b"",
            b"6,6", b"7,7", b"8,8"]
    (out / "log.csv").write_bytes(b"step,a\r\n" + b"".join(r + b"\r\n" for r in rows))
    with pytest.warns(UserWarning) as caught:
        log = LogWrapper(out_dir=out, resume_step=7)
    path = out / "log.csv"
    moved = "moved to log.csv.rejected"
    assert [str(w.message) for w in caught] == [
        f"{path} line 3: 3 cells for 2 columns; {moved}",
        f"{path} line 4: the step 'x' is not an integer; {moved}",
        f"{path} line 5: step 1 is missing",
        f"{path} line 6: step 2 after step 2; {moved}",
        f"{path} line 7: step 1 after step 2; {moved}",
        f"{path}: 4 more problems like these"]  # lines 8 not UTF-8, 9 binary, 10 steps 3-4 missing, 11 empty
    assert (out / "log.csv.rejected").read_bytes() == b"".join(r + b"\r\n" for r in [
        b"1,1,extra", b"x,2", b"2,22", b"1,3", b"3,\xff\xfe", b"4,a\x00b", b"",
        b"step,a", b"7,7", b"8,8"])  # then the steps the run redoes, under their header
    for step in range(7, 9):
        log.log({"a": 100 + step})
        log.step()
    log.close()
    assert read_csv(path) == [["step", "a"], ["0", "0"], ["2", "2"], ["5", "5"], ["6", "6"], ["7", "107"], ["8", "108"]]
    # the log is clean now except for the gaps, which stay reported
    with pytest.warns(UserWarning) as caught:
        LogWrapper(out_dir=out, resume_step=9).close()
    assert [str(w.message) for w in caught] == [f"{path} line 3: step 1 is missing", f"{path} line 4: steps 3 to 4 are missing"]
    assert (out / "log.csv.rejected").read_bytes().count(b"\n") == 10, "nothing saved twice"


def test_resume_reports_a_log_that_ends_before_the_checkpoint(tmp_path):
    out = tmp_path / "out"
    raw = write_log(out, [f"{s},{s}" for s in range(5)])
    with pytest.warns(UserWarning, match=r"log\.csv: steps 5 to 9 are missing \(the log ends before step 10, where the run resumes\)"):
        log = LogWrapper(out_dir=out, resume_step=10)
    assert (out / "log.csv").read_bytes() == raw and not (out / "log.csv.rejected").exists()
    log.log({"a": 10})
    log.step()
    log.close()
    assert [r[0] for r in read_csv(out / "log.csv")[1:]] == ["0", "1", "2", "3", "4", "10"]


def test_resume_keeps_rows_shorter_than_the_header_and_pads_them_on_a_new_column(tmp_path):
    # the reference implementation's log.csv: rows written before a key first appeared are shorter
    out = tmp_path / "out"
    write_log(out, ["0,1", "1,2,3", "2,,4"], header="step,a,b")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        log = LogWrapper(out_dir=out, resume_step=3)
    assert log.ordered_keys == ["a", "b"]
    log.log({"c": 5})
    log.step()
    log.close()
    assert read_csv(out / "log.csv") == [["step", "a", "b", "c"], ["0", "1", "", ""], ["1", "2", "3", ""],
                                         ["2", "", "4", ""], ["3", "", "", "5"]]


def test_a_quoted_cell_with_a_newline_is_one_row(tmp_path):
    out = tmp_path / "out"
    with LogWrapper(out_dir=out) as log:
        for step in range(3):
            log.log({"note": f"line one\nline two of {step}", "a": step})
            log.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        log = LogWrapper(out_dir=out, resume_step=2)
    log.log({"a": 2, "new": 1})
    log.step()
    log.close()
    rows = read_csv(out / "log.csv")
    assert rows == [["step", "note", "a", "new"], ["0", "line one\nline two of 0", "0", ""],
                    ["1", "line one\nline two of 1", "1", ""], ["2", "", "2", "1"]]


@pytest.mark.parametrize("fail", ["rejected", "log"])
def test_a_resume_that_cannot_write_leaves_both_files_as_they_were(tmp_path, monkeypatch, fail):
    out = tmp_path / "out"
    raw = write_log(out, ["0,0", "x,1", "1,1", "2,2"])
    real_open = open
    if fail == "rejected":  # saving the malformed row fails
        monkeypatch.setattr(tracker_module.os, "write", enospc)
    else:  # the rewrite of log.csv without it fails
        monkeypatch.setattr(tracker_module, "open", lambda path, mode="r", *a, **k: (
            FullFile(real_open(path, mode, *a, **k)) if mode == "wb" else real_open(path, mode, *a, **k)), raising=False)
    with pytest.warns(UserWarning, match="not an integer"), pytest.raises(LogWriteError) as error:
        LogWrapper(out_dir=out, resume_step=2)
    assert_disk_full_error(error.value, out / ("log.csv.rejected" if fail == "rejected" else "log.csv"))
    assert (out / "log.csv").read_bytes() == raw
    assert not (out / "log.csv.tmp").exists()
    assert (out / "log.csv.rejected").read_bytes() == b""  # not saved, or cut back: never twice


@pytest.mark.parametrize("record, name, content", [
    ("record_norm_methods", "linear_norm_methods.json", {"h.0.c_fc": "ghost", "lm_head": "materialise"}),
    ("record_kinds", "layer_kinds.json", {"a.weight": "linear", "n.weight": "rmsnorm"}),
])
def test_the_run_records_are_json_files_written_whole(tmp_path, record, name, content):
    getattr(LogWrapper(out_dir=str(tmp_path)), record)(content)
    with open(tmp_path / name) as f:
        assert json.load(f) == content
    assert not os.path.exists(tmp_path / f"{name}.tmp")
    getattr(LogWrapper(out_dir=None), record)(content)  # nowhere on disk: nothing


# -- atomic_write: every file written whole ------------------------------------------------------

def test_atomic_write_replaces_whole_and_fsyncs_file_and_directory(tmp_path, monkeypatch):
    path = str(tmp_path / "f.txt")
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(tracker_module.os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")),
                                                                real_fsync(fd)))
    tracker_module.atomic_write(path, lambda f: f.write("new\n"), mode="w")
    assert open(path).read() == "new\n" and not os.path.exists(path + ".tmp")
    assert synced == [path + ".tmp", str(tmp_path)]  # the file before the rename, the directory after


def test_atomic_write_that_fails_keeps_the_old_file_and_no_tmp(tmp_path):
    path = str(tmp_path / "f.bin")
    tracker_module.atomic_write(path, lambda f: f.write(b"old"))

    def half_then_fail(f):
        f.write(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(OSError):
        tracker_module.atomic_write(path, half_then_fail)
    assert open(path, "rb").read() == b"old" and os.listdir(tmp_path) == ["f.bin"]


def test_only_atomic_write_renames_files_into_place():
    """One home for the tmp + fsync + os.replace sequence: no other source of ours calls os.replace
    (but nanogns/normgnorm/cuda_ext.py and cpu_ext.py, which rename what a compiler wrote into the build cache)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    callers = []
    for folder, _, files in os.walk(root):
        parts = os.path.relpath(folder, root).split(os.sep)
        if any(part.startswith(".") and part != "." or part in ("tests", "__pycache__", "build") for part in parts):
            continue
        for name in files:
            if name.endswith(".py") and "os.replace(" in open(os.path.join(folder, name)).read():
                callers.append(os.path.relpath(os.path.join(folder, name), root))
    assert sorted(callers) == ["nanogns/normgnorm/cpu_ext.py", "nanogns/normgnorm/cuda_ext.py", "nanogns/runlog.py"]


def test_a_row_with_a_cell_that_is_not_a_number_is_malformed_where_every_value_is_one(tmp_path):
    out = tmp_path / "out"
    write_log(out, ["0,0.5,", "1,nan,1", "2,this is, not a row", "3,,", "4,1e-3,inf"], header="step,a,b")
    with pytest.warns(UserWarning) as caught:
        LogWrapper(out_dir=out, resume_step=5, numbers_only=True).close()
    assert [str(w.message) for w in caught] == [
        f"{out / 'log.csv'} line 4: the cell 'this is' is not a number; moved to log.csv.rejected",
        f"{out / 'log.csv'} line 5: step 2 is missing"]
    assert (out / "log.csv.rejected").read_bytes() == b"2,this is, not a row\r\n"
    assert [r[0] for r in read_csv(out / "log.csv")[1:]] == ["0", "1", "3", "4"]


@pytest.mark.parametrize("content", [None, b"", b"step,a\r\n", b"step,a\r\n3,3\r\n"],
                         ids=["missing", "empty", "header-only", "late-start"])
def test_a_missing_or_empty_log_says_which_steps_are_gone(tmp_path, content):
    out = tmp_path / "out"
    out.mkdir()
    if content is not None:
        (out / "log.csv").write_bytes(content)
    with pytest.warns(UserWarning) as caught:
        LogWrapper(out_dir=out, resume_step=5).close()
    first_kept = 3 if content and b"3,3" in content else 5
    missing = f"steps 0 to {first_kept - 1} are missing"
    assert len(caught) == 1 + (first_kept < 5) and missing in str(caught[0].message), [str(w.message) for w in caught]


def test_log_for_run_writes_the_config_and_layer_kinds_and_nothing_with_eval_only(tmp_path):
    from nanogns.runlog import log_for_run
    config = dict(out_dir=str(tmp_path / "out"), eval_only=False, wandb_log=False, wandb_project="owt",
                  wandb_run_name="gpt2")
    for resume_step, lr in ((None, 0.1), (1, 0.2)):  # a resumed run's rows follow the kept ones
        log = log_for_run(config, resume_step, {"lm_head.weight": "linear"})
        log.log({"lr": lr})
        log.step()
        log.close()
    with open(tmp_path / "out" / "config.json") as f:
        assert json.load(f) == {**config, WRITER_KEY: WRITER}
    with open(tmp_path / "out" / "layer_kinds.json") as f:
        assert json.load(f) == {"lm_head.weight": "linear"}
    assert read_csv(tmp_path / "out" / "log.csv") == [["step", "lr"], ["0", "0.1"], ["1", "0.2"]]
    log = log_for_run(dict(config, out_dir=str(tmp_path / "eval"), eval_only=True), 1, {"lm_head.weight": "linear"})
    log.close()
    assert not os.path.exists(tmp_path / "eval")


def test_a_fresh_run_sets_an_earlier_runs_files_aside_and_keeps_what_is_not_a_runs(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    for name, text in (("log.csv", "step,x\n0,1\n"), ("ckpt.pt", "weights"), ("config.json", "{}"),
                       ("layer_kinds.json", "{}"), ("grad_accum_schedule.txt", "0 1\n"), ("notes.txt", "mine")):
        (out / name).write_text(text)
    lock = tracker_module.lock_out_dir(str(out), set_aside=True)
    try:
        folders = [p for p in out.iterdir() if p.name.startswith("previous-run-")]
        assert len(folders) == 1
        assert sorted(p.name for p in folders[0].iterdir()) == ["ckpt.pt", "config.json", "layer_kinds.json", "log.csv"]
        assert (folders[0] / "log.csv").read_text() == "step,x\n0,1\n" and (folders[0] / "ckpt.pt").read_text() == "weights"
        # the user's schedule and other files stay where they were
        assert sorted(p.name for p in out.iterdir() if p.is_file()) == ["grad_accum_schedule.txt", "notes.txt", "train.lock"]
        note = capsys.readouterr().out
        assert f"moved into {folders[0]}/" in note and "--init_from=resume" in note
    finally:
        tracker_module.release_out_dir(lock)


def test_setting_aside_twice_in_one_second_keeps_both_and_an_empty_out_dir_moves_nothing(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    assert tracker_module.set_aside_previous_run(str(out)) is None
    (out / "config.json").write_text("{}")  # no log and no checkpoint: not a run
    assert tracker_module.set_aside_previous_run(str(out)) is None
    folders = []
    for rows in ("first", "second"):
        (out / "log.csv").write_text(rows)
        os.utime(out / "log.csv", (1e9, 1e9))  # the same time: the same stamp
        folders.append(tracker_module.set_aside_previous_run(str(out)))
    assert folders[0] != folders[1] and folders[1].endswith("-2")
    assert [open(os.path.join(f, "log.csv")).read() for f in folders] == ["first", "second"]


def test_a_resumed_run_leaves_its_files_in_place(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "log.csv").write_text("step,x\n0,1\n")
    lock = tracker_module.lock_out_dir(str(out))
    tracker_module.release_out_dir(lock)
    assert (out / "log.csv").exists() and not [p for p in out.iterdir() if p.name.startswith("previous-run-")]


def test_an_out_dir_that_is_a_link_to_nothing_or_under_a_file_is_said_to_be_so(tmp_path):
    os.symlink(tmp_path / "gone", tmp_path / "link")  # makedirs says only "File exists"
    with pytest.raises(tracker_module.OutDirInUse) as e:
        tracker_module.lock_out_dir(str(tmp_path / "link"))
    assert str(e.value) == (f"{tmp_path / 'link'} cannot be made: {tmp_path / 'link'} is a symbolic link to "
                            f"'{tmp_path / 'gone'}', which does not exist")
    (tmp_path / "file").write_text("")
    with pytest.raises(tracker_module.OutDirInUse, match=re.escape(f"{tmp_path / 'file'} is not a directory")):
        tracker_module.lock_out_dir(str(tmp_path / "file" / "run"))
    assert not (tmp_path / "gone").exists()


@contextlib.contextmanager
def unwritable(folder):
    """folder made unwritable for this process and its children: its mode (r-x) for a user, and for root,
    whom modes do not stop, also the immutable attribute (chattr +i), where the file system has one;
    where it has none, a test run as root is skipped, saying so."""
    os.chmod(folder, 0o555)
    immutable = False
    try:
        if os.geteuid() == 0:
            made = shutil.which("chattr") and subprocess.run(["chattr", "+i", str(folder)], capture_output=True, text=True)
            if not made or made.returncode:
                pytest.skip(f"run as root, whom modes do not stop, and {folder} cannot be made immutable "
                            f"({made.stderr.strip() if made else 'no chattr'})")
            immutable = True
        yield
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(folder)], check=True)
        os.chmod(folder, 0o755)


@pytest.mark.parametrize("holds", ["an earlier run", "the lock of an earlier run", "nothing, out_dir to be made"])
def test_an_out_dir_that_cannot_be_written_is_said_to_be_so(tmp_path, holds):
    """A read-only out_dir was 'in use', or held 'an earlier run that could not be moved aside' (resume
    it, said the message, which failed again), or with its lock file writable, taken, to fail later."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "log.csv").write_text("step,x\n0,1\n")
    if holds == "the lock of an earlier run":  # left by the run, writable: the folder is not
        (out / "train.lock").write_text("")
    target = out / "run" if holds.startswith("nothing") else out
    before = sorted(os.listdir(out))
    with unwritable(out):
        with pytest.raises(tracker_module.OutDirNotWritable) as e:
            tracker_module.lock_out_dir(str(target), set_aside=holds == "an earlier run")
    assert str(e.value) == f"{target} cannot be written (permission denied): make it writable, or use another out_dir"
    assert isinstance(e.value, tracker_module.OutDirInUse) and isinstance(e.value, PermissionError)
    assert sorted(os.listdir(out)) == before


def test_an_out_dir_on_a_read_only_file_system_is_said_to_be_so(tmp_path, monkeypatch):
    """What a read-only mount answers, which stops root too (access() false, statvfs's ST_RDONLY)."""
    class ReadOnly:
        f_flag = os.ST_RDONLY
    monkeypatch.setattr(tracker_module.os, "access", lambda path, mode: False)
    monkeypatch.setattr(tracker_module.os, "statvfs", lambda path: ReadOnly())
    with pytest.raises(tracker_module.OutDirNotWritable) as e:
        tracker_module.lock_out_dir(str(tmp_path))
    assert str(e.value) == f"{tmp_path} cannot be written (a read-only file system): make it writable, or use another out_dir"


class DiskFullOnFlush:
    """An open file whose flush fails as on a full disk."""

    def __init__(self, f):
        self.f = f

    def __getattr__(self, name):
        return getattr(self.f, name)

    def flush(self):
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_when_the_lock_names_its_holder_is_one_line_and_leaves_the_lock_free(tmp_path, monkeypatch):
    import builtins
    out = tmp_path / "out"
    opened = []

    def open_on_a_full_disk(*args, **kwargs):
        opened.append(DiskFullOnFlush(builtins.open(*args, **kwargs)))
        return opened[-1]
    monkeypatch.setattr(tracker_module, "open", open_on_a_full_disk, raising=False)  # the module's open()
    with pytest.raises(tracker_module.OutDirInUse) as e:
        tracker_module.lock_out_dir(str(out))
    assert str(e.value) == f"{out}: cannot write {out / 'train.lock'} (the disk is full)"
    assert opened[0].f.closed  # so the lock is released: the next run takes it
    monkeypatch.undo()
    tracker_module.release_out_dir(tracker_module.lock_out_dir(str(out)))


def test_a_lock_this_process_still_holds_is_said_to_be_its_own(tmp_path):
    """A second lock in the process holding the first (an interrupted run's meter, never closed) was
    refused as 'in use by another train.py (pid <this process>)'."""
    out = str(tmp_path / "out")
    for holder, way_out in (({}, "release its lock"), ({"holder": "GNSMeter"}, "close() that meter")):
        lock = tracker_module.lock_out_dir(out, **holder)
        try:
            with pytest.raises(tracker_module.OutDirInUse) as e:
                tracker_module.lock_out_dir(out, **holder)
        finally:
            tracker_module.release_out_dir(lock)
        message = str(e.value)
        assert "another train.py" not in message and "\n" not in message
        assert f"held by an earlier {holder.get('holder', 'train.py')} in this process (pid {os.getpid()} on" in message
        assert way_out in message
    tracker_module.release_out_dir(tracker_module.lock_out_dir(out))  # released: free again


def test_a_lock_another_process_holds_names_what_holds_it(tmp_path):
    out = str(tmp_path / "out")
    code = "import sys, tracker; tracker.lock_out_dir(sys.argv[1], holder='GNSMeter'); print('held', flush=True); " \
           "sys.stdin.read()"
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    child = subprocess.Popen([sys.executable, "-c", code, out], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env=env)
    try:
        assert child.stdout.readline() == "held\n"
        with pytest.raises(tracker_module.OutDirInUse) as e:
            tracker_module.lock_out_dir(out)
    finally:
        child.stdin.close()
        child.wait(timeout=60)
    assert f"{out} is in use by another GNSMeter (pid {child.pid} on" in str(e.value)


@pytest.mark.parametrize("raw, why", [(b"1,1,2,\r3", "2 rows in one line (a stray carriage return?)"),
                                      (b"1,\xff\xfe", "not UTF-8 text (byte 2)"),
                                      (b"1,a\x00b", "binary (a NUL byte)")])
def test_a_row_that_is_not_one_csv_row_is_reported_for_what_it_is(tmp_path, raw, why):
    """A row broken by a stray carriage return was reported as 'not UTF-8 CSV text'."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "log.csv").write_bytes(b"step,a,b\n0,1,2\n" + raw + b"\n2,1,2\n")
    with pytest.warns(UserWarning) as caught:
        LogWrapper(out_dir=out, resume_step=3).close()
    assert f"{out / 'log.csv'} line 3: {why}; moved to log.csv.rejected" in [str(w.message) for w in caught]


def test_read_text_file_reads_only_a_regular_file_and_only_so_much(tmp_path):
    from nanogns.runlog import read_text_file
    (tmp_path / "prompt.txt").write_text("héllo", encoding="utf-8")
    assert read_text_file(str(tmp_path / "prompt.txt"), 6) == "héllo"
    with pytest.raises(ValueError, match="larger than 5 bytes"):
        read_text_file(str(tmp_path / "prompt.txt"), 5)
    os.mkfifo(tmp_path / "fifo")  # opened for reading, it would wait for a writer
    for path, kind in ((tmp_path / "fifo", "a FIFO"), ("/dev/zero", "a device"), (tmp_path, "a directory")):
        with pytest.raises(ValueError, match=f"^not a regular file but {kind}$"):
            read_text_file(str(path), 1 << 20)
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    with pytest.raises(ValueError, match=r"not UTF-8 text \(byte 3\)"):
        read_text_file(str(tmp_path / "latin1.txt"), 100)
    with pytest.raises(FileNotFoundError):
        read_text_file(str(tmp_path / "missing.txt"), 100)
