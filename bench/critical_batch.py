"""
Does the gradient noise scale predict the critical batch size? This measures B_crit directly, as
McCandlish et al. (2018, App. D) and Merrill et al. (2025) do, and sets it beside what the base
run's log says at the same point: B_simple (the EMA GNS) of the whole model, of the
normalisation layers alone, and of the Adam-preconditioned normalisation layers.

1. A base run (train.py, every parameter measured, --gns_adam=True where train.py has it) keeps a
   checkpoint at each branch point: early, middle and late in training.
2. From each checkpoint, a branch per batch size B and learning rate (the same grid for every B;
   constant rate, the base run's AdamW state) trains until the loss on a fixed held-out set of
   evaluation batches has fallen by DELTA below its value at the branch point. S is the optimizer
   steps that took (evaluated every step up to 10, then every ~8%, the crossing interpolated
   linearly between two evaluations), E = B S the examples.
3. Per branch point, each B keeps its best learning rate (fewest steps) and the fit of
   S(B) = S_min + E_min / B (gnsmath.fit_critical_batch) gives B_crit = E_min / S_min.

    python data/shakespeare_char/prepare.py
    python bench/critical_batch.py --out_dir bench/results/critical_batch   # 2 families x 2 seeds
    python bench/critical_batch.py --quick --out_dir /tmp/cb --dataset=PATH    # the pipeline, ~1 minute
    python bench/critical_batch.py --report --out_dir bench/results/critical_batch  # the tables, from the CSVs

Writes OUT_DIR/branches.csv (family, seed, branch_tokens, batch_size, learning_rate, best, steps,
examples, reached: one row per branch), OUT_DIR/summary.csv (family, seed, branch_tokens, s_min,
e_min, b_crit, b_simple_total, b_simple_norm, b_simple_norm_adam: one row per branch point) and
OUT_DIR/gns_<family>-s<seed>.csv (each B_simple of the base run over its tokens, for the figure).
A finished branch is kept: run it again and it goes on where it stopped. Base runs and their
checkpoints go to --work_dir; a checkpoint that no longer matches the one a branch started from
(its fingerprint, OUT_DIR/checkpoints.csv) has its branches run again. Any other --key=value goes
to train.py for the base runs (e.g. --dataset=PATH). --report trains nothing: it fits the branches
as they stand, rewrites summary.csv, and prints the results as Markdown tables (the README's), each
ratio B_crit / B_simple with its spread over seeds.
"""
import argparse
import contextlib
import hashlib
import io
import math
import os
import shutil
import sys

import numpy as np
import pandas as pd
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.norm_vs_total import FAMILIES, gns_analysis  # noqa: E402
from bench.runs import check_train_flags, train_once  # noqa: E402
from checkpoint import config_from_checkpoint, load_weights, read_checkpoint  # noqa: E402
from configurator import check_dataset  # noqa: E402
from csv_tools import ToolParser, load_log  # noqa: E402
from gnsmath import PREFIXES, fit_critical_batch  # noqa: E402
from model import GPT  # noqa: E402
from tracker import atomic_write  # noqa: E402

CONFIG = os.path.join(ROOT, 'config', 'train_shakespeare_char_cpu.py')
BRANCH_COLUMNS = ['family', 'seed', 'branch_tokens', 'batch_size', 'learning_rate', 'best', 'steps', 'examples',
                  'reached']
SUMMARY_COLUMNS = ['family', 'seed', 'branch_tokens', 's_min', 'e_min', 'b_crit', 'b_simple_total', 'b_simple_norm',
                   'b_simple_norm_adam']
KEY = ['family', 'seed', 'branch_tokens', 'batch_size', 'learning_rate']
ADAM_PREFIX = PREFIXES['adam']
# the experiment: the CPU demo's model and schedule (2000 steps of 768 tokens), and --quick: a tiny one.
# The grid followed the rows: 3e-4 to 3e-3 first; 1e-4 added when 3e-4 was the best of the small batches;
# 3e-3 dropped after two whole branch points where it was never best and took 60% of the steps (its rows
# stay in branches.csv, never marked best); 3e-5 added when 1e-4 was the best of every batch up to 32 at
# the late point (the base run's own rate had decayed to 2.3e-4 there).
FULL = dict(points=(250, 750, 1500), batch_sizes=(4, 8, 16, 32, 64), learning_rates=(3e-5, 1e-4, 3e-4, 1e-3),
            delta=0.05, max_steps=2000, eval_batches=8, eval_batch_size=16, flags={})
QUICK = dict(points=(20, 40, 60), batch_sizes=(2, 4, 8, 16, 32), learning_rates=(3e-3, 1e-2, 3e-2),
             delta=0.2, max_steps=150, eval_batches=4, eval_batch_size=16,
             flags=dict(n_layer=1, n_head=2, n_embd=32, block_size=16, batch_size=4, eval_iters=2,
                        warmup_iters=10, lr_decay_iters=100, learning_rate=1e-2, min_lr=1e-3))


# -- 1. the base run ---------------------------------------------------------------------------

def base_run(work_dir, family, seed, setup, extra):
    """The base run in stages, one train.py run to each branch point (resumed from the last), each
    checkpoint kept as ckpt-<iter>.pt; returns (run folder, {iter: checkpoint path})."""
    where = os.path.join(work_dir, f"{family}-s{seed}")
    flags = {**FAMILIES[family], **setup['flags'], 'seed': seed, 'out_dir': where, 'always_save_checkpoint': True,
             'eval_interval': 10 ** 9, 'linearclass': 'gns', 'embeddingclass': 'gns', 'lnclass': 'shim',
             'gns_adam': True}
    given = {**flags, **dict(a[2:].split('=', 1) for a in extra)}  # the step's shape, as train.py will see it
    tokens_per_iter = math.prod(int(given.get(k, default)) for k, default in
                                (('batch_size', 12), ('block_size', 64), ('gradient_accumulation_steps', 1)))
    checkpoints = {}
    for point in setup['points']:
        saved = os.path.join(where, f"ckpt-{point}.pt")
        if not os.path.exists(saved):
            resume = {'init_from': 'resume'} if checkpoints else {}
            train_once(where, {**flags, **resume, 'max_tokens': point * tokens_per_iter}, extra,
                       f"{family} seed {seed} base run to step {point}", CONFIG)
            with open(os.path.join(where, 'ckpt.pt'), 'rb') as source:
                atomic_write(saved, lambda f: shutil.copyfileobj(source, f))
        checkpoints[point] = saved
    return where, checkpoints


def b_simple_at(run, alpha):
    """The base run's EMA GNS over its tokens (gns-analysis.py's): DataFrame with tokens,
    b_simple_total, b_simple_norm and b_simple_norm_adam (NaN where the log has no such estimator)."""
    df, path, _ = gns_analysis.read_log(run)
    kinds, norm = gns_analysis.read_kinds(path)
    results, info = gns_analysis.analyze(df, alpha, kinds=kinds, norm=norm)
    norm = info['norm_group']  # LayerNorm or RMSNorm, after the model
    adam = f"{ADAM_PREFIX}/total/gns"
    nan = np.full(len(results), np.nan)
    return pd.DataFrame(dict(tokens=results['tokens_processed'], b_simple_total=results['total/gns'],
                             b_simple_norm=results[f"{norm}/gns"] if f"{norm}/gns" in results else nan,
                             b_simple_norm_adam=results[adam] if adam in results else nan))


def fingerprint(path):
    """A short hash of a checkpoint's weights: which base run a branch started from."""
    state = torch.load(path, map_location='cpu', weights_only=False)['model']
    digest = hashlib.sha256()
    for name in sorted(state):
        digest.update(name.encode())
        digest.update(state[name].detach().float().numpy().tobytes())
    return digest.hexdigest()[:16]


# -- 2. the branches ---------------------------------------------------------------------------

class Batches:
    """Random windows of block_size + 1 tokens from a split, as train.py's get_batch takes them."""

    def __init__(self, data_dir, split, block_size):
        self.data = np.memmap(os.path.join(data_dir, f'{split}.bin'), dtype=np.uint16, mode='r')
        self.block_size = block_size

    def get(self, batch_size, generator):
        ix = torch.randint(len(self.data) - self.block_size, (batch_size,), generator=generator)
        rows = torch.stack([torch.from_numpy(self.data[i:i + self.block_size + 1].astype(np.int64)) for i in ix])
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def load_branch(path, learning_rate):
    """(model, optimizer, run config) of a checkpoint: plain torch layers (a branch measures nothing),
    the base run's AdamW state at a constant `learning_rate`."""
    checkpoint = read_checkpoint(path)
    config = checkpoint['config']
    with contextlib.redirect_stdout(io.StringIO()):  # the model's and the optimizer's notes
        model = GPT(config_from_checkpoint(checkpoint['model_args']))
        load_weights(model, checkpoint['model'])
        optimizer = model.configure_optimizers(config['weight_decay'], learning_rate,
                                               (config['beta1'], config['beta2']), 'cpu')
    optimizer.load_state_dict(checkpoint['optimizer'])
    for group in optimizer.param_groups:
        group['lr'] = learning_rate
    return model, optimizer, config


@torch.no_grad()
def held_out_loss(model, eval_set):
    model.eval()
    loss = sum(model(x, y)[1].item() for x, y in eval_set) / len(eval_set)
    model.train()
    return loss


def eval_steps(max_steps):
    """The steps after which a branch is evaluated: every step up to 10, then every ~8% (the
    crossing is interpolated between two evaluations, so S is known much finer than that)."""
    steps, s = [], 1
    while s <= max_steps:
        steps.append(s)
        s = s + 1 if s < 10 else s + max(1, round(0.08 * s))
    return set(steps)


def run_branch(path, batch_size, learning_rate, eval_set, start_loss, delta, max_steps, seed):
    """Optimizer steps until the held-out loss is DELTA below start_loss, or None within max_steps: the
    step where the line between the last evaluation above the target and the first one at or below it
    crosses the target."""
    torch.manual_seed(seed)
    model, optimizer, config = load_branch(path, learning_rate)
    data = Batches(check_dataset(config['dataset'], ROOT), 'train', config['block_size'])
    generator = torch.Generator().manual_seed(seed)  # the same batches for every learning rate of this B
    target, evaluate_at = start_loss - delta, eval_steps(max_steps)
    last_step, last_loss = 0, start_loss
    for step in range(1, max_steps + 1):
        x, y = data.get(batch_size, generator)
        _, loss = model(x, y)
        loss.backward()
        if config['grad_clip']:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config['grad_clip'])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if not math.isfinite(loss.item()):
            return None  # diverged: this rate is too high for this batch size
        if step in evaluate_at:
            now = held_out_loss(model, eval_set)
            if now <= target:
                return last_step + (step - last_step) * (last_loss - target) / (last_loss - now)
            last_step, last_loss = step, now
    return None


def fixed_eval_set(path, setup):
    """The held-out batches every branch of a run is judged on: fixed windows of the val split."""
    config = read_checkpoint(path)['config']
    data = Batches(check_dataset(config['dataset'], ROOT), 'val', config['block_size'])
    generator = torch.Generator().manual_seed(20251125)
    return [data.get(setup['eval_batch_size'], generator) for _ in range(setup['eval_batches'])]


# -- 3. the fits --------------------------------------------------------------------------------

def in_grid(branches, learning_rates):
    return np.isclose(branches['learning_rate'].astype(float).to_numpy()[:, None], list(learning_rates)).any(axis=1)


def mark_best(branches, learning_rates):
    """best: for each (family, seed, branch point, B), the learning rate of the grid that reached the target
    in the fewest steps (the lower rate on a tie); none where no rate reached it. Rows of a rate no longer
    in the grid are kept but never best: every batch size is judged on the same grid."""
    branches = branches.copy()
    branches['best'] = False
    reached = branches[branches['reached'].astype(bool) & in_grid(branches, learning_rates)]
    for _, group in reached.groupby(['family', 'seed', 'branch_tokens', 'batch_size']):
        best = group.sort_values(['steps', 'learning_rate']).index[0]
        branches.loc[best, 'best'] = True
    return branches


def at_edge(best, branches):
    """Whether a best branch's rate is the lowest or the highest tried at its point and batch size (any
    rate tried, in the grid or not): a rate beyond it was not tried, and might take fewer steps."""
    tried = branches[(branches['family'] == best.family) & (branches['seed'] == best.seed) &
                     (branches['branch_tokens'] == best.branch_tokens) & (branches['batch_size'] == best.batch_size)]
    rates = tried['learning_rate'].astype(float)
    return bool(np.isclose(best.learning_rate, rates.min()) or np.isclose(best.learning_rate, rates.max()))


def summarise(branches, series, setup):
    """summary.csv's rows: per branch point the fit of its best branches, and the base run's B_simple
    there. A point whose grid is not finished gets no fit (NaN): a batch size's best rate, and so its
    steps, may still change. A best rate at the grid's edge is named: a rate beyond it might do better."""
    rows = []
    rates = sorted(setup['learning_rates'])
    grid_size = len(setup['batch_sizes']) * len(rates)
    for (family, seed, tokens), group in branches.groupby(['family', 'seed', 'branch_tokens'], sort=False):
        group = group[in_grid(group, rates)]
        best = group[group['best']]
        s_min = e_min = math.nan
        edge = best[[at_edge(row, branches) for row in best.itertuples()]]
        if len(edge):
            print(f"  {family} seed {seed} at {tokens:,} tokens: the best rate is the grid's edge for "
                  f"B = {', '.join(str(int(b)) for b in edge['batch_size'])} (their steps may be too many)")
        if len(group) < grid_size:
            print(f"  {family} seed {seed} at {tokens:,} tokens: {len(group)} of {grid_size} branches run, no fit yet")
        else:
            try:
                s_min, e_min = fit_critical_batch(best['batch_size'].tolist(), best['steps'].tolist())
            except ValueError as e:
                print(f"  {family} seed {seed} at {tokens:,} tokens: no fit ({e})")
            if s_min > 0 and e_min / s_min > max(setup['batch_sizes']):
                print(f"  {family} seed {seed} at {tokens:,} tokens: B_crit {e_min / s_min:.3g} lies beyond the "
                      f"largest batch tried ({max(setup['batch_sizes'])}): an extrapolation, a lower bound only, "
                      f"left out of the ratios")
        gns = series[(family, seed)]
        at = gns[gns['tokens'] <= tokens].iloc[-1] if (gns['tokens'] <= tokens).any() else None
        rows.append(dict(family=family, seed=seed, branch_tokens=tokens, s_min=s_min, e_min=e_min,
                         b_crit=e_min / s_min if s_min > 0 else math.nan,
                         **{k: (at[k] if at is not None else math.nan)
                            for k in ('b_simple_total', 'b_simple_norm', 'b_simple_norm_adam')}))
    return pd.DataFrame(rows, columns=SUMMARY_COLUMNS)


RATIOS = (('b_simple_total', 'total'), ('b_simple_norm', 'norm'), ('b_simple_norm_adam', 'norm, Adam'))


def report(branches, summary, setup):
    """Markdown: one row per branch point and seed, then per family and branch point the ratios
    B_crit / B_simple as the mean over seeds (min-max), then per estimate how far and how steadily
    it follows B_crit over all fitted points: the geometric mean ratio and the spread of log ratio.
    A fitted B_crit beyond the largest batch size tried is marked and left out of the ratios."""
    grid = len(setup['batch_sizes']) * len(setup['learning_rates'])
    largest = max(setup['batch_sizes'])
    g = lambda v: '–' if pd.isna(v) else f"{v:.3g}"  # noqa: E731
    b = lambda v: g(v) if pd.isna(v) or v > 0 else "< 0"  # noqa: E731  (a B_simple whose |G|^2 EMA is negative)
    lines = ["| family | seed | branch point (tokens) | branches done | S_min | E_min | B_crit | B_simple total | "
             "B_simple norm | B_simple norm, Adam |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in summary.itertuples():
        here = branches[(branches['family'] == row.family) & (branches['seed'] == row.seed) &
                        (branches['branch_tokens'] == row.branch_tokens)]
        lines.append(f"| {row.family} | {row.seed} | {row.branch_tokens:,} | {in_grid(here, setup['learning_rates']).sum()} "
                     f"of {grid} | {g(row.s_min)} | {g(row.e_min)} | {g(row.b_crit)}"
                     f"{f' (> {largest}: extrapolated)' if row.b_crit > largest else ''} | {b(row.b_simple_total)} | "
                     f"{b(row.b_simple_norm)} | {b(row.b_simple_norm_adam)} |")
    # a B_crit beyond the largest batch tried is the fit's extrapolation: only "more than that" is
    # measured, so it stands in the first table, marked, and in no ratio
    fitted = summary[summary['b_crit'].notna() & (summary['b_crit'] <= largest)].copy()
    for column, _ in RATIOS:  # a B_simple not above 0 (its EMA of |G|^2 still negative) is no estimate: no ratio
        fitted[f"ratio_{column}"] = (fitted['b_crit'] / fitted[column]).where(fitted[column] > 0)
    spread = lambda v: f"{v.mean():.2f} ({v.min():.2f}–{v.max():.2f})" if len(v) > 1 else f"{v.mean():.2f}"  # noqa: E731
    lines += ["", "| family | branch point (tokens) | seeds | B_crit | " +
              " | ".join(f"B_crit / B_simple {name}" for _, name in RATIOS) + " |", "|---|---|---|---|---|---|---|"]
    for (family, tokens), group in fitted.groupby(['family', 'branch_tokens']):
        lines.append(f"| {family} | {tokens:,} | {len(group)} | {spread(group['b_crit'])} | " +
                     " | ".join(spread(group[f"ratio_{c}"].dropna()) for c, _ in RATIOS) + " |")
    lines += ["", "| estimate | fitted points | B_crit / B_simple, geometric mean | spread of log ratio (sd) |",
              "|---|---|---|---|"]
    for column, name in RATIOS:
        logs = np.log(fitted[f"ratio_{column}"].dropna())
        lines.append(f"| B_simple {name} | {len(logs)} | {g(np.exp(logs.mean())) if len(logs) else '–'} | "
                     f"{g(logs.std()) if len(logs) > 1 else '–'} |")
    return "\n".join(lines)


def write_csv(path, frame):
    atomic_write(path, lambda f: frame.to_csv(f, index=False), mode='w')


def read_csv(path, columns):
    return pd.read_csv(path) if os.path.exists(path) else pd.DataFrame(columns=columns)


def main(argv=None):
    parser = ToolParser(prog='bench/critical_batch.py', description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--out_dir', default='out-critical-batch',
                        help="where branches.csv, summary.csv and the GNS series go (default: out-critical-batch)")
    parser.add_argument('--work_dir', help="where the base runs and their checkpoints go (default: OUT_DIR/base)")
    parser.add_argument('--seeds', type=int, help="seeds per model family (default: 2, --quick 1)")
    parser.add_argument('--families', help=f"model families (default: {','.join(FAMILIES)}, --quick {next(iter(FAMILIES))})")
    parser.add_argument('--quick', action='store_true',
                        help="a tiny model, a short base run, few steps, one family and seed: ~1 minute")
    parser.add_argument('--delta', type=float, help="the loss drop each branch trains for (default: 0.05, --quick 0.2)")
    parser.add_argument('--report', action='store_true',
                        help="train nothing: fit OUT_DIR's branches as they stand, rewrite summary.csv and print "
                             "the results as Markdown tables (the README's)")
    parser.add_argument('--alpha', type=float, default=gns_analysis.EMA_BETA,
                        help=f"the EMA's alpha, as gns-analysis.py's (default: {gns_analysis.EMA_BETA})")
    args, extra = parser.parse_known_args(argv)
    check_train_flags(parser, extra)
    setup = dict(QUICK if args.quick else FULL)
    setup['delta'] = args.delta if args.delta is not None else setup['delta']
    args.seeds = args.seeds if args.seeds is not None else 1 if args.quick else 2
    families = (args.families or (next(iter(FAMILIES)) if args.quick else ','.join(FAMILIES))).split(',')
    families = [f for f in families if f]
    if args.seeds < 1 or not setup['delta'] > 0 or not 0 <= args.alpha < 1:
        parser.error("--seeds must be >= 1, --delta > 0 and --alpha in [0, 1)")
    if not families or set(families) - set(FAMILIES):
        parser.error(f"--families must name some of {', '.join(FAMILIES)}")
    if args.report:  # the fits again from branches.csv as it stands (a running experiment adds rows to it)
        branches_csv = os.path.join(args.out_dir, 'branches.csv')
        if not os.path.exists(branches_csv):
            parser.error(f"--report: {args.out_dir} has no branches.csv (run the experiment first)")
        branches = mark_best(pd.read_csv(branches_csv), setup['learning_rates'])
        series = {}
        for family, seed in branches[['family', 'seed']].drop_duplicates().itertuples(index=False):
            path = os.path.join(args.out_dir, f"gns_{family}-s{seed}.csv")
            series[(family, seed)] = pd.read_csv(path) if os.path.exists(path) else pd.DataFrame(columns=['tokens'])
        with contextlib.redirect_stdout(sys.stderr):  # the fits' notes
            summary = summarise(branches, series, setup)
        write_csv(os.path.join(args.out_dir, 'summary.csv'), summary)  # the notebook's figure reads it
        print(report(branches, summary, setup))
        return 0
    work_dir = args.work_dir or os.path.join(args.out_dir, 'base')
    os.makedirs(args.out_dir, exist_ok=True)
    from tqdm import tqdm

    branches_csv, summary_csv = (os.path.join(args.out_dir, n) for n in ('branches.csv', 'summary.csv'))
    prints_csv = os.path.join(args.out_dir, 'checkpoints.csv')
    branches = read_csv(branches_csv, BRANCH_COLUMNS)
    prints = read_csv(prints_csv, ['family', 'seed', 'branch_tokens', 'fingerprint'])
    runs = [(f, s) for s in range(1, args.seeds + 1) for f in families]  # every family before a second seed
    grid = [(b, lr) for b in setup['batch_sizes'] for lr in setup['learning_rates']]
    print(f"{len(runs)} base runs, {len(setup['points'])} branch points each, {len(grid)} branches per point "
          f"(batch sizes {setup['batch_sizes']}, learning rates {setup['learning_rates']}, delta {setup['delta']})",
          flush=True)
    series, kept = {}, 0
    bar = tqdm(total=len(runs) * len(setup['points']) * len(grid), desc="branches", unit="branch")
    for family, seed in runs:
        run, checkpoints = base_run(work_dir, family, seed, setup, extra)
        series[(family, seed)] = b_simple_at(run, args.alpha)
        write_csv(os.path.join(args.out_dir, f"gns_{family}-s{seed}.csv"), series[(family, seed)])
        for point, path in checkpoints.items():
            tokens = int(read_checkpoint(path)['model']['tokens_processed'])
            here = (prints['family'] == family) & (prints['seed'] == seed) & (prints['branch_tokens'] == tokens)
            fp = (f"{fingerprint(path)} delta {setup['delta']:g} max_steps {setup['max_steps']} "
                  f"eval {setup['eval_batches']}x{setup['eval_batch_size']}")
            if here.any() and prints.loc[here, 'fingerprint'].iloc[0] != fp:
                print(f"  {family} seed {seed}: the branches at {tokens:,} tokens started from another checkpoint or "
                      f"ran for another delta ({prints.loc[here, 'fingerprint'].iloc[0]}); running them again")
                mine = (branches['family'] == family) & (branches['seed'] == seed) & (branches['branch_tokens'] == tokens)
                branches = branches[~mine]
            prints = pd.concat([prints[~here], pd.DataFrame([dict(family=family, seed=seed, branch_tokens=tokens,
                                                                  fingerprint=fp)])], ignore_index=True)
            write_csv(prints_csv, prints)
            eval_set = fixed_eval_set(path, setup)
            model = load_branch(path, 0.0)[0]
            start_loss = held_out_loss(model, eval_set)
            for b, lr in grid:
                done = ((branches['family'] == family) & (branches['seed'] == seed) &
                        (branches['branch_tokens'] == tokens) & (branches['batch_size'] == b) &
                        np.isclose(branches['learning_rate'].astype(float), lr))
                bar.update(1)
                if done.any():
                    kept += 1
                    continue
                bar.set_postfix_str(f"{family} s{seed} step {point} B={b} lr={lr:g}")
                steps = run_branch(path, b, lr, eval_set, start_loss, setup['delta'], setup['max_steps'],
                                   seed=1000 * seed + b)
                row = dict(family=family, seed=seed, branch_tokens=tokens, batch_size=b, learning_rate=lr, best=False,
                           steps=steps if steps is not None else math.nan,
                           examples=b * steps if steps is not None else math.nan, reached=steps is not None)
                branches = pd.concat([branches, pd.DataFrame([row])], ignore_index=True)
                branches = mark_best(branches, setup['learning_rates'])
                write_csv(branches_csv, branches[BRANCH_COLUMNS])  # every finished branch is kept
    bar.close()
    print(f"{kept} branches were kept from an earlier run, {bar.n - kept} run now")
    branches = mark_best(branches, setup['learning_rates'])
    write_csv(branches_csv, branches[BRANCH_COLUMNS])
    summary = summarise(branches[branches['family'].isin(families)], series, setup)
    write_csv(summary_csv, summary)
    with pd.option_context('display.width', 200, 'display.max_columns', 20):
        print(summary.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    print(f"wrote {branches_csv} and {summary_csv}")
    return 0


if __name__ == '__main__':
    sys.exit(main())
