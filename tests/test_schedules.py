"""schedules.py: the learning rate in tokens and the editable batch-size schedule."""
import os
import time

import pytest

from schedules import GradAccumSchedule, lr_at, parse_schedule, steps_at


def test_lr_warms_up_linearly_then_decays_linearly_to_min_lr():
    kw = dict(learning_rate=1.0, min_lr=0.1, warmup_tokens=100, lr_decay_tokens=1100)
    assert lr_at(0, **kw) == 0.0
    assert lr_at(50, **kw) == pytest.approx(0.5)
    assert lr_at(100, **kw) == pytest.approx(1.0)
    assert lr_at(600, **kw) == pytest.approx(0.55)
    assert lr_at(1100, **kw) == pytest.approx(0.1)
    assert lr_at(10**9, **kw) == pytest.approx(0.1)
    assert lr_at(50, **kw, decay_lr=False) == 1.0


def test_parse_schedule_accepts_underscores_comments_and_sorts():
    pts = parse_schedule("# header\n1_000_000, 4\n\n0, 1  # start\n")
    assert pts == [(0.0, 1.0), (1e6, 4.0)]


@pytest.mark.parametrize("text", ["", "100\n", "a, b\n", "0, 0\n", "-5, 2\n", "1, 2, 3\n",
                                  "0, inf\n", "0, nan\n", "inf, 2\n", "nan, 2\n"])
def test_parse_schedule_rejects_malformed(text):
    with pytest.raises(ValueError):
        parse_schedule(text)


def test_steps_interpolate_round_up_and_divide_across_ranks():
    pts = [(0, 1), (1000, 9)]
    assert steps_at(pts, -5) == 1
    assert steps_at(pts, 0) == 1
    assert steps_at(pts, 500) == 5
    assert steps_at(pts, 501) == 6  # 5.008 rounds up
    assert steps_at(pts, 5000) == 9
    assert steps_at(pts, 500, world_size=2) == 3  # 5 steps over 2 ranks: 3 each
    assert steps_at([(0, 2), (10, 2), (20, 6)], 15) == 4


def test_file_is_written_reread_on_edit_and_bad_edit_keeps_last_good(tmp_path):
    path = str(tmp_path / "grad_accum_schedule.txt")
    warnings = []
    sched = GradAccumSchedule(path, [(0, 1), (1000, 9)], log=warnings.append)
    assert os.path.exists(path) and "1_000, 9" in open(path).read()
    assert sched.steps_at(500) == 5
    time.sleep(0.01)
    with open(path, "w") as f:
        f.write("0, 2\n1_000, 2\n")
    assert sched.steps_at(500) == 2
    with open(path, "w") as f:
        f.write("0, 2\nthis is not a schedule\n")
    assert sched.steps_at(500) == 2  # the last good one
    assert sched.steps_at(600) == 2
    bad = [w for w in warnings if w.startswith("warning")]
    assert len(bad) == 1 and "line 2" in bad[0]  # one warning per bad edit, not per step
    # a run started on a broken file refuses it; an existing good file is kept (a resumed
    # run keeps the user's edits, not the defaults)
    with pytest.raises(ValueError):
        GradAccumSchedule(path, [(0, 7)], log=warnings.append)
    with open(path, "w") as f:
        f.write("0, 3\n")
    assert GradAccumSchedule(path, [(0, 7)], log=warnings.append).points == [(0.0, 3.0)]


def test_lr_at_the_boundaries():
    assert lr_at(0, 1.0, 0.1, 0, 100) == 1.0      # no warmup: full rate at once (no division by zero)
    assert lr_at(100, 1.0, 0.1, 100, 100) == 0.1  # warmup ends where decay does: min_lr there


def test_parse_schedule_skips_whitespace_only_lines():
    assert parse_schedule("0, 1\n   \n\t\n1000, 4\n") == [(0.0, 1.0), (1000.0, 4.0)]


def test_an_edit_is_seen_by_its_size_or_its_time(tmp_path):
    # a file system with coarse timestamps may keep the mtime across an edit; an edit of the
    # same length changes only the mtime: either one must trigger a re-read
    path = str(tmp_path / "s.txt")
    with open(path, "w") as f:
        f.write("0, 2\n")
    T = 1_700_000_000_000_000_000
    os.utime(path, ns=(T, T))
    sched = GradAccumSchedule(path, log=lambda m: None)
    with open(path, "w") as f:
        f.write("0, 3\n")  # same size, later mtime
    os.utime(path, ns=(T + 10**9, T + 10**9))
    assert sched.steps_at(0) == 3
    with open(path, "w") as f:
        f.write("0, 30\n")  # other size, mtime put back
    os.utime(path, ns=(T + 10**9, T + 10**9))
    assert sched.steps_at(0) == 30


def test_schedule_file_gone_or_unreadable_keeps_the_last_good_and_warns_once(tmp_path):
    path = str(tmp_path / "s.txt")
    messages = []
    sched = GradAccumSchedule(path, [(0, 2)], log=messages.append)
    os.remove(path)
    assert sched.steps_at(0) == sched.steps_at(10) == 2
    assert len([m for m in messages if "cannot read" in m]) == 1
    with open(path, "w") as f:
        f.write("0, 5\n")
    assert sched.steps_at(0) == 5
    os.remove(path)
    os.mkdir(path)  # there, but not a file
    del messages[:]
    assert sched.steps_at(0) == sched.steps_at(10) == 5
    assert len([m for m in messages if m.startswith("warning")]) == 1
