"""
How train.py stops early on a signal without losing work: SIGINT (Ctrl-C) and SIGTERM (a
cluster's preemption) end the run after the step under way, every DDP rank after the same step,
with a checkpoint and the command that resumes it; a second signal stops at once.
"""
import atexit
import os
import shlex
import signal
import sys
import threading
import time

# Under torchrun a preempted rank gets the signal twice: from the scheduler, and forwarded by the
# launcher when it gets its own. A repeat within this many seconds of the first is that copy, not
# a second signal.
FORWARDED_REPEAT_S = 3.0


def interrupt_in_one_line():
    """Until StopSignals replaces it: Ctrl-C while the process starts (the imports, the checks, the
    model's construction, which hold no state to save) ends it with one line, not a traceback from
    whatever module it was in."""
    def on_interrupt(signum, frame):
        print(f"\nstopped by {signal.Signals(signum).name} while starting, before the first step", file=sys.stderr)
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGINT, on_interrupt)


class StopSignals:
    """
    Installs the handlers; `received` is the first signal's number (0: none yet). `announce`: this
    process (the DDP master) says what happens. `checkpoint_held()` says what ckpt.pt holds, for the
    message of a second signal. `distributed`: a torchrun rank, where a repeat within
    FORWARDED_REPEAT_S of the first signal is ignored.

    Python runs a handler between bytecodes only, so a second signal arriving while the main thread
    is inside one long operator call would wait for it to return. The signals are also written to
    a pipe (signal.set_wakeup_fd, from C) that a thread reads; torch releases the GIL inside its
    operators, so that thread can stop the process at once.
    """

    def __init__(self, announce, checkpoint_held, distributed=False):
        self.received = 0
        self.announce = announce
        self.checkpoint_held = checkpoint_held
        self.window = FORWARDED_REPEAT_S if distributed else 0.0
        self._announced = False
        self._lock = threading.RLock()  # the handler (main thread) and the watcher may both see the first signal
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(read_end,), daemon=True, name="stop-signals").start()

    def _first(self, signum):
        with self._lock:
            if not self.received:
                self.received = signum
            if self.announce and not self._announced:
                self._announced = True
                print(f"\n{signal.Signals(signum).name}: stopping after this step (send it again to stop now)",
                      file=sys.stderr, flush=True)

    def _on_signal(self, signum, frame):
        self._first(signum)  # at once, when the main thread runs Python; a second one is the watcher's

    def _watch(self, read_end):
        """Every signal delivered, in order, from the wakeup pipe: the first one is kept for after the
        step, a repeat within the window ignored, a later one exits now."""
        first_at = None
        while True:
            for signum in os.read(read_end, 64):
                now = time.monotonic()
                if first_at is None:
                    first_at = now
                    self._first(signum)
                elif now - first_at >= self.window:
                    if self.announce:  # the master alone: it writes ckpt.pt, so it knows what it holds
                        print(f"\n{signal.Signals(signum).name} again: stopping now; ckpt.pt keeps "
                              f"{self.checkpoint_held()}", file=sys.stderr, flush=True)
                    os._exit(128 + signum)

    def agreed(self, distributed, device):
        """The signal any rank has received (it may reach the ranks at different steps), the same
        on every rank after this call; 0 if none. A signal that arrives during the all-reduce stays
        received, for the next call."""
        if not distributed:
            return self.received
        import torch
        flag = torch.tensor([self.received], device=device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        agreed = int(flag.item())
        with self._lock:
            if agreed and not self.received:  # a peer's signal: this rank stops for it
                self.received = agreed
        return agreed


def checkpoint_after(iter_num):
    """What a ckpt.pt saved after iter_num steps holds, named as log.csv and the status lines name steps:
    the state after its last step, iter_num - 1."""
    return f"the state after iter {iter_num - 1}" if iter_num > 0 else "the state before iter 0"


def stopped_message(signum, last_iter, tokens, checkpoint_held, distributed):
    """The one line a run stopped by a signal ends with: the last step it ran (and logged), and how to
    go on (with --init_from=resume, or from the start when no checkpoint was written)."""
    resumable = not checkpoint_held.startswith('nothing')
    argv = [a for a in sys.argv if not (resumable and a.startswith('--init_from='))]
    command = "the torchrun command that started it" if distributed else "python " + ' '.join(map(shlex.quote, argv))
    go_on = (f"{command}{', with' if distributed else ''} --init_from=resume" if resumable
             else f"nothing to resume from, start again: {command}")
    return (f"stopped by {signal.Signals(signum).name} after iter {last_iter} ({tokens:,} tokens); "
            f"ckpt.pt holds {checkpoint_held}; to go on: {go_on}")


def diverged_message(last_iter, diverged_iter, nonfinite_steps, limit, checkpoint_held):
    """The one line a run that diverged ends with: `limit` (--max_nonfinite_steps) skipped steps in a
    row by diverged_iter, read by the loop at last_iter (the steps between ran, and are logged)."""
    if last_iter == diverged_iter:
        what = f"the last {nonfinite_steps} steps had a non-finite loss or gradient and were skipped"
    else:
        what = (f"by iter {diverged_iter}, {limit} steps in a row had a non-finite loss or gradient and were skipped "
                f"(the steps up to iter {last_iter} ran before the device was read, and are logged)")
    return (f"stopping after iter {last_iter}: {what}; the run diverged: try a lower --learning_rate; "
            f"ckpt.pt keeps {checkpoint_held}")


def stop_early(message, code, logger=None, distributed=False):
    """End the run before its last step with `message`, one line on stderr, said by the process that
    holds the `logger` (the master). log.csv stays complete up to the last finished step: the values
    of the step under way are dropped, and its row is redone on resume."""
    if logger is not None:
        print(message, file=sys.stderr)
        logger.log_dict.clear()
        logger.close()
    leave(code, distributed)


def log_step_or_stop(logger, distributed=False, norm_methods=None, row=None):
    """logger.log(row), given, then logger.step() and, given, the measured Linears' norm_methods
    (logger.record_norm_methods); a failed write (a full disk) ends the run with code 1: log.csv
    keeps its complete rows, from which the run resumes."""
    from nanogns.runlog import LogWriteError  # here: this module loads before the slow imports
    if row is not None:
        logger.log(row)
    try:
        logger.step()
        if norm_methods is not None:
            logger.record_norm_methods(norm_methods)
    except LogWriteError as e:
        stop_early(f"error: {e}", 1, logger, distributed)


def leave(code, distributed):
    """Exit with `code`. A torchrun rank skips the interpreter's finalization (everything is written
    and closed before this is called): gloo's worker threads can still be dropping tensors whose
    release takes the GIL, and before Python 3.14 a thread that takes the GIL while the interpreter
    finalizes is ended by pthread_exit, whose unwinding through C++ noexcept code aborts the whole
    process ("terminate called without an active exception", SIGABRT) after a run that did its work."""
    if distributed:
        atexit._run_exitfuncs()  # what the interpreter would run first: out_dir's lock is emptied
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
