"""
Gradient noise scale of a run, computed offline from the raw per-parameter norms in log.csv.

    python gns-analysis.py out-shakespeare-char
    python gns-analysis.py out --alpha 0.999 --no-plots

For every parameter p and step the log holds |G_B| (`{prefix}/p/norm`, the minibatch gradient
norm), |G_1| (`{prefix}/p/pegn`, the root mean squared per-example gradient norm) and B
(`{prefix}/p/batch_size`, which may change from step to step). For a group of parameters (all,
one layer type, one transformer block) the squared norms are summed over the group first, then
McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training", App. A, B_small = 1,
B_big = B) give unbiased per-step estimates of the true gradient's squared norm and of the trace
of the per-example gradient covariance:

    |G|^2  ~ (B |G_B|^2 - |G_1|^2) / (B - 1)
    tr(S)  ~ (|G_1|^2 - |G_B|^2) / (1 - 1/B)

Single-step estimates are very noisy (|G|^2 is often negative), so each is smoothed on its own
with an exponential moving average over the steps that have a measurement,

    ema_t = alpha * ema_{t-1} + (1 - alpha) * x_t,   ema_0 = 0,   reported as ema_t / (1 - alpha^t)

(the division is Adam's bias correction: without it the zero start drags early values down; with
it the first value is x_1 and every later one a weighted mean with weights alpha^age). alpha = 0.99
averages over roughly the last 1/(1 - alpha) = 100 measured steps. The noise scale is the ratio
of the two averages, GNS = EMA(tr(S)) / EMA(|G|^2), never an average of per-step ratios (a ratio
of noisy estimates is biased and explodes where |G|^2 crosses zero).

Groups: total (all parameters), LayerNorm (names with ln_*), Embedding (wte, wpe), Linear (the
rest), and each transformer block h.N. GPT ties lm_head to wte, so transformer.wte.weight (its
first name) carries the head's share of the gradient too and sits in Embedding. The paper's question (Gray et al. 2024): how well does
the LayerNorm-only GNS track the total? Answered with the ratio LayerNorm GNS / total GNS
(median and mean) and their Pearson correlation over the steps where the EMA has filled its
window (all steps if the run is shorter).

Writes OUT_DIR/gns_analysis.csv with, per step that has measurements, `{group}/sq_norm` and
`{group}/trace` (the per-step estimates), `{group}/sq_norm_ema`, `{group}/trace_ema`,
`{group}/gns` and `{group}/ema_steps` (measurements the EMA has seen).
"""
import argparse
import math
import os
import re
import sys

import numpy as np
import pandas as pd

from csv_tools import LogError, ToolParser, figure, load_log, log10_positive, run_main, x_axis

TYPE_GROUPS = ["LayerNorm", "Linear", "Embedding"]


class AnalysisError(Exception):
    """The log has no usable GNS data; the message is one line for the user."""


def layer_type(name):
    """LayerNorm for ln_1, ln_2, ln_f, ...; Embedding for wte, wpe; Linear for everything else."""
    parts = name.split(".")
    if any(p.startswith("ln_") for p in parts):
        return "LayerNorm"
    if any(p in ("wte", "wpe") for p in parts):
        return "Embedding"
    return "Linear"


def block_of(name):
    """'h.3' for transformer.h.3.attn.c_attn.weight, None outside the blocks."""
    m = re.search(r"(?:^|\.)h\.(\d+)\.", name)
    return f"h.{m.group(1)}" if m else None


def unbiased_estimates(big_sq, small_sq, B):
    """
    McCandlish et al. 2018, App. A with B_small = 1, B_big = B: estimates of (|G|^2, tr(S)) from
    |G_B|^2 and |G_1|^2. Arrays or floats; NaN where B <= 1 (nothing to estimate from).
    """
    B = np.where(np.asarray(B, dtype=float) > 1, B, np.nan)
    sq_norm = (B * big_sq - small_sq) / (B - 1)
    trace = (small_sq - big_sq) / (1 - 1 / B)
    return sq_norm, trace


def debiased_ema(x, alpha):
    """
    (EMA, measurements seen) of x over its finite entries, bias-corrected as in the module
    docstring; entries without a measurement carry the previous EMA forward (NaN before the first).
    """
    x = pd.Series(np.where(np.isfinite(x), x, np.nan))
    # pandas' adjusted EWM is exactly sum_i alpha^i x_{t-i} / sum_i alpha^i = the debiased EMA
    ema = x.ewm(alpha=1 - alpha, adjust=True, ignore_na=True).mean().to_numpy()
    seen = np.cumsum(x.notna().to_numpy())
    return np.where(seen > 0, ema, np.nan), seen


def gns_parameters(df, prefix):
    """({parameter name: (norm column, pegn column, batch_size column)}, [names with incomplete columns])."""
    found = {}
    for col in df.columns:
        if col.startswith(prefix + "/"):
            name, _, kind = col[len(prefix) + 1:].rpartition("/")
            if name and kind in ("norm", "pegn", "batch_size"):
                found.setdefault(name, {})[kind] = col
    complete = {n: (c["norm"], c["pegn"], c["batch_size"]) for n, c in found.items() if len(c) == 3}
    return complete, sorted(set(found) - set(complete))


def analyze(df, alpha, prefix="train/gns"):
    """
    (results DataFrame, info dict) for a loaded log. Groups: total, LayerNorm/Linear/Embedding
    (those present), then h.N in block order. Raises AnalysisError.
    """
    prefix = prefix.rstrip("/")
    params, incomplete = gns_parameters(df, prefix)
    if not params:
        examples = ", ".join(list(df.columns[1:6])) or "none"
        raise AnalysisError(f"no GNS columns '{prefix}/<parameter>/norm, /pegn, /batch_size' in the log "
                            f"(its columns start with: {examples}); is --prefix right?")

    def numeric(col):
        return pd.to_numeric(df[col], errors="coerce").to_numpy(dtype=float)

    names = list(params)
    big_sq = np.stack([numeric(params[n][0]) ** 2 for n in names], axis=1)   # [steps, params]
    small_sq = np.stack([numeric(params[n][1]) ** 2 for n in names], axis=1)
    batch = np.stack([numeric(params[n][2]) for n in names], axis=1)
    measured = np.isfinite(big_sq) & np.isfinite(small_sq) & np.isfinite(batch)
    never = [n for n, any_ in zip(names, measured.any(0)) if not any_]
    keep = measured.any(0)
    names = [n for n, k in zip(names, keep) if k]
    if not names:
        raise AnalysisError(f"the GNS columns under '{prefix}' hold no numbers yet")
    big_sq, small_sq, batch, measured = big_sq[:, keep], small_sq[:, keep], batch[:, keep], measured[:, keep]
    rows = measured.any(1)  # steps with at least one measurement
    big_sq, small_sq, batch, measured = big_sq[rows], small_sq[rows], batch[rows], measured[rows]

    groups = {"total": names}
    for kind in TYPE_GROUPS:
        members = [n for n in names if layer_type(n) == kind]
        if members:
            groups[kind] = members
    blocks = sorted({block_of(n) for n in names} - {None}, key=lambda b: int(b[2:]))
    for b in blocks:
        groups[b] = [n for n in names if block_of(n) == b]

    index = {n: i for i, n in enumerate(names)}
    out = {"step": df["step"].to_numpy()[rows]}
    for col in ("iter_num", "tokens_processed"):
        if col in df.columns:
            out[col] = pd.to_numeric(df[col], errors="coerce").to_numpy()[rows]
    mixed_batch_rows = 0
    for group, members in groups.items():
        cols = [index[n] for n in members]
        # a step counts for a group only if every parameter in it was measured, with one B
        B = batch[:, cols[0]]
        same_B = (batch[:, cols] == B[:, None]).all(1)
        complete = measured[:, cols].all(1) & same_B
        if group == "total":
            out["batch_size"] = B
            mixed_batch_rows = int((measured[:, cols].all(1) & ~same_B).sum())
        # sums over the group's parameters first, then the estimators
        sq_norm, trace = unbiased_estimates(big_sq[:, cols].sum(1), small_sq[:, cols].sum(1), B)
        sq_norm, trace = np.where(complete, sq_norm, np.nan), np.where(complete, trace, np.nan)
        sq_norm_ema, seen = debiased_ema(sq_norm, alpha)
        trace_ema, _ = debiased_ema(trace, alpha)
        out[f"{group}/sq_norm"], out[f"{group}/trace"] = sq_norm, trace
        out[f"{group}/sq_norm_ema"], out[f"{group}/trace_ema"] = sq_norm_ema, trace_ema
        with np.errstate(divide="ignore", invalid="ignore"):
            out[f"{group}/gns"] = trace_ema / sq_norm_ema
        out[f"{group}/ema_steps"] = seen
    results = pd.DataFrame(out)
    info = dict(groups=groups, incomplete=incomplete, never_measured=never, mixed_batch_rows=mixed_batch_rows,
                log_rows=len(df), comparison=compare_layernorm(results, alpha) if "LayerNorm" in groups else None)
    return results, info


def compare_layernorm(results, alpha):
    """How well LayerNorm GNS tracks total GNS: ratio median/mean and Pearson r, after the EMA warm-up."""
    window = math.ceil(1 / (1 - alpha))
    ln, total, seen = (results[c].to_numpy() for c in ("LayerNorm/gns", "total/gns", "total/ema_steps"))
    both = np.isfinite(ln) & np.isfinite(total) & (total != 0)
    warm = both & (seen >= window)
    if not warm.any():
        warm, window = both, 1  # a run shorter than the window: use every step
    ratio = ln[warm] / total[warm]
    pearson = np.nan
    if warm.sum() >= 3 and np.std(ln[warm]) > 0 and np.std(total[warm]) > 0:
        pearson = float(np.corrcoef(ln[warm], total[warm])[0, 1])
    return dict(steps=int(warm.sum()), min_ema_steps=window, ratio_median=float(np.median(ratio)) if len(ratio) else np.nan,
                ratio_mean=float(np.mean(ratio)) if len(ratio) else np.nan, pearson=pearson)


# -- terminal output ----------------------------------------------------------------------------

def plots(results, df):
    x_name, x = x_axis(results)
    sq, tr = results["total/sq_norm_ema"].to_numpy(), results["total/trace_ema"].to_numpy()
    text = ["", f"log10 of the EMAs of tr(S) and |G|^2 (all parameters) over {x_name}:",
            figure([(x, log10_positive(tr), "log10 tr(S)"), (x, log10_positive(sq), "log10 |G|^2")], x_name, "log10"),
            "", "phase plot, log10 tr(S) against log10 |G|^2 (EMAs, all parameters):",
            figure([(log10_positive(sq), log10_positive(tr), "total")], "log10 |G|^2", "log10 tr(S)", scatter=True),
            "", f"GNS over {x_name}:"]
    series = [(x, results[f"{g}/gns"].to_numpy(), f"{g} GNS") for g in ("total", "LayerNorm") if f"{g}/gns" in results]
    if "ddp/gns" in df.columns:
        series.append((x_axis(df)[1], pd.to_numeric(df["ddp/gns"], errors="coerce").to_numpy(dtype=float), "ddp/gns"))
    text.append(figure(series, x_name, "GNS"))
    return "\n".join(text)


def summary(results, info, path, alpha, prefix):
    groups = info["groups"]
    last = results.iloc[-1]
    counts = ", ".join(f"{k} {len(groups[k])}" for k in TYPE_GROUPS if k in groups)
    lines = [f"{path}: {info['log_rows']} rows, {len(results)} steps with GNS measurements under '{prefix}', "
             f"{len(groups['total'])} parameters ({counts})"]
    for what, names in (("incomplete columns, left out", info["incomplete"]), ("never measured, left out", info["never_measured"])):
        if names:
            lines.append(f"  {what}: {', '.join(names[:4])}{' ...' if len(names) > 4 else ''} ({len(names)})")
    if info["mixed_batch_rows"]:
        lines.append(f"  {info['mixed_batch_rows']} steps with different batch sizes across parameters were left out")
    lines.append(f"EMA alpha={alpha} (averages over ~{1 / (1 - alpha):.0f} steps); the EMA of all parameters "
                 f"has seen {int(last['total/ema_steps'])} measured steps")
    where = f"step {int(last['step'])}"
    if "tokens_processed" in results and np.isfinite(last["tokens_processed"]):
        where += f", {last['tokens_processed']:,.0f} tokens"
    lines.append(f"at the last step ({where}), B = {last['batch_size']:.0f}:")
    lines.append(f"  {'group':<10} {'GNS':>12} {'|G|^2':>12} {'tr(S)':>12} {'params':>7}")
    for g in ["total"] + [k for k in TYPE_GROUPS if k in groups]:
        lines.append(f"  {g:<10} {last[f'{g}/gns']:>12.4g} {last[f'{g}/sq_norm_ema']:>12.4g} "
                     f"{last[f'{g}/trace_ema']:>12.4g} {len(groups[g]):>7}")
    blocks = [g for g in groups if g.startswith("h.")]
    if blocks:
        cells = [f"{b} {last[f'{b}/gns']:.4g}" for b in blocks]
        lines.append("  GNS per block: " + ", ".join(cells[:12]) + (" ..." if len(cells) > 12 else ""))
    c = info["comparison"]
    if c is None:
        lines.append("LayerNorm vs total: no LayerNorm parameters in the log")
    elif c["steps"] == 0:
        lines.append("LayerNorm vs total: no step where both GNS are defined")
    else:
        lines.append(f"LayerNorm vs total GNS over {c['steps']} steps (EMA seen >= {c['min_ema_steps']}): "
                     f"ratio LN/total median {c['ratio_median']:.3f}, mean {c['ratio_mean']:.3f}; "
                     f"Pearson r {c['pearson']:.3f}")
    return "\n".join(lines)


def alpha_type(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{value} is outside [0, 1)")
    return value


def main(argv=None):
    parser = ToolParser(
        prog="gns-analysis.py",
        description="Gradient noise scale (GNS) of a run from the per-parameter norms in OUT_DIR/log.csv: "
                    "unbiased per-step estimates of |G|^2 and tr(S) (McCandlish et al. 2018, App. A), "
                    "summed over parameter groups, smoothed separately, GNS = EMA(tr S) / EMA(|G|^2). "
                    "Prints a summary and terminal plots; writes OUT_DIR/gns_analysis.csv.")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="the run's output directory (holding log.csv), or a log CSV file")
    parser.add_argument("--alpha", type=alpha_type, default=0.99,
                        help="EMA smoothing factor in [0, 1): ema = alpha * ema + (1 - alpha) * estimate at each "
                             "measured step, bias-corrected at the start; averages over ~1/(1 - alpha) steps; "
                             "0 = no smoothing (default: 0.99)")
    parser.add_argument("--prefix", default="train/gns",
                        help="column prefix of the GNS measurements, as in PREFIX/<param>/norm (default: train/gns)")
    parser.add_argument("--no-plots", action="store_true", help="print only the summary (default: plots too)")
    args = parser.parse_args(argv)

    try:
        df, path = load_log(args.out_dir)
        results, info = analyze(df, args.alpha, args.prefix)
    except (LogError, AnalysisError) as e:
        print(f"gns-analysis.py: error: {e}", file=sys.stderr)
        return 1
    if not args.no_plots:
        print(plots(results, df))
        print()
    print(summary(results, info, path, args.alpha, args.prefix.rstrip("/")))
    out_path = os.path.join(os.path.dirname(path), "gns_analysis.csv")
    try:
        results.to_csv(out_path, index=False)
    except OSError as e:
        print(f"gns-analysis.py: error: cannot write {out_path} ({e.strerror})", file=sys.stderr)
        return 1
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    run_main(main)
