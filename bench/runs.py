"""
What the bench scripts share: the options of those that train many runs (batch_control.py,
norm_vs_total.py, critical_batch.py) and one train.py run per setting and seed, in its own folder,
skipped when its log already reaches the token budget (delete the folder to redo it); and, for
every script that starts a child process, dies_with_parent.
"""
import ctypes
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from nanogns.logread import load_log  # noqa: E402


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def dies_with_parent():
    """A preexec_fn for subprocess: the child is killed (SIGKILL) the moment this process ends, however
    it ends, a kill -9 included, so that no train.py goes on writing beside the run that replaces it.
    Linux only (prctl); elsewhere None, and a child outlives a parent killed outright."""
    if not sys.platform.startswith('linux'):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it
    parent, how = os.getpid(), ctypes.c_ulong(signal.SIGKILL)

    def in_child():
        prctl(PR_SET_PDEATHSIG, how)
        if os.getppid() != parent:  # the parent ended between the fork and the prctl: no signal will come
            os.kill(os.getpid(), signal.SIGKILL)
    return in_child


def add_run_options(parser, out_dir, seeds_per, max_tokens, max_tokens_help):
    """--out_dir, --seeds and --max_tokens, with these defaults."""
    parser.add_argument('--out_dir', default=out_dir, help=f"where the runs go (default: {out_dir})")
    parser.add_argument('--seeds', type=int, default=2, help=f"seeds per {seeds_per} (default: 2)")
    parser.add_argument('--max_tokens', type=int, default=max_tokens, help=max_tokens_help)


def check_train_flags(parser, extra):
    """The arguments left over go to train.py: each must be --key=value."""
    bad = [a for a in extra if not (a.startswith('--') and '=' in a)]
    if bad:
        parser.error(f"expected --key=value for train.py, got {' '.join(bad)}")


def train_once(where, flags, extra, label, config_file=None):
    """`python train.py [config_file] --k=v...` into `where` (flags['out_dir']), unless its log.csv
    already reaches flags['max_tokens']; a failed run ends the script, pointing to its output."""
    log = os.path.join(where, 'log.csv')
    if os.path.exists(log) and load_log(where)[0]['tokens_processed'].max() >= flags['max_tokens']:
        return where
    command = [sys.executable, os.path.join(ROOT, 'train.py'), *([config_file] if config_file else []),
               *(f"--{k}={v!r}" for k, v in flags.items()), *extra]
    os.makedirs(where, exist_ok=True)
    started = time.time()
    with open(os.path.join(where, 'train.out'), 'w') as out:
        code = subprocess.run(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                              preexec_fn=dies_with_parent()).returncode
    if code != 0:
        sys.exit(f"error: {label} failed (exit {code}); see {where}/train.out")
    print(f"  {label}: {time.time() - started:.0f} s", flush=True)
    return where
