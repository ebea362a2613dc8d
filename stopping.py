"""
How train.py stops early on a signal without losing work: SIGINT (Ctrl-C) and SIGTERM (a
cluster's preemption) end the run after the step under way, every DDP rank after the same step,
with a checkpoint and the command that resumes it; a second signal stops at once.
"""
import os
import shlex
import signal
import sys


class StopSignals:
    """Installs the handlers; `received` is the first signal's number (0: none yet).
    `checkpoint_held()` says what ckpt.pt holds, for the message of a second signal."""

    def __init__(self, announce, checkpoint_held):
        self.received = 0
        self.announce = announce  # the DDP master alone says it, once
        self.checkpoint_held = checkpoint_held
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame):
        name = signal.Signals(signum).name
        if self.received:
            print(f"\n{name} again: stopping now; ckpt.pt keeps {self.checkpoint_held()}", file=sys.stderr)
            os._exit(128 + signum)
        self.received = signum
        if self.announce:
            print(f"\n{name}: stopping after this step (send it again to stop now)", file=sys.stderr)

    def agreed(self, distributed, device):
        """The signal any rank has received (it may reach the ranks at different steps), the same
        on every rank after this call; 0 if none."""
        if distributed:
            import torch
            flag = torch.tensor([self.received], device=device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            self.received = int(flag.item())
        return self.received


def stopped_message(signum, iter_num, tokens, checkpoint_held, distributed):
    """The one line a run stopped by a signal ends with: where it stopped and how to go on."""
    command = ' '.join(shlex.quote(a) for a in sys.argv if not a.startswith('--init_from='))
    resume = ("the torchrun command that started it, with --init_from=resume" if distributed
              else f"python {command} --init_from=resume")
    return (f"stopped by {signal.Signals(signum).name} after iter {iter_num} ({tokens:,} tokens); "
            f"ckpt.pt holds {checkpoint_held}; to go on: {resume}")


def stop_early(message, code, logger=None, distributed=False):
    """End the run before its last step with `message`, one line on stderr, said by the process that
    holds the `logger` (the master). log.csv stays complete up to the last finished step: the values
    of the step under way are dropped, and its row is redone on resume."""
    if logger is not None:
        print(message, file=sys.stderr)
        logger.log_dict.clear()
        logger.close()
    leave(code, distributed)


def leave(code, distributed):
    """Exit with `code`. A torchrun rank skips the interpreter's finalization (everything is written
    and closed before this is called): gloo's worker threads can still be dropping tensors whose
    release takes the GIL, and before Python 3.14 a thread that takes the GIL while the interpreter
    finalizes is ended by pthread_exit, whose unwinding through C++ noexcept code aborts the whole
    process ("terminate called without an active exception", SIGABRT) after a run that did its work."""
    if distributed:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
