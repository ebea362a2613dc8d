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
    python bench/critical_batch.py --quick --out_dir /tmp/cb --dataset=PATH    # the pipeline, minutes (docs/critical-batch.md)
    python bench/critical_batch.py --report --out_dir bench/results/critical_batch  # the tables, from the CSVs

Writes OUT_DIR/branches.csv (family, seed, branch_tokens, batch_size, learning_rate, best, steps,
examples, reached: one row per branch), OUT_DIR/summary.csv (family, seed, branch_tokens, s_min,
e_min, b_crit, b_simple_total, b_simple_norm, b_simple_norm_adam, b_crit_low, b_crit_high,
fit_points, censored, setting: one row per branch point) and OUT_DIR/gns_<family>-s<seed>.csv (each
B_simple of the base run over its tokens, for the figure), with a line per base run and per branch
as each starts. A finished branch is kept: run it again and it goes on where it stopped. Nothing
finished is ever deleted: OUT_DIR holds one setting (delta, max_steps, the evaluation batches, a
fingerprint of the dataset's content, and the train.py values given that the script does not set
itself; each branch point's is in OUT_DIR/checkpoints.csv beside its checkpoint's fingerprint), and
a run for another setting, or from a checkpoint that is not the one a branch started from, is
refused before it changes anything (use another --out_dir). Base runs and their checkpoints go to
--work_dir, and are reused as they are: a run whose train.py values or data differ from those a
kept checkpoint was trained with is refused before anything runs (use another --work_dir). Any
other --key=value goes to train.py for the base runs (e.g. --dataset=PATH), checked before anything
runs. --report trains nothing: it fits the branches as they stand, rewrites summary.csv, and prints
the results as Markdown tables (docs/critical-batch.md's), each ratio B_crit / B_simple with its spread over
seeds, and separate tables for each setting if OUT_DIR holds branches of several.
"""
import argparse
import contextlib
import hashlib
import io
import json
import math
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import pandas as pd
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.norm_vs_total import FAMILIES, gns_analysis  # noqa: E402
from bench.runs import check_train_flags, train_once  # noqa: E402
from checkpoint import (CheckpointError, config_from_checkpoint, dataset_difference, dataset_fingerprint,  # noqa: E402
                        load_weights, read_checkpoint)
from configurator import ConfigError, check_dataset, check_device, check_train_config, configure  # noqa: E402
from nanogns.logread import ToolParser  # noqa: E402
from nanogns.maths import PREFIXES, critical_batch_interval, fit_critical_batch  # noqa: E402
from model import GPT  # noqa: E402
from nanogns.runlog import atomic_write  # noqa: E402

CONFIG = os.path.join(ROOT, 'config', 'train_shakespeare_char_cpu.py')
BRANCH_COLUMNS = ['family', 'seed', 'branch_tokens', 'batch_size', 'learning_rate', 'best', 'steps', 'examples',
                  'reached']
SUMMARY_COLUMNS = ['family', 'seed', 'branch_tokens', 's_min', 'e_min', 'b_crit', 'b_simple_total', 'b_simple_norm',
                   'b_simple_norm_adam', 'b_crit_low', 'b_crit_high', 'fit_points', 'censored', 'setting']
PRINT_COLUMNS = ['family', 'seed', 'branch_tokens', 'fingerprint']
POINT = ['family', 'seed', 'branch_tokens']
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

# train.py's keys that the base runs set themselves: given on the command line they would break the
# experiment (another seed, checkpoints at other steps, nothing measured)
OWN_KEYS = ('seed', 'out_dir', 'init_from', 'max_tokens', 'max_iters', 'always_save_checkpoint', 'eval_interval',
            'linearclass', 'embeddingclass', 'lnclass', 'gns_adam')
# train.py's keys that change nothing a base run or a branch computes, only what is printed or logged elsewhere
NOT_SHAPING = ('log_interval', 'wandb_log', 'wandb_project', 'wandb_run_name', 'device_name')
# what each stage of a base run sets for itself: its folder, where it stops, whether it resumes
STAGE_KEYS = ('out_dir', 'init_from', 'max_tokens', 'max_iters')


def base_flags(work_dir, family, seed, setup):
    where = os.path.join(work_dir, f"{family}-s{seed}")
    return {**FAMILIES[family], **setup['flags'], 'seed': seed, 'out_dir': where, 'always_save_checkpoint': True,
            'eval_interval': 10 ** 9, 'linearclass': 'gns', 'embeddingclass': 'gns', 'lnclass': 'shim',
            'gns_adam': True}


def train_defaults():
    """train.py's defaults, read from its `key = value` lines without running it; None where a default
    is computed at run time (configure() then takes any value, and check_train_config checks it)."""
    import ast
    with open(os.path.join(ROOT, 'train.py')) as f:
        tree = ast.parse(f.read())
    defaults = {}
    for node in tree.body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            continue
        if node.targets[0].id == 'config_keys':  # the defaults end here
            break
        try:
            defaults[node.targets[0].id] = ast.literal_eval(node.value)
        except ValueError:
            defaults[node.targets[0].id] = None
    return defaults


def train_config(parser, flags, extra=()):
    """train.py's config (CONFIG, then `flags`, then the command line's `extra`) as train.py checks and
    completes it (its lengths in tokens), before anything runs: bad input is one line and exit 2 here, not
    a failed run minutes later."""
    config, places = train_defaults(), {}
    argv = [CONFIG, *(f"--{k}={v!r}" for k, v in flags.items()), *extra]
    with contextlib.redirect_stdout(io.StringIO()):  # configure()'s echo of each setting, and the checks' notes
        try:
            configure(argv, config, places=places)
        except ConfigError as e:  # train.py's keys, not this script's: its --help lists them
            parser.exit(2, f"{parser.prog}: error: {str(e).removesuffix('; see --help')} "
                           f"(python train.py --help lists its keys)\n")
        check_train_config(config, places)  # exits with one line at a bad value
    return config


def check_base_runs(parser, work_dir, families, setup, extra):
    """Every base run's train.py command line checked as train.py checks it, before anything runs.
    Returns {family: the config its base runs train with (seed 1's)}."""
    own = [a for a in extra if a[2:].split('=', 1)[0] in OWN_KEYS]
    if own:
        parser.error(f"{own[0].split('=', 1)[0]} is set by bench/critical_batch.py itself for every base run "
                     f"(the seeds: --seeds; the folders: --out_dir, --work_dir)")
    configs = {}
    for family in families:
        config = train_config(parser, base_flags(work_dir, family, 1, setup), extra)
        with contextlib.redirect_stdout(io.StringIO()):
            check_device(config['device'])
            check_dataset(config['dataset'], ROOT)
        configs[family] = config
    return configs


def word(value):
    """A train.py value as one word of a setting: a string as it is, anything else as compact JSON."""
    return value if isinstance(value, str) else json.dumps(value, separators=(',', ':'))


def dataset_content(dataset):
    """A short hash of checkpoint.dataset_fingerprint: the dataset's content, wherever it lies."""
    return hashlib.sha256(json.dumps(dataset_fingerprint(dataset), sort_keys=True).encode()).hexdigest()[:16]


def base_setting(parser, work_dir, setup, extra, configs):
    """The base runs' part of the setting checkpoints.csv records: 'dataset_content <hash>' (the data, not
    its place), then 'key value' for each train.py key given on the command line (NOT_SHAPING ones aside)
    whose value is not the script's own for every family."""
    given = dict.fromkeys(a[2:].split('=', 1)[0] for a in extra)
    given = [k for k in given if k != 'dataset' and k not in NOT_SHAPING]
    config = next(iter(configs.values()))  # a key given is given to every family alike
    owns = [train_config(parser, base_flags(work_dir, family, 1, setup)) for family in FAMILIES] if given else []
    changed = [k for k in given if any(word(config[k]) != word(own[k]) for own in owns)]
    return ' '.join([f"dataset_content {dataset_content(config['dataset'])}",
                     *(f"{k} {word(config[k])}" for k in changed)])


def refuse_other_base_runs(parser, work_dir, runs, setup, configs):
    """One line and exit 2, before anything runs, where a checkpoint that a base run keeps in work_dir (its
    ckpt.pt and ckpt-<step>.pt, reused as they are) was trained with other train.py values than this run
    gives it (NOT_SHAPING and STAGE_KEYS aside) or on other data (checkpoint.dataset_difference: the same
    data elsewhere is the same): branches from it would be this run's in name only."""
    for family, seed in runs:
        wanted = {**configs[family], 'seed': seed}
        for name in (*(f"ckpt-{point}.pt" for point in setup['points']), 'ckpt.pt'):
            path = os.path.join(work_dir, f"{family}-s{seed}", name)
            if not os.path.exists(path):
                continue
            try:
                checkpoint = read_checkpoint(path)
            except CheckpointError as e:
                parser.error(f"{e}; nothing was changed: move it away, or use another --work_dir")
            then = checkpoint.get('config') or {}
            compared = [k for k in wanted if k in then and k not in (*STAGE_KEYS, *NOT_SHAPING, 'dataset')]
            differ = [f"{k} {then[k]!r}, not {wanted[k]!r}" for k in compared if word(then[k]) != word(wanted[k])]
            data = dataset_difference(checkpoint, wanted['dataset'])
            if data is not None:
                differ.append(f"dataset {then.get('dataset')!r}, not {wanted['dataset']!r}{data}")
            if differ:
                parser.error(f"{path} was trained with {'; '.join(differ)}: it is not this run's base run; nothing "
                             f"was changed: run these flags with another --work_dir and --out_dir")


def base_run(work_dir, family, seed, setup, extra, tokens_per_step):
    """The base run in stages, one train.py run to each branch point (resumed from the last), each
    checkpoint kept as ckpt-<iter>.pt; returns (run folder, {iter: checkpoint path})."""
    flags = base_flags(work_dir, family, seed, setup)
    where = flags['out_dir']
    checkpoints = {}
    for k, point in enumerate(setup['points'], 1):
        saved = os.path.join(where, f"ckpt-{point}.pt")
        if not os.path.exists(saved):
            print(f"  {family} seed {seed}: base run to step {point} ({k} of {len(setup['points'])} checkpoints) ...",
                  flush=True)
            resume = {'init_from': 'resume'} if checkpoints else {}
            train_once(where, {**flags, **resume, 'max_tokens': point * tokens_per_step}, extra,
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


def run_branch(path, data_dir, batch_size, learning_rate, eval_set, start_loss, delta, max_steps, seed):
    """Optimizer steps on data_dir's train split until the held-out loss is DELTA below start_loss, or None
    within max_steps: the step where the line between the last evaluation above the target and the first
    one at or below it crosses the target."""
    torch.manual_seed(seed)
    model, optimizer, config = load_branch(path, learning_rate)
    data = Batches(data_dir, 'train', config['block_size'])
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


def fixed_eval_set(path, setup, data_dir):
    """The held-out batches every branch of a run is judged on: fixed windows of data_dir's val split."""
    config = read_checkpoint(path)['config']
    data = Batches(data_dir, 'val', config['block_size'])
    generator = torch.Generator().manual_seed(20251125)
    return [data.get(setup['eval_batch_size'], generator) for _ in range(setup['eval_batches'])]


# -- 3. the setting each branch point ran for ----------------------------------------------------

NOT_RECORDED = "setting not recorded"


def setting_of(setup):
    """What a branch's step count depends on besides its checkpoint, as checkpoints.csv records it after
    the checkpoint's fingerprint."""
    return (f"delta {setup['delta']:g} max_steps {setup['max_steps']} "
            f"eval {setup['eval_batches']}x{setup['eval_batch_size']}")


def split_record(record):
    """(the weights' fingerprint, the setting) of a checkpoints.csv cell '<fingerprint> delta D max_steps N
    eval AxB' (the first versions recorded no eval)."""
    weights, _, setting = str(record).partition(' ')
    return weights, setting


def setting_values(setting):
    words = setting.split()
    return dict(zip(words[::2], words[1::2]))


BRANCH_KEYS = ('delta', 'max_steps', 'eval')  # setting_of's: the rest is the base runs' (base_setting)


def differences(recorded, wanted):
    """'delta 0.2, not 0.35' for each value that differs between a recorded setting and this run's. A record
    without the base runs' part (no dataset_content: written before it was recorded) is compared on the
    branches' part alone (refuse_other_base_runs checks the base runs it kept); in one with it, a train.py
    key that one side lacks has the script's own value there."""
    old, new = setting_values(recorded), setting_values(wanted)
    if 'dataset_content' not in old:
        new = {k: v for k, v in new.items() if k in BRANCH_KEYS}
    own = "(the script's)"
    return [f"{key} {old.get(key, 'not recorded' if key in BRANCH_KEYS else own)}, "
            f"not {new.get(key, 'none' if key in BRANCH_KEYS else own)}"
            for key in dict.fromkeys([*new, *old]) if old.get(key) != new.get(key)]


def point_settings(prints, branches):
    """{(family, seed, branch_tokens): setting} of every branch point checkpoints.csv records or branches.csv
    has rows of; NOT_RECORDED for rows with no record."""
    settings = {(r.family, r.seed, r.branch_tokens): split_record(r.fingerprint)[1] for r in prints.itertuples()}
    for point in branches[POINT].drop_duplicates().itertuples(index=False):
        settings.setdefault(tuple(point), NOT_RECORDED)
    return settings


def refuse_another_setting(parser, out_dir, work_dir, settings, setting):
    """One line and exit 2, before anything runs, where OUT_DIR holds a branch point of another setting (or of
    none recorded): running here would mix its rows with this setting's in one fit, or replace them."""
    for (family, seed, tokens), recorded in settings.items():
        differ = differences(recorded, setting) if recorded != NOT_RECORDED else []
        if recorded == NOT_RECORDED or differ:
            what = ("branches with no record in checkpoints.csv, of an unknown setting" if recorded == NOT_RECORDED
                    else f"branches run for {'; '.join(differ)}")
            where = (f"another --out_dir (--work_dir={work_dir} reuses the base runs)"
                     if all(d.split()[0] in BRANCH_KEYS for d in differ) else
                     "another --out_dir and --work_dir (its base runs are of other flags or data)")
            parser.error(f"{out_dir} holds {what} ({family} seed {seed} at {tokens:,} tokens); nothing was changed: "
                         f"run this setting in {where}")


# -- 4. the fits --------------------------------------------------------------------------------

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


def summarise(branches, series, setup, settings):
    """summary.csv's rows: per branch point the fit of its best branches, the interval of its B_crit
    (gnsmath.critical_batch_interval), and the base run's B_simple there. A point whose grid is not
    finished gets no fit (NaN): a batch size's best rate, and so its steps, may still change. Said for
    each point: a best rate at the grid's edge (a rate beyond it might do better), the batch sizes no
    rate brought to the target (right-censored, left out of the fit), a fit on only two batch sizes,
    and a B_crit outside the batch sizes tried (an extrapolation)."""
    rows = []
    rates, sizes = sorted(setup['learning_rates']), sorted(setup['batch_sizes'])
    grid_size = len(sizes) * len(rates)
    for (family, seed, tokens), group in branches.groupby(POINT, sort=False):
        where = f"  {family} seed {seed} at {tokens:,} tokens"
        setting = settings.get((family, seed, tokens), NOT_RECORDED)
        group = group[in_grid(group, rates) & group['batch_size'].isin(sizes)]
        best = group[group['best']]
        s_min = e_min = low = high = math.nan
        censored = []
        edge = best[[at_edge(row, branches) for row in best.itertuples()]]
        if len(edge):
            print(f"{where}: the best rate is the grid's edge for "
                  f"B = {', '.join(str(int(b)) for b in edge['batch_size'])} (their steps may be too many)")
        if len(group) < grid_size:
            print(f"{where}: {len(group)} of {grid_size} branches run, no fit yet")
        else:
            censored = sorted(set(sizes) - set(best['batch_size'].astype(int)))
            if censored:
                steps = setting_values(setting).get('max_steps', 'its max_steps')
                print(f"{where}: B = {', '.join(map(str, censored))} reached the target at no rate (right-censored: "
                      f"more than {steps} steps, or diverged), left out of the fit")
            try:
                s_min, e_min = fit_critical_batch(best['batch_size'].tolist(), best['steps'].tolist())
                low, high = critical_batch_interval(best['batch_size'].tolist(), best['steps'].tolist())
            except ValueError as e:
                print(f"{where}: no fit ({e})")
            if s_min > 0 and len(best) == 2:
                two = ', '.join(str(int(b)) for b in best['batch_size'])
                print(f"{where}: the fit rests on 2 batch sizes only ({two}): its line goes through both, nothing "
                      f"checks it, and it has no interval")
            if s_min > 0 and e_min / s_min > sizes[-1]:
                print(f"{where}: B_crit {e_min / s_min:.3g} lies beyond the largest batch tried ({sizes[-1]}): an "
                      f"extrapolation, a lower bound only, left out of the ratios")
            if s_min > 0 and e_min / s_min < sizes[0]:
                print(f"{where}: B_crit {e_min / s_min:.3g} lies below the smallest batch tried ({sizes[0]}): an "
                      f"extrapolation, an upper bound only, left out of the ratios")
        gns = series[(family, seed)]
        at = gns[gns['tokens'] <= tokens].iloc[-1] if (gns['tokens'] <= tokens).any() else None
        rows.append(dict(family=family, seed=seed, branch_tokens=tokens, s_min=s_min, e_min=e_min,
                         b_crit=e_min / s_min if s_min > 0 else math.nan,
                         **{k: (at[k] if at is not None else math.nan)
                            for k in ('b_simple_total', 'b_simple_norm', 'b_simple_norm_adam')},
                         b_crit_low=low, b_crit_high=high, fit_points=len(best) if s_min > 0 else 0,
                         censored=' '.join(map(str, censored)), setting=setting))
    return pd.DataFrame(rows, columns=SUMMARY_COLUMNS)


RATIOS = (('b_simple_total', 'total'), ('b_simple_norm', 'norm'), ('b_simple_norm_adam', 'norm, Adam'))


def report(branches, summary, setup):
    """Markdown: one row per branch point and seed, then per family and branch point the ratios
    B_crit / B_simple as the mean over seeds (min-max), then per estimate how far and how steadily
    it follows B_crit over all fitted points: the geometric mean ratio and the spread of log ratio.
    A fitted B_crit outside the batch sizes tried is marked and left out of the ratios; a fit on two
    batch sizes is marked."""
    grid = len(setup['batch_sizes']) * len(setup['learning_rates'])
    smallest, largest = min(setup['batch_sizes']), max(setup['batch_sizes'])
    g = lambda v: '–' if pd.isna(v) else '∞' if v == math.inf else f"{v:.3g}"  # noqa: E731
    b = lambda v: g(v) if pd.isna(v) or v > 0 else "< 0"  # noqa: E731  (a B_simple whose |G|^2 EMA is negative)
    lines = ["| family | seed | branch point (tokens) | branches done | not reached (censored) | S_min | E_min | "
             "B_crit | B_crit, 90% interval | B_simple total | B_simple norm | B_simple norm, Adam |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in summary.itertuples():
        here = branches[(branches['family'] == row.family) & (branches['seed'] == row.seed) &
                        (branches['branch_tokens'] == row.branch_tokens)]
        notes = (' (2 points)' if row.fit_points == 2 else '') + (
            f" (> {largest}: extrapolated)" if row.b_crit > largest else
            f" (< {smallest}: extrapolated)" if row.b_crit < smallest else '')
        censored = ', '.join(str(row.censored).split()) if isinstance(row.censored, str) and row.censored else '–'
        interval = '–' if pd.isna(row.b_crit_low) else f"{g(row.b_crit_low)}–{g(row.b_crit_high)}"
        lines.append(f"| {row.family} | {row.seed} | {row.branch_tokens:,} | "
                     f"{in_grid(here, setup['learning_rates']).sum()} of {grid} | {censored} | {g(row.s_min)} | "
                     f"{g(row.e_min)} | {g(row.b_crit)}{notes} | {interval} | {b(row.b_simple_total)} | "
                     f"{b(row.b_simple_norm)} | {b(row.b_simple_norm_adam)} |")
    lines += ["",
              "Not reached: batch sizes at which no rate reached the target (right-censored), left out of the fit.",
              "The interval: the 5th to 95th percentile of B_crit refitted to 2000 resamples of the fit's log "
              "residuals",
              "(a residual bootstrap over the batch sizes' step counts; none for a fit on 2 points)."]
    # a B_crit outside the batches tried is the fit's extrapolation: only "more (or less) than that" is
    # measured, so it stands in the first table, marked, and in no ratio
    fitted = summary[summary['b_crit'].between(smallest, largest)].copy()
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


def read_csv(parser, path, columns):
    """A CSV this script wrote (empty with `columns` where there is none); one line and exit 2 where it
    cannot be read or lacks a column."""
    if not os.path.exists(path):
        return pd.DataFrame(columns=columns)
    try:
        frame = pd.read_csv(path)
    except (OSError, ValueError, UnicodeDecodeError) as e:
        parser.error(f"cannot read {path} ({str(e).splitlines()[0] if str(e) else type(e).__name__})")
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        parser.error(f"{path} has no column {missing[0]}: it is not this script's")
    return frame


def writable_folder(parser, flag, path):
    """Create the folder (and its parents) and write a file in it, or one line and exit 2 saying why not."""
    if os.path.exists(path) and not os.path.isdir(path):
        parser.error(f"{flag}={path} is a file, not a folder")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        parser.error(f"{flag}={path}: cannot write there ({e.strerror or e})")


def clock(seconds):
    return f"{seconds / 60:.0f} min" if seconds >= 600 else f"{seconds:.0f} s"


def main(argv=None):
    # no abbreviations: --seed=3 is train.py's key, not --seeds
    parser = ToolParser(prog='bench/critical_batch.py', description=__doc__, allow_abbrev=False,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--out_dir', default='out-critical-batch',
                        help="where branches.csv, summary.csv and the GNS series go (default: out-critical-batch)")
    parser.add_argument('--work_dir', help="where the base runs and their checkpoints go (default: OUT_DIR/base)")
    parser.add_argument('--seeds', type=int, help="seeds per model family (default: 2, --quick 1)")
    parser.add_argument('--families', help=f"model families (default: {','.join(FAMILIES)}, --quick {next(iter(FAMILIES))})")
    parser.add_argument('--quick', action='store_true',
                        help="a tiny model, a short base run, few steps, one family and seed "
                             "(docs/critical-batch.md says how long it takes)")
    parser.add_argument('--delta', type=float, help="the loss drop each branch trains for (default: 0.05, --quick 0.2)")
    parser.add_argument('--report', action='store_true',
                        help="train nothing: fit OUT_DIR's branches as they stand, rewrite summary.csv and print "
                             "the results as Markdown tables (docs/critical-batch.md's)")
    parser.add_argument('--alpha', type=float, default=gns_analysis.EMA_BETA,
                        help=f"the EMA's alpha, as gns-analysis.py's (default: {gns_analysis.EMA_BETA})")
    args, extra = parser.parse_known_args(argv)
    check_train_flags(parser, extra)
    setup = dict(QUICK if args.quick else FULL)
    setup['delta'] = args.delta if args.delta is not None else setup['delta']
    args.seeds = args.seeds if args.seeds is not None else 1 if args.quick else 2
    families = (args.families or (next(iter(FAMILIES)) if args.quick else ','.join(FAMILIES))).split(',')
    families = [f for f in families if f]
    if args.seeds < 1 or not 0 < setup['delta'] < math.inf or not 0 <= args.alpha < 1:
        parser.error("--seeds must be >= 1, --delta > 0 (and finite) and --alpha in [0, 1)")
    if not families or set(families) - set(FAMILIES):
        parser.error(f"--families must name some of {', '.join(FAMILIES)}")
    branches_csv, summary_csv = (os.path.join(args.out_dir, n) for n in ('branches.csv', 'summary.csv'))
    prints_csv = os.path.join(args.out_dir, 'checkpoints.csv')
    if args.report:  # the fits again from branches.csv as it stands (a running experiment adds rows to it)
        if extra or args.delta is not None:
            parser.error(f"--report trains nothing and takes the delta each branch point ran for from checkpoints.csv: "
                         f"{(extra or ['--delta'])[0].split('=')[0]} has no effect there")
        if not os.path.exists(branches_csv):
            parser.error(f"--report: {args.out_dir} has no branches.csv (run the experiment first)")
        branches = mark_best(read_csv(parser, branches_csv, BRANCH_COLUMNS), setup['learning_rates'])
        settings = point_settings(read_csv(parser, prints_csv, PRINT_COLUMNS), branches)
        points = [tuple(p) for p in branches[POINT].drop_duplicates().itertuples(index=False)]
        groups = {}  # setting: its branch points, each setting fitted and reported on its own
        for point in points:
            groups.setdefault(settings[point], []).append(point)
        other = FULL if args.quick else QUICK
        if all(setting_values(s).get('max_steps') == str(other['max_steps']) != str(setup['max_steps'])
               for s in groups):
            parser.error(f"{args.out_dir}'s branches ran for max_steps {other['max_steps']}, "
                         f"{'the full experiment' if args.quick else '--quick'}'s: "
                         f"{'leave out' if args.quick else 'add'} --quick to judge them on its grid")
        series = {}
        for family, seed in branches[['family', 'seed']].drop_duplicates().itertuples(index=False):
            path = os.path.join(args.out_dir, f"gns_{family}-s{seed}.csv")
            series[(family, seed)] = pd.read_csv(path) if os.path.exists(path) else pd.DataFrame(columns=['tokens'])
        if len(groups) > 1:
            counts = '; '.join(f"{s}: {len(p)} branch point(s)" for s, p in groups.items())
            print(f"note: {args.out_dir} holds branches of {len(groups)} settings ({counts}): each has its own "
                  f"tables, no fit or ratio mixes them", file=sys.stderr)
        texts, summaries = [], []
        for setting, mine in groups.items():
            part = branches[pd.MultiIndex.from_frame(branches[POINT]).isin(mine)]
            with contextlib.redirect_stdout(sys.stderr):  # the fits' notes
                summaries.append(summarise(part, series, setup, settings))
            heading = (f"#### {setting}" if len(groups) > 1 else
                       f"{len(mine)} branch point(s), all run for {setting}." if setting != NOT_RECORDED else
                       f"{len(mine)} branch point(s), of a setting checkpoints.csv does not record.")
            texts.append(f"{heading}\n\n{report(part, summaries[-1], setup)}")
        try:  # the notebook's figure reads it
            write_csv(summary_csv, pd.concat(summaries, ignore_index=True))
        except OSError as e:
            print(f"warning: could not rewrite {summary_csv} ({e.strerror or e}); the tables below are not in it",
                  file=sys.stderr)
        print("\n\n".join(texts))
        return 0
    work_dir = args.work_dir or os.path.join(args.out_dir, 'base')
    writable_folder(parser, '--out_dir', args.out_dir)
    writable_folder(parser, '--work_dir', work_dir)
    configs = check_base_runs(parser, work_dir, families, setup, extra)
    runs = [(f, s) for s in range(1, args.seeds + 1) for f in families]  # every family before a second seed
    refuse_other_base_runs(parser, work_dir, runs, setup, configs)
    branches = read_csv(parser, branches_csv, BRANCH_COLUMNS)
    prints = read_csv(parser, prints_csv, PRINT_COLUMNS)
    setting = f"{setting_of(setup)} {base_setting(parser, work_dir, setup, extra, configs)}"
    refuse_another_setting(parser, args.out_dir, work_dir, point_settings(prints, branches), setting)
    data_dirs = {family: check_dataset(config['dataset'], ROOT) for family, config in configs.items()}
    grid = [(b, lr) for b in setup['batch_sizes'] for lr in setup['learning_rates']]
    total = len(runs) * len(setup['points']) * len(grid)
    print(f"{len(runs)} base runs, {len(setup['points'])} branch points each, {len(grid)} branches per point "
          f"(batch sizes {setup['batch_sizes']}, learning rates {setup['learning_rates']}, {setting})", flush=True)
    series, kept, done, started = {}, 0, 0, time.time()
    for family, seed in runs:
        config = configs[family]
        tokens_per_step = config['batch_size'] * config['block_size'] * config['gradient_accumulation_steps']
        run, checkpoints = base_run(work_dir, family, seed, setup, extra, tokens_per_step)
        points = {}  # path: (tokens, weights' fingerprint), every one checked before anything is written
        for path in checkpoints.values():
            tokens, weights = int(read_checkpoint(path)['model']['tokens_processed']), fingerprint(path)
            here = (prints['family'] == family) & (prints['seed'] == seed) & (prints['branch_tokens'] == tokens)
            recorded = split_record(prints.loc[here, 'fingerprint'].iloc[0])[0] if here.any() else weights
            if recorded != weights:
                parser.error(f"{path} is not the checkpoint {args.out_dir}'s branches at {tokens:,} tokens started "
                             f"from (its weights' fingerprint {weights}, recorded {recorded}: rebuilt, or trained by "
                             f"other code); nothing was changed: run it in another --out_dir")
            points[path] = tokens, weights
        series[(family, seed)] = b_simple_at(run, args.alpha)
        write_csv(os.path.join(args.out_dir, f"gns_{family}-s{seed}.csv"), series[(family, seed)])
        for path, (tokens, weights) in points.items():
            here = (prints['family'] == family) & (prints['seed'] == seed) & (prints['branch_tokens'] == tokens)
            if not here.any():  # recorded before its first branch is written: no row without its setting
                record = dict(family=family, seed=seed, branch_tokens=tokens, fingerprint=f"{weights} {setting}")
                prints = pd.concat([prints, pd.DataFrame([record])], ignore_index=True)
                write_csv(prints_csv, prints)
            mine = (branches['family'] == family) & (branches['seed'] == seed) & (branches['branch_tokens'] == tokens)
            todo = [(b, lr) for b, lr in grid if not (mine & (branches['batch_size'] == b) &
                                                     np.isclose(branches['learning_rate'].astype(float), lr)).any()]
            kept, done = kept + len(grid) - len(todo), done + len(grid) - len(todo)
            if len(todo) < len(grid):
                print(f"  [{done}/{total}] {family} seed {seed} at {tokens:,} tokens: {len(grid) - len(todo)} branches "
                      f"kept from an earlier run", flush=True)
            if not todo:
                continue
            eval_set = fixed_eval_set(path, setup, data_dirs[family])
            model = load_branch(path, 0.0)[0]
            start_loss = held_out_loss(model, eval_set)
            for b, lr in todo:
                print(f"  [{done + 1}/{total}, {clock(time.time() - started)}] {family} seed {seed} at {tokens:,} "
                      f"tokens: B={b} lr={lr:g} ...", end='', flush=True)
                branch_started = time.time()
                steps = run_branch(path, data_dirs[family], b, lr, eval_set, start_loss, setup['delta'],
                                   setup['max_steps'], seed=1000 * seed + b)
                done += 1
                print(f" {f'{steps:.1f} steps' if steps is not None else 'not reached'} "
                      f"({clock(time.time() - branch_started)})", flush=True)
                row = dict(family=family, seed=seed, branch_tokens=tokens, batch_size=b, learning_rate=lr, best=False,
                           steps=steps if steps is not None else math.nan,
                           examples=b * steps if steps is not None else math.nan, reached=steps is not None)
                branches = pd.concat([branches, pd.DataFrame([row])], ignore_index=True)
                branches = mark_best(branches, setup['learning_rates'])
                write_csv(branches_csv, branches[BRANCH_COLUMNS])  # every finished branch is kept
    print(f"{kept} branches were kept from an earlier run, {done - kept} run now ({clock(time.time() - started)})")
    branches = mark_best(branches, setup['learning_rates'])
    write_csv(branches_csv, branches[BRANCH_COLUMNS])
    ran = pd.MultiIndex.from_frame(branches[['family', 'seed']]).isin(list(series))  # this run's families and seeds
    summary = summarise(branches[ran], series, setup, point_settings(prints, branches))
    write_csv(summary_csv, summary)
    with pd.option_context('display.width', 200, 'display.max_columns', 20):
        print(summary.drop(columns='setting').to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    print(f"wrote {branches_csv} and {summary_csv}")
    return 0


if __name__ == '__main__':
    sys.exit(main())
