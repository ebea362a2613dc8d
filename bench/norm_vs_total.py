"""
Does the normalisation layers' GNS still predict the whole model's in today's blocks? The paper
(Gray et al. 2024) showed it for GPT-2-style blocks with LayerNorm; this trains the CPU demo
model (config/train_shakespeare_char_cpu.py, every parameter measured) as a GPT-2-style model and
as a Llama-style one of the same width and depth (RMSNorm, SwiGLU, rotary positions, untied
head, no biases), several seeds each, and reports per run what gns-analysis.py reports: the
median ratio of the normalisation-only GNS to the total GNS and their Pearson r, over the steps
after both EMAs have filled their window.

    python data/shakespeare_char/prepare.py
    python bench/norm_vs_total.py                     # 2 families x 2 seeds, ~4 minutes on 2 idle CPU cores
    python bench/norm_vs_total.py --seeds 1 --max_tokens 100000

Runs go to OUT_DIR/<family>-s<seed> (a finished run is not run again), the table to
OUT_DIR/results.csv and OUT_DIR/results.md. Any other --key=value goes to train.py for every run.
"""
import argparse
import importlib.util
import os
import sys

import pandas as pd

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.runs import add_run_options, check_train_flags, train_once  # noqa: E402
from nanogns.logread import ToolParser  # noqa: E402
from nanogns.runlog import atomic_write  # noqa: E402

spec = importlib.util.spec_from_file_location("gns_analysis", os.path.join(ROOT, "gns-analysis.py"))
gns_analysis = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gns_analysis)

CONFIG = os.path.join(ROOT, 'config', 'train_shakespeare_char_cpu.py')
FAMILIES = {
    'gpt2': dict(),
    'llama': dict(norm='rmsnorm', mlp='swiglu', pos_emb='rope', tie_embeddings=False, bias=False),
}


def train(out_dir, family, seed, max_tokens, extra):
    """One run of train.py (skipped when its log already reaches max_tokens); returns its folder."""
    where = os.path.join(out_dir, f"{family}-s{seed}")
    flags = {**FAMILIES[family], 'seed': seed, 'out_dir': where, 'max_tokens': max_tokens,
             'lr_decay_tokens': max_tokens, 'always_save_checkpoint': False}
    return train_once(where, flags, extra, f"{family} seed {seed}", CONFIG)


def normalisation_vs_total(run, alpha):
    """gns-analysis.py's comparison of the normalisation group's GNS with the total, for one run."""
    df, path, _ = gns_analysis.read_log(run)
    kinds, norm = gns_analysis.read_kinds(path)
    results, info = gns_analysis.analyze(df, alpha, kinds=kinds, norm=norm)
    group = info["norm_group"]  # LayerNorm or RMSNorm, after the model
    seen = results[[f"{group}/ema_steps", "total/ema_steps"]].min(axis=1)
    return gns_analysis.compare(results[f"{group}/gns"], results["total/gns"], seen, alpha)


def main(argv=None):
    parser = ToolParser(prog='bench/norm_vs_total.py', description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_options(parser, 'out-norm-vs-total', 'model family', 384_000, "tokens per run (default: 384000, 500 steps)")
    parser.add_argument('--alpha', type=float, default=gns_analysis.EMA_BETA,
                        help=f"the EMA's alpha, as gns-analysis.py's (default: {gns_analysis.EMA_BETA})")
    args, extra = parser.parse_known_args(argv)
    if args.seeds < 1 or args.max_tokens < 1 or not 0 <= args.alpha < 1:
        parser.error("--seeds and --max_tokens must be >= 1 and --alpha in [0, 1)")
    check_train_flags(parser, extra)
    print(f"{len(FAMILIES) * args.seeds} runs of {args.max_tokens:,} tokens into {args.out_dir}", flush=True)
    rows = []
    for family in FAMILIES:
        for seed in range(1, args.seeds + 1):
            c = normalisation_vs_total(train(args.out_dir, family, seed, args.max_tokens, extra), args.alpha)
            rows.append(dict(family=family, seed=seed, steps=c['steps'], ratio_median=c['ratio_median'],
                             pearson=c['pearson']))
    runs = pd.DataFrame(rows)
    atomic_write(os.path.join(args.out_dir, 'results.csv'), lambda f: runs.to_csv(f, index=False), mode='w')
    lines = [f"normalisation-only vs total GNS, EMA alpha {args.alpha} (steps after both EMAs' window)", "",
             "| family | seed | steps | median ratio | Pearson r |", "|---|---|---|---|---|"]
    lines += [f"| {r.family} | {r.seed} | {r.steps} | {r.ratio_median:.3f} | {r.pearson:.3f} |" for r in runs.itertuples()]
    for family, g in runs.groupby('family', sort=False):
        lines.append(f"| {family} | mean | | {g.ratio_median.mean():.3f} | {g.pearson.mean():.3f} |")
    text = "\n".join(lines)
    atomic_write(os.path.join(args.out_dir, 'results.md'), lambda f: f.write(text + "\n"), mode='w')
    print(text)
    return 0


if __name__ == '__main__':
    sys.exit(main())
