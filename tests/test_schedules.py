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


@pytest.mark.parametrize("text", ["", "100\n", "a, b\n", "0, 0\n", "-5, 2\n", "1, 2, 3\n"])
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
