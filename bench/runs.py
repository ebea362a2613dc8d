"""
What the bench scripts that train many runs share (batch_control.py, norm_vs_total.py): their
common options, and one train.py run per setting and seed, in its own folder, skipped when its
log already reaches the token budget (delete the folder to redo it).
"""
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from nanogns.logread import load_log  # noqa: E402


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
        code = subprocess.run(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT).returncode
    if code != 0:
        sys.exit(f"error: {label} failed (exit {code}); see {where}/train.out")
    print(f"  {label}: {time.time() - started:.0f} s", flush=True)
    return where
