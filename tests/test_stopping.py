"""stopping.py: the first signal is remembered for after the step, the second one exits at once."""
import os
import signal
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from stopping import StopSignals, stopped_message  # noqa: E402


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
            "from stopping import StopSignals\n"
            "s = StopSignals(announce=True, checkpoint_held=lambda: 'iter 7')\n"
            "os.kill(os.getpid(), signal.SIGINT); os.kill(os.getpid(), signal.SIGINT)\n"
            "time.sleep(5); print('not reached')\n" % REPO)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 128 + signal.SIGINT, p
    assert "not reached" not in p.stdout
    assert p.stderr.strip().splitlines()[-1] == "SIGINT again: stopping now; ckpt.pt keeps iter 7"


def test_the_stopped_message_gives_the_resume_command(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py", "config/x.py", "--init_from=scratch", "--out_dir=a b"])
    line = stopped_message(signal.SIGTERM, 12, 34567, "iter 12", distributed=False)
    assert line == ("stopped by SIGTERM after iter 12 (34,567 tokens); ckpt.pt holds iter 12; "
                    "to go on: python train.py config/x.py '--out_dir=a b' --init_from=resume")
    assert "torchrun command" in stopped_message(signal.SIGINT, 1, 1, "nothing", distributed=True)


# a gloo callback that takes the GIL back while the main thread has already begun to exit: on
# Python < 3.14 the interpreter's finalization ends that thread mid-C++, which aborts the process.
# With sys.exit in place of leave() this script died of SIGABRT in 46 of 50 runs on a loaded machine.
GLOO_CALLBACK_AT_EXIT = """
import os, sys, threading, time, torch, torch.distributed as dist
sys.path.insert(0, {repo!r})
from stopping import leave
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
