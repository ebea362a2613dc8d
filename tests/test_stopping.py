"""nanogns/stopping.py: the first signal is remembered for after the step, the second one exits at once."""
import os
import signal
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from nanogns.stopping import StopSignals, checkpoint_after, diverged_message, log_step_or_stop, stopped_message  # noqa: E402


@pytest.fixture
def restore_handlers():
    saved = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGINT, saved[0])
    signal.signal(signal.SIGTERM, saved[1])


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_the_first_signal_is_kept_for_after_the_step(signum, restore_handlers, capsys):
    signals = StopSignals(announce=True, checkpoint_held=lambda: "iter 3")
    assert signals.received == 0 and signals.agreed(False, "cpu") == 0
    os.kill(os.getpid(), signum)
    assert signals.received == signum and signals.agreed(False, "cpu") == signum
    name = signal.Signals(signum).name
    assert capsys.readouterr().err.strip() == f"{name}: stopping after this step (send it again to stop now)"


def test_a_rank_that_does_not_announce_is_quiet(restore_handlers, capsys):
    signals = StopSignals(announce=False, checkpoint_held=lambda: "nothing")
    os.kill(os.getpid(), signal.SIGTERM)
    assert signals.received == signal.SIGTERM and capsys.readouterr().err == ""


def test_a_second_signal_exits_at_once_saying_what_ckpt_pt_keeps():
    code = ("import os, signal, sys, time; sys.path.insert(0, %r)\n"
            "from nanogns.stopping import StopSignals\n"
            "s = StopSignals(announce=True, checkpoint_held=lambda: 'iter 7')\n"
            "os.kill(os.getpid(), signal.SIGINT); os.kill(os.getpid(), signal.SIGINT)\n"
            "time.sleep(5); print('not reached')\n" % REPO)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 128 + signal.SIGINT, p
    assert "not reached" not in p.stdout
    assert p.stderr.strip().splitlines()[-1] == "SIGINT again: stopping now; ckpt.pt keeps iter 7"


def test_the_stopped_message_gives_the_resume_command(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py", "config/x.py", "--init_from=scratch", "--out_dir=a b"])
    line = stopped_message(signal.SIGTERM, 11, 34567, checkpoint_after(12), distributed=False)
    assert line == ("stopped by SIGTERM after iter 11 (34,567 tokens); ckpt.pt holds the state after iter 11; "
                    "to go on: python train.py config/x.py '--out_dir=a b' --init_from=resume")
    assert "torchrun command" in stopped_message(signal.SIGINT, 1, 1, "nothing", distributed=True)


def test_the_diverged_message_says_what_was_skipped_and_what_ckpt_pt_keeps():
    assert diverged_message(9, 9, 5, 5, "iter 4") == (
        "stopping after iter 9: the last 5 steps had a non-finite loss or gradient and were skipped; the run "
        "diverged: try a lower --learning_rate; ckpt.pt keeps iter 4")
    # read late (--log_interval): the step the limit was reached at, and the last one run and logged
    assert diverged_message(10, 2, 10, 2, "nothing (none was written)") == (
        "stopping after iter 10: by iter 2, 2 steps in a row had a non-finite loss or gradient and were skipped (the "
        "steps up to iter 10 ran before the device was read, and are logged); the run diverged: try a lower "
        "--learning_rate; ckpt.pt keeps nothing (none was written)")


def test_a_failed_log_write_stops_the_run_with_code_1_and_its_row_dropped(tmp_path, capsys):
    import errno
    from nanogns.runlog import LogWrapper, LogWriteError

    class FullDisk(LogWrapper):
        def step(self):
            raise LogWriteError(errno.ENOSPC, f"{self.path}: appending a row failed, the disk is full")
    log = LogWrapper(out_dir=tmp_path)
    log.log({'lr': 0.1})
    log_step_or_stop(log)
    log.close()
    assert (tmp_path / "log.csv").read_text() == "step,lr\n0,0.1\n"
    log = FullDisk(out_dir=tmp_path, resume_step=1)
    log.log({'lr': 0.2})
    with pytest.raises(SystemExit) as e:
        log_step_or_stop(log)
    assert e.value.code == 1 and log.log_dict == {} and (tmp_path / "log.csv").read_text() == "step,lr\n0,0.1\n"
    assert capsys.readouterr().err == f"error: {tmp_path / 'log.csv'}: appending a row failed, the disk is full\n"


# a gloo callback that takes the GIL back while the main thread has already begun to exit: on
# Python < 3.14 the interpreter's finalization ends that thread mid-C++, which aborts the process.
# With sys.exit in place of leave() this script died of SIGABRT in 46 of 50 runs on a loaded machine.
GLOO_CALLBACK_AT_EXIT = """
import os, sys, threading, time, torch, torch.distributed as dist
sys.path.insert(0, {repo!r})
from nanogns.stopping import leave
dist.init_process_group("gloo", init_method="file://" + {store!r}, rank=0, world_size=1)
running = threading.Event()
def busy(fut):  # on a gloo thread: keeps releasing the GIL and taking it back, for 3 s
    running.set()
    for _ in range(3000):
        time.sleep(0.001)
dist.all_reduce(torch.ones(10), async_op=True).get_future().then(busy)
running.wait(60)
print("written before leaving")
leave(3, distributed=True)
"""


def test_a_torchrun_rank_leaves_with_its_code_while_gloo_threads_still_run(tmp_path):
    code = GLOO_CALLBACK_AT_EXIT.format(repo=REPO, store=str(tmp_path / "store"))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 3 and p.stdout == "written before leaving\n", p


# a process that takes its first signal and then sits in one long torch call (many seconds)
IN_A_LONG_CALL = """
import os, sys, time, torch
sys.path.insert(0, {repo!r})
import nanogns.stopping as stopping
stopping.FORWARDED_REPEAT_S = {window}
s = stopping.StopSignals(announce={announce}, checkpoint_held=lambda: 'iter 7', distributed={distributed})
a = torch.randn(2000, 2000) / 60
print('ready', flush=True)
# about 120 products of 2000 x 2000 matrices in one call, tens of seconds on one thread (1000 x 1000
# took 2.5 s on a fast core: the call could end, and the process with it, before the last signal)
torch.linalg.matrix_power(a, 2 ** 62 - 1)
print('not reached', flush=True)
"""


def signal_in_a_long_call(delays, window=0.0, announce=True, distributed=False):
    """(exit code, stderr, seconds from the last signal to the exit) of IN_A_LONG_CALL sent SIGTERM
    after each of `delays` (seconds after it is ready, or after the signal before)."""
    import time
    code = IN_A_LONG_CALL.format(repo=REPO, window=window, announce=announce, distributed=distributed)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        assert p.stdout.readline() == "ready\n"
        for delay in delays:
            time.sleep(delay)
            p.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        _, stderr = p.communicate(timeout=120)
        return p.returncode, stderr, time.monotonic() - sent
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()


@pytest.mark.slow
def test_a_second_signal_stops_a_process_inside_a_long_operator_call():
    code, stderr, took = signal_in_a_long_call([0.2, 0.3])
    assert code == 128 + signal.SIGTERM and took < 3, (code, took, stderr)
    assert [line for line in stderr.splitlines() if line] == [
        "SIGTERM: stopping after this step (send it again to stop now)",
                                           "SIGTERM again: stopping now; ckpt.pt keeps iter 7"]


@pytest.mark.slow
def test_a_torchrun_ranks_repeat_within_the_window_is_the_forwarded_copy_and_a_quiet_rank_says_nothing():
    # the copy torchrun forwards 0.1 s after the scheduler's: still running 2 s later (killed by the test)
    code, stderr, took = signal_in_a_long_call([0.2, 0.1, 2.0], window=1.5, announce=False, distributed=True)
    assert code == 128 + signal.SIGTERM and took < 3, (code, took, stderr)
    assert stderr == ""  # not the master: it does not know what ckpt.pt holds (under FSDP it said an old iter)


def test_a_signal_during_the_agreement_is_kept_for_the_next_one(restore_handlers, monkeypatch, capsys):
    import torch
    import torch.distributed

    def all_reduce_as_the_signal_arrives(tensor, op=None):
        os.kill(os.getpid(), signal.SIGTERM)  # on this rank, after its flag was sent: the peers said 0

    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce_as_the_signal_arrives)
    signals = StopSignals(announce=False, checkpoint_held=lambda: "iter 1", distributed=True)
    assert signals.agreed(True, "cpu") == 0  # this step goes on everywhere ...
    assert signals.received == signal.SIGTERM  # ... and the next agreement stops every rank


# every rank's stop agreement takes 0.3 s longer, so that a signal sent at a random moment most
# often lands inside it (the race that lost signals)
SLOW_AGREEMENT = """
import sys, time
sys.path.insert(0, {repo!r})
import torch, torch.distributed
all_reduce = torch.distributed.all_reduce
def slow_all_reduce(tensor, *args, **kwargs):
    if tensor.dtype == torch.int64 and tensor.numel() == 1:  # stopping.StopSignals.agreed's flag
        time.sleep(0.3)
    return all_reduce(tensor, *args, **kwargs)
torch.distributed.all_reduce = slow_all_reduce
"""


@pytest.mark.slow
@pytest.mark.parametrize("to", ["launcher", "ranks", "both"])
def test_a_preempted_torchrun_run_stops_every_rank_after_the_same_step_with_its_checkpoint(tiny_dataset, tmp_path,
                                                                                         to):
    """SIGTERM to torchrun's launcher (which forwards it to the ranks), to every rank, or to both at
    once as a cluster's scheduler sends it, at a random moment (before the fix every one of these
    lost its signal or its checkpoint)."""
    import random
    import re
    import time
    import pandas as pd
    import torch
    from conftest import TINY
    from test_resume import end_all, ranks_of, rows_in, start
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_AGREEMENT.format(repo=REPO))
    flags = [*TINY, f"--dataset={tiny_dataset}", "--eval_interval=1000", "--backend=gloo",
             "--gradient_accumulation_steps=2", "--max_iters=100000"]
    out = tmp_path / "out"
    proc = start(flags, out, torchrun_procs=2, site=site)
    ranks = []
    try:
        deadline = time.monotonic() + 120
        while rows_in(out) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.05)
        time.sleep(random.uniform(0, 0.5))
        ranks = ranks_of(proc)
        assert len(ranks) == 2
        for pid in ({"launcher": [proc.pid], "ranks": ranks, "both": [*ranks, proc.pid]}[to]):
            os.kill(pid, signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        end_all(proc, ranks)
    stopped = re.findall(r"stopped by SIGTERM after iter (\d+) .*ckpt.pt holds the state after iter (\d+)", stderr)
    assert len(stopped) == 1 and stopped[0][0] == stopped[0][1], stderr[-3000:]
    assert "again: stopping now" not in stderr, stderr[-3000:]
    last = int(stopped[0][0])  # the last step run, logged and checkpointed
    assert torch.load(out / "ckpt.pt", weights_only=False)["iter_num"] == last + 1
    assert pd.read_csv(out / "log.csv").step.tolist() == list(range(last + 1))


# train.py's import of numpy waits 30 s, having said so: a Ctrl-C lands inside the imports
SLOW_IMPORT = """
import builtins, sys, time
real_import = builtins.__import__
def slow_import(name, *args, **kwargs):
    if name == "numpy" and "numpy" not in sys.modules and sys.argv[0].endswith("train.py"):
        print("importing", flush=True)
        time.sleep(30)
    return real_import(name, *args, **kwargs)
builtins.__import__ = slow_import
"""


def test_ctrl_c_during_the_imports_is_one_line(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_IMPORT)
    p = subprocess.Popen([sys.executable, os.path.join(REPO, "train.py"), "--device=cpu"], cwd=REPO, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(site)))
    try:
        assert p.stdout.readline() == "importing\n"
        p.send_signal(signal.SIGINT)
        _, stderr = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 128 + signal.SIGINT
    assert [line for line in stderr.splitlines() if line] == ["stopped by SIGINT while starting, before the first step"]


def test_a_stop_before_any_checkpoint_says_to_start_again(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py", "config/x.py", "--out_dir=o"])
    line = stopped_message(signal.SIGINT, 3, 300, "nothing (none was written)", distributed=False)
    assert line.endswith("ckpt.pt holds nothing (none was written); to go on: nothing to resume from, start again: "
                         "python train.py config/x.py --out_dir=o") and "--init_from=resume" not in line
    assert stopped_message(signal.SIGINT, 3, 300, "nothing (none was written)", distributed=True).endswith(
        "start again: the torchrun command that started it")
