"""nanogns/schedules.py: the learning rate in tokens and the editable batch-size schedule."""
import contextlib
import math
import os
import signal
import stat
import time

import pytest

import nanogns.schedules as schedules
from nanogns.schedules import (MAX_SCHEDULE_BYTES, GradAccumSchedule, format_schedule, lr_at, max_accumulation_steps,
                       parse_schedule, read_schedule_file, steps_at)


@contextlib.contextmanager
def fails_after(seconds):
    """A call that blocks (open() of a FIFO waits for a writer) fails the test instead of hanging it:
    the alarm's exception interrupts the blocked system call."""
    def expire(signum, frame):
        raise TimeoutError(f"blocked for more than {seconds} s")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def warnings_in(messages):
    found = [m for m in messages if m.startswith("warning")]
    for m in found:
        assert "\n" not in m and len(m) < 400, m  # one line of bounded length, whatever the file
    return found


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
    sched = GradAccumSchedule(path, [(0, 1), (1000, 9)], max_steps=100, log=warnings.append)
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
        GradAccumSchedule(path, [(0, 7)], max_steps=100, log=warnings.append)
    with open(path, "w") as f:
        f.write("0, 3\n")
    assert GradAccumSchedule(path, [(0, 7)], max_steps=100, log=warnings.append).points == [(0.0, 3.0)]


def test_lr_cosine_decay_is_nanogpts():
    kw = dict(learning_rate=1.0, min_lr=0.1, warmup_tokens=100, lr_decay_tokens=1100, shape='cosine')
    assert lr_at(100, **kw) == pytest.approx(1.0) and lr_at(1100, **kw) == pytest.approx(0.1)
    assert lr_at(600, **kw) == pytest.approx(0.55)  # halfway: the same as the linear decay
    ratio = 0.25  # a quarter of the way: nanoGPT's min_lr + 0.5 (1 + cos(pi ratio)) (lr - min_lr)
    assert lr_at(100 + 1000 * ratio, **kw) == pytest.approx(0.1 + 0.5 * (1 + math.cos(math.pi * ratio)) * 0.9)
    assert lr_at(50, **kw) == pytest.approx(0.5)  # the warmup is the same


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
    sched = GradAccumSchedule(path, max_steps=100, log=lambda m: None)
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
    sched = GradAccumSchedule(path, [(0, 2)], max_steps=100, log=messages.append)
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


def test_max_accumulation_steps_reach_max_tokens_in_one_step_and_no_further():
    # 4 x 16 = 64 tokens a micro-step: 16 reach 1000 tokens, 15 do not
    assert max_accumulation_steps(1000, 4, 16) == 16
    # two ranks: 128 tokens a micro-step on both; 9 each reach 1100, so 18 global (17 rounds up to 9 too)
    assert max_accumulation_steps(1100, 4, 16, world_size=2) == 18
    assert steps_at([(0, 18)], 0, world_size=2) * 128 >= 1100 > (steps_at([(0, 18)], 0, world_size=2) - 1) * 128
    assert max_accumulation_steps(0, 4, 16) == 1  # always at least one
    # float32 example counters: no more than 2**24 examples a step, however large max_tokens
    assert max_accumulation_steps(10**15, 4, 16) == 2**24 // 4
    assert max_accumulation_steps(10**15, 3, 16, world_size=2) == 2 * (2**24 // 6)


def test_parse_schedule_refuses_steps_over_the_bound_naming_line_and_bound():
    assert parse_schedule("0, 1\n1000, 16\n", max_steps=16) == [(0.0, 1.0), (1000.0, 16.0)]
    with pytest.raises(ValueError, match=r"line 2: 17 accumulation steps is over the bound of 16"):
        parse_schedule("0, 1\n1000, 17\n", max_steps=16)


def test_live_edit_past_the_bound_keeps_the_last_good_schedule(tmp_path):
    # `0, 1e12` used to start 10**12 micro-steps, fixed for the step: the run never logged again
    path = str(tmp_path / "s.txt")
    messages = []
    sched = GradAccumSchedule(path, [(0, 1), (1000, 16)], max_steps=16, log=messages.append)
    assert "at most 16" in open(path).read()  # the bound is in the file the user edits
    with open(path, "w") as f:
        f.write("0, 1e12\n")
    assert sched.steps_at(0) == 1 and sched.steps_at(1000) == 16
    bad = warnings_in(messages)
    assert len(bad) == 1 and "line 1" in bad[0] and "bound of 16" in bad[0] and "1e+12" in bad[0]


def test_starting_schedule_over_the_bound_is_refused_and_not_written(tmp_path):
    path = str(tmp_path / "s.txt")
    with pytest.raises(ValueError, match="over the bound of 16"):
        GradAccumSchedule(path, [(0, 1), (1000, 17)], max_steps=16)
    assert not os.path.exists(path)
    # an existing file (a resumed run with a smaller max_tokens) is checked too
    with open(path, "w") as f:
        f.write("0, 17\n")
    with pytest.raises(ValueError, match="over the bound of 16"):
        GradAccumSchedule(path, [(0, 1)], max_steps=16)


def test_format_schedule_reads_back_exactly():
    points = [(0.0, 1.0), (1000.5, 2.5), (10.0**12 + 1, 1234567.0)]  # {:g} wrote 1234567 as 1.23457e+06
    assert parse_schedule(format_schedule(points)) == points
    assert format_schedule([(15360, 4)]) == "15_360, 4\n"


def test_a_fifo_is_refused_without_blocking(tmp_path, monkeypatch):
    path = str(tmp_path / "s.txt")
    messages = []
    sched = GradAccumSchedule(path, [(0, 3)], max_steps=100, log=messages.append)
    os.remove(path)
    os.mkfifo(path)
    real_open, opened = os.open, []
    monkeypatch.setattr(schedules.os, "open", lambda p, *a, **k: opened.append(p) or real_open(p, *a, **k))
    with fails_after(5):
        assert sched.steps_at(0) == sched.steps_at(10) == 3
        with pytest.raises(ValueError, match="not a regular file"):
            GradAccumSchedule(path, [(0, 3)], max_steps=100)  # a run does not start on one either
    bad = warnings_in(messages)
    assert len(bad) == 1 and "not a regular file but a FIFO" in bad[0]
    assert path not in opened  # refused from its stat, never opened
    os.remove(path)
    os.mkdir(path)  # another kind of not-a-file is another warning
    assert sched.steps_at(0) == 3
    assert len(warnings_in(messages)) == 2 and "not a regular file but a directory" in messages[-1]


def test_a_fifo_put_in_place_after_the_stat_is_refused_from_the_open_descriptor(tmp_path, monkeypatch):
    fifo, regular = str(tmp_path / "fifo"), str(tmp_path / "regular")
    os.mkfifo(fifo)
    with open(regular, "w") as f:
        f.write("0, 1\n")
    real_stat = os.stat
    # the path was a regular file when stat looked, a FIFO when it was opened
    monkeypatch.setattr(schedules.os, "stat", lambda p, *a, **k: real_stat(regular if p == fifo else p, *a, **k))
    with fails_after(5), pytest.raises(ValueError, match="not a regular file"):
        read_schedule_file(fifo)


def test_directory_and_device_are_refused(tmp_path):
    with pytest.raises(ValueError, match="not a regular file"):
        read_schedule_file(str(tmp_path))
    link = str(tmp_path / "zero")
    os.symlink("/dev/zero", link)  # endless if read
    with fails_after(5), pytest.raises(ValueError, match="not a regular file"):
        read_schedule_file(link)
    with pytest.raises(ValueError, match="not a regular file"):
        GradAccumSchedule(str(tmp_path), max_steps=100)


def test_a_big_file_is_refused_unread_with_a_short_warning(tmp_path, monkeypatch):
    path = str(tmp_path / "s.txt")
    messages = []
    sched = GradAccumSchedule(path, [(0, 3)], max_steps=100, log=messages.append)
    with open(path, "w") as f:
        f.write("0, 1\n" + "x" * 4_000_000 + "\n")  # a line of 4 MB: the warning used to quote it whole
    real_read, read = os.read, []
    monkeypatch.setattr(schedules.os, "read", lambda fd, n: read.append(n) or real_read(fd, n))
    assert sched.steps_at(0) == sched.steps_at(10) == 3
    assert read == []  # refused from its size
    with open(path, "a") as f:
        f.write("still growing\n")
    assert sched.steps_at(0) == 3
    bad = warnings_in(messages)
    assert len(bad) == 1 and f"larger than {MAX_SCHEDULE_BYTES:,} bytes" in bad[0]  # once, while it grows


def test_a_bad_line_is_quoted_short_in_a_file_under_the_size_cap(tmp_path):
    path = str(tmp_path / "s.txt")
    messages = []
    sched = GradAccumSchedule(path, [(0, 3)], max_steps=100, log=messages.append)
    with open(path, "w") as f:
        f.write("0, 1\n" + "x" * 60_000 + "\n")
    assert sched.steps_at(0) == 3
    bad = warnings_in(messages)
    assert len(bad) == 1 and "line 2" in bad[0] and "x" * 80 + "'..." in bad[0]


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc")
def test_reading_stops_past_the_cap_whatever_stat_said(monkeypatch):
    # /proc files are regular with st_size 0: the read itself must stop at the cap
    assert stat.S_ISREG(os.stat("/proc/self/maps").st_mode) and os.stat("/proc/self/maps").st_size == 0
    real_read, read = os.read, []
    monkeypatch.setattr(schedules.os, "read", lambda fd, n: read.append(n) or real_read(fd, n))
    with pytest.raises(ValueError, match="larger than 100 bytes"):
        read_schedule_file("/proc/self/maps", max_bytes=100)
    assert sum(read) <= 101


def test_a_file_that_is_not_utf8_is_refused_in_one_line(tmp_path):
    path = str(tmp_path / "s.txt")
    with open(path, "wb") as f:
        f.write(b"0, 1\n\xff\xfe\n")
    with pytest.raises(ValueError, match="not UTF-8 text"):
        read_schedule_file(path)


def test_an_edit_made_during_a_step_is_seen_at_the_next_step_even_with_size_and_mtime_unchanged(tmp_path):
    path = str(tmp_path / "s.txt")
    sched = GradAccumSchedule(path, [(0, 2)], max_steps=100, log=lambda m: None)
    st = os.stat(path)
    assert sched.steps_at(0) == 2  # a step starts
    with open(path, "r+") as f:  # edited while it runs: same length, and the mtime put back
        text = f.read()
        f.seek(0)
        f.write(text.replace("0, 2", "0, 5"))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_size == st.st_size and os.stat(path).st_mtime_ns == st.st_mtime_ns
    assert sched.steps_at(0) == 5  # the next step


def test_reload_message_is_one_short_line_for_a_long_schedule(tmp_path):
    path = str(tmp_path / "s.txt")
    messages = []
    sched = GradAccumSchedule(path, [(0, 2)], max_steps=100, log=messages.append)
    with open(path, "w") as f:
        f.write(format_schedule([(t, 1 + t % 7) for t in range(5000)]))
    assert sched.steps_at(4999) == 1 + 4999 % 7
    assert len(messages) == 1 and len(messages[0]) < 200 and "5000 points" in messages[0]
    with open(path, "w") as f:
        f.write("0, 4\n")
    assert sched.steps_at(0) == 4 and messages[-1].endswith(": 0: 4 (1 point)")


def test_a_bad_edit_warns_once_and_another_bad_edit_warns_again(tmp_path):
    path = str(tmp_path / "s.txt")
    messages = []
    sched = GradAccumSchedule(path, [(0, 2)], max_steps=100, log=messages.append)
    for text in ["0, x\n", "0, y\n"]:
        with open(path, "w") as f:
            f.write(text)
        assert sched.steps_at(0) == sched.steps_at(0) == 2
    assert len(warnings_in(messages)) == 2


# ---------------------------------------------------------------------------------------------
# The batch-size controller (--bs_controller=gns), by hand-computed cases

@pytest.mark.parametrize("target, world, expected", [
    (1.0, 1, 2),     # below the floor (2): the floor
    (8.0, 1, 2),     # 8 examples = 2 micro-batches of 4
    (8.5, 1, 3),     # rounded up to whole micro-batches
    (13.0, 1, 4),
    (13.0, 2, 4),    # 4 micro-batches, already a multiple of 2 ranks
    (17.0, 2, 6),    # 5 micro-batches, up to 6 for 2 ranks
    (1e9, 1, 10),    # above the ceiling (10): the ceiling
    (float('nan'), 1, 2),  # no target: the floor
])
def test_target_accumulation_rounds_up_and_clamps(target, world, expected):
    assert schedules.target_accumulation(target, batch_size=4, floor=2, ceiling=10, world_size=world) == expected


@pytest.mark.parametrize("target, expected", [(1, 1), (4, 1), (5, 2), (9, 4), (17, 8), (33, 16), (1000, 16),
                                              (float("nan"), 1)])
def test_target_accumulation_in_powers_of_two_rounds_up_to_one(target, expected):
    """OLMo-core's batch changes by whole factors: the count a power of two, clamped."""
    assert schedules.target_accumulation(target, batch_size=4, floor=1, ceiling=16, powers_of_two=True) == expected


def controller(**changes):
    settings = dict(fraction=1.0, batch_size=4, floor=1, ceiling=8, warmup_steps=3, update_tokens=0,
                    allow_decrease=False)
    settings.update(changes)
    return schedules.GNSBatchController(lambda: (float('nan'), 0), **settings)


def test_the_controller_stays_at_the_floor_while_the_ema_warms_up_then_follows():
    c = controller()
    assert [c.decide(30.0, steps, 0) for steps in (0, 1, 2)] == [1, 1, 1]
    assert math.isnan(c.target)
    assert c.decide(30.0, 3, 100) == 8  # ceil(30 / 4) = 8, the ceiling
    assert c.target == 30.0 and c.changed_at == 100


def test_the_fraction_scales_the_target():
    c = controller(fraction=0.5)
    assert c.decide(20.0, 5, 0) == 3  # 0.5 * 20 = 10 examples: ceil(10 / 4) = 3
    assert c.target == 10.0


def test_no_gns_keeps_the_count():
    c = controller()
    assert c.decide(float('nan'), 100, 0) == 1  # nothing measured: the floor
    assert c.decide(12.0, 100, 0) == 3
    assert c.decide(float('inf'), 100, 10) == 3 and c.decide(float('nan'), 100, 20) == 3


def test_changes_are_rate_limited_in_tokens():
    c = controller(update_tokens=1000)
    assert c.decide(8.0, 5, 0) == 2      # the first change comes at once
    assert c.decide(16.0, 5, 999) == 2   # too soon after the one at 0
    assert c.decide(16.0, 5, 1000) == 4  # 1000 tokens on
    assert c.changed_at == 1000
    assert c.decide(24.0, 5, 1500) == 4 and c.decide(24.0, 5, 2000) == 6


def test_the_batch_never_shrinks_unless_allowed():
    c = controller()
    assert c.decide(24.0, 5, 0) == 6
    assert c.decide(4.0, 5, 10) == 6 and c.changed_at == 0
    c = controller(allow_decrease=True)
    assert c.decide(24.0, 5, 0) == 6
    assert c.decide(4.0, 5, 10) == 1 and c.changed_at == 10


def test_steps_at_reads_its_source_and_splits_over_ranks():
    readings = iter([(6.0, 0), (30.0, 5), (30.0, 6)])
    c = schedules.GNSBatchController(lambda: next(readings), fraction=1.0, batch_size=4, floor=2, ceiling=8,
                                     warmup_steps=3, update_tokens=0, world_size=2)
    assert [c.steps_at(t, world_size=2) for t in (0, 10, 20)] == [1, 4, 4]  # global 2, 8, 8
    assert c.row() == {'bs_controller/target_examples': 30.0, 'bs_controller/accumulation_steps': 8}
    assert c.status() == "bs target 30, accum 8"


def test_the_controller_state_round_trips():
    c = controller(update_tokens=500)
    c.decide(20.0, 5, 300)
    resumed = controller(update_tokens=500)
    resumed.load_state_dict(c.state_dict())
    assert (resumed.accumulation, resumed.changed_at, resumed.target) == (5, 300, 20.0)
    assert resumed.decide(28.0, 6, 700) == 5  # the rate limit goes on from the change at 300
    assert resumed.decide(28.0, 6, 800) == 7
