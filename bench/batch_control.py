"""
Does a batch size that follows the measured GNS train faster? The shakespeare_char model trained
to the same token budget, with the same learning-rate schedule in tokens, five ways:

    fixed-ceiling   a fixed batch of the controller's ceiling (gradient_accumulation_steps)
    fixed-floor     a fixed batch of its floor (bs_min_accum)
    schedule        the linear --bs_schedule from the floor at 0 tokens to the ceiling at the end
    gns-total       --bs_controller=gns on the total GNS (every parameter measured)
    gns-layernorm   --bs_controller=gns on the LayerNorm-only GNS (only the LayerNorms measured)

each with several seeds. Reported per setting (mean and spread over seeds): the tokens and the
optimizer steps at which the validation loss first reaches the target (linearly interpolated
between evaluations), and the final validation loss. The target is --target_loss, or by default
the highest final validation loss of all runs, which every run reaches. A validation loss is the
mean over eval_iters=20 batches (5,120 tokens), whose standard deviation is about 0.05 (docs/controller.md).

    python data/shakespeare_char/prepare.py
    python bench/batch_control.py                       # 10 runs, 174 s on a 2-core CPU machine (*)
    python bench/batch_control.py --seeds 1 --max_tokens 200000 --settings fixed-floor,gns-total

(*) 14-22 s a run, one torch thread each, measured with other jobs on the machine (its load average
was about 2 during the runs).

The runs repeat bit for bit on the same machine: each gets --threads torch threads (default 1,
set through OMP_NUM_THREADS whatever the environment says), and the Linears' norm methods by shape
at every call (per_example_mode='shapes'), whatever routes table the machine has. Another thread count changes the logs in their last bits only (in a 40,000-token check, a
loss by at most 5e-7 after 157 steps; the table the same). One thread, because two threads a run
on two busy cores took 3 to 13 times as long.

Runs go to OUT_DIR/<setting>-s<seed> (a finished run is not run again: delete it to redo it),
with a line as each starts (which run of how many) and ends (its time); the table goes to
OUT_DIR/results.csv and OUT_DIR/results.md; the terminal shows the figures (loss vs tokens, loss
vs steps, batch size vs tokens with the GNS the controller read). The notebook draws the same
figures from OUT_DIR. Any other --key=value goes to train.py for every run.
"""
import argparse
import math
import os
import sys

import numpy as np
import pandas as pd

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.runs import add_run_options, check_train_flags, train_once  # noqa: E402
from nanogns.logread import ToolParser, figure, load_log  # noqa: E402
from nanogns.runlog import atomic_write  # noqa: E402

BATCH, BLOCK, FLOOR, CEILING = 4, 64, 1, 8  # micro-batch examples and tokens; accumulation floor and ceiling
TRAIN_FLAGS = dict(
    device='cpu', dtype='float32', compile=False, device_name='M1_eflops', dataset='shakespeare_char',
    n_layer=4, n_head=4, n_embd=128, block_size=BLOCK, batch_size=BATCH, dropout=0.0, bias=False,
    learning_rate=1e-3, min_lr=1e-4, beta2=0.99, warmup_tokens=20_000, eval_iters=20, log_interval=100,
    always_save_checkpoint=False, bs_min_accum=FLOOR, bs_warmup_steps=50,
    # the Linears' norm method by the shape rule at every call, not a routes table's ('auto'): ghost
    # and materialise differ in the last bits
    per_example_mode='shapes',
)
MEASURE_ALL = dict(linearclass='gns', embeddingclass='gns', lnclass='shim')
SETTINGS = {
    # eval_interval in iterations: about every 20k tokens at the setting's batch (at most)
    'fixed-ceiling': dict(gradient_accumulation_steps=CEILING, eval_interval=10, **MEASURE_ALL),
    'fixed-floor': dict(gradient_accumulation_steps=FLOOR, eval_interval=80, **MEASURE_ALL),
    'schedule': dict(gradient_accumulation_steps=CEILING, bs_schedule=True, eval_interval=20, **MEASURE_ALL),
    'gns-total': dict(gradient_accumulation_steps=CEILING, bs_controller='gns', eval_interval=20, **MEASURE_ALL),
    'gns-layernorm': dict(gradient_accumulation_steps=CEILING, bs_controller='gns', eval_interval=20, lnclass='shim'),
}


def run_dir(out_dir, setting, seed):
    return os.path.join(out_dir, f"{setting}-s{seed}")


def finished(where, max_tokens):
    """Whether the run in `where` already reaches max_tokens (train_once then keeps it)."""
    return os.path.exists(os.path.join(where, 'log.csv')) and load_log(where)[0]['tokens_processed'].max() >= max_tokens


def train(out_dir, setting, seed, max_tokens, extra, label=None):
    """One run of train.py (skipped when its log already reaches max_tokens); returns its log. It
    says which run it is (label) when it starts, and train_once how long it took."""
    where = run_dir(out_dir, setting, seed)
    label = label or f"{setting} seed {seed}"
    flags = {**TRAIN_FLAGS, **SETTINGS[setting], 'seed': seed, 'out_dir': where, 'max_tokens': max_tokens,
             'lr_decay_tokens': max_tokens}
    if setting == 'schedule':
        flags['bs_schedule_points'] = [(0, FLOOR), (max_tokens, CEILING)]
    print(f"{label}: " + ("finished earlier, kept" if finished(where, max_tokens) else f"training into {where}"),
          flush=True)
    return load_log(train_once(where, flags, extra, label))[0]


def evaluations(log):
    """The rows with a validation loss: tokens seen by the evaluated model, optimizer steps, loss."""
    rows = log.dropna(subset=['val/loss'])
    steps = np.searchsorted(log['tokens_processed'].to_numpy(), rows['eval_tokens'].to_numpy(), side='right')
    return rows['eval_tokens'].to_numpy(float), steps.astype(float), rows['val/loss'].to_numpy(float)


def first_reaching(xs, losses, target):
    """x where the loss first reaches target, linear between the two evaluations around it; NaN if never."""
    below = np.nonzero(losses <= target)[0]
    if not len(below):
        return math.nan
    i = below[0]
    if i == 0:
        return float(xs[0])
    return float(xs[i - 1] + (losses[i - 1] - target) / (losses[i - 1] - losses[i]) * (xs[i] - xs[i - 1]))


def summarise(logs, target):
    """One row per run, then per setting: mean and spread (min-max over seeds)."""
    runs = []
    for (setting, seed), log in logs.items():
        tokens, steps, losses = evaluations(log)
        runs.append(dict(setting=setting, seed=seed, tokens_to_target=first_reaching(tokens, losses, target),
                         steps_to_target=first_reaching(steps, losses, target), final_val_loss=losses[-1],
                         steps=len(log), tokens=int(log['tokens_processed'].iloc[-1])))
    runs = pd.DataFrame(runs)
    table = runs.groupby('setting', sort=False).agg(['mean', 'min', 'max', 'count'])  # count: seeds that reached it
    return runs, table


def markdown(table, target, seeds):
    lines = [f"target validation loss {target:.4f}; mean over the {seeds} seed(s) that reach it [min-max]", "",
             "| setting | tokens to target | steps to target | final val loss |", "|---|---|---|---|"]
    for setting, row in table.iterrows():
        cells = []
        for column, fmt in (('tokens_to_target', ',.0f'), ('steps_to_target', ',.0f'), ('final_val_loss', '.4f')):
            mean, low, high, count = (row[(column, k)] for k in ('mean', 'min', 'max', 'count'))
            some = f" ({int(count)} of {seeds} seeds)" if count < seeds else ""
            cells.append("not reached" if math.isnan(mean) else f"{mean:{fmt}} [{low:{fmt}}-{high:{fmt}}]{some}")
        lines.append(f"| {setting} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def gns_read(log):
    """The GNS the controller read (the target over the fraction, 1.0 here), else the run's total GNS."""
    if 'bs_controller/target_examples' in log:
        return log['bs_controller/target_examples'].to_numpy(float)
    return np.full(len(log), np.nan)


def main(argv=None):
    parser = ToolParser(prog='bench/batch_control.py', description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_options(parser, 'out-batch-control', 'setting', 100_000, "the token budget of every run (default: 100000)")
    parser.add_argument('--target_loss', type=float, default=None,
                        help="validation loss to reach (default: the highest final validation loss of all runs)")
    parser.add_argument('--settings', default=','.join(SETTINGS), help=f"comma-separated, from {', '.join(SETTINGS)}")
    parser.add_argument('--threads', type=int, default=1,
                        help="torch threads of each run, set through OMP_NUM_THREADS (default: 1; the count changes "
                             "the last bits of the results)")
    args, extra = parser.parse_known_args(argv)
    settings = args.settings.split(',')
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown or args.seeds < 1 or args.threads < 1 or args.max_tokens < CEILING * BATCH * BLOCK:
        parser.error(f"unknown setting(s) {', '.join(unknown)}" if unknown else
                     "--seeds and --threads must be >= 1 and --max_tokens at least one step at the ceiling")
    check_train_flags(parser, extra)
    os.makedirs(args.out_dir, exist_ok=True)
    os.environ['OMP_NUM_THREADS'] = str(args.threads)  # the runs' torch threads (they inherit the environment)
    todo = [(s, seed) for s in settings for seed in range(1, args.seeds + 1)]
    print(f"{len(todo)} runs of {args.max_tokens:,} tokens into {args.out_dir}, {args.threads} torch thread(s) each",
          flush=True)
    logs = {(s, seed): train(args.out_dir, s, seed, args.max_tokens, extra, f"[{i}/{len(todo)}] {s} seed {seed}")
            for i, (s, seed) in enumerate(todo, 1)}
    target = args.target_loss
    if target is None:
        target = max(evaluations(log)[2][-1] for log in logs.values())
    runs, table = summarise(logs, target)
    atomic_write(os.path.join(args.out_dir, 'results.csv'), lambda f: runs.to_csv(f, index=False), mode='w')
    text = markdown(table, target, args.seeds)
    atomic_write(os.path.join(args.out_dir, 'results.md'), lambda f: f.write(text + "\n"), mode='w')
    print(text)
    first = {s: logs[(s, 1)] for s in settings}
    for x_label, x_of in (('tokens', lambda t, s: t), ('optimizer steps', lambda t, s: s)):
        series = [(x_of(*evaluations(log)[:2]), evaluations(log)[2], s) for s, log in first.items()]
        print(f"\nvalidation loss vs {x_label} (seed 1)\n" + figure(series, x_label, 'val loss'))
    series = [(log['tokens_processed'].to_numpy(float),
               (log['gradient_accumulation_steps'] * BATCH).to_numpy(float), f"{s} batch") for s, log in first.items()]
    series += [(log['tokens_processed'].to_numpy(float), gns_read(log), f"{s} GNS read")
               for s, log in first.items() if s.startswith('gns-')]
    print("\nbatch size (examples) vs tokens, and the GNS the controllers read (seed 1)\n"
          + figure(series, 'tokens', 'examples'))
    return 0


if __name__ == '__main__':
    sys.exit(main())
