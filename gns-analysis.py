"""
Gradient noise scale of a run, computed offline from the raw norms in log.csv, for every GNS
estimator the run logged, side by side.

    python gns-analysis.py out-shakespeare-char
    python gns-analysis.py out --alpha 0.999 --no-plots
    python gns-analysis.py out --prefix train/microbatch_gns

Estimators. A per-parameter estimator PREFIX logs for every parameter p and step |G_B|
(`PREFIX/p/norm`, the norm of the mean gradient over the B examples of the step), |G_b|
(`PREFIX/p/pegn`, the root mean square of the norms of mean gradients over b examples), B
(`PREFIX/p/batch_size`, which may change from step to step) and, where b > 1, b
(`PREFIX/p/small_batch_size`; b = 1 when the column is absent). Found in a log:
    train/gns             exact per-example norms of every parameter (gnstracking.py), b = 1
    train/gnshooks        exact per-example norms from Linear hooks (gnshooks.py), b = 1
    train/sogns           the SOGNS approximation of those (gnshooks.py), b = 1
    train/microbatch_gns  one gradient-accumulation micro-batch per rank as the small batch, b > 1
and any other PREFIX with PREFIX/<param>/norm, /pegn, /batch_size columns (parameter names have
no '/'). The DDP estimator (ddpgns.py) logs totals over the whole model instead:
ddp/big_batch_norm, ddp/small_batch_norm, ddp/big_batch_size (B), ddp/small_batch_size (b, one
rank's batch); it is analysed as an estimator `ddp` with a single group. Its online EMA columns
(ddp/gtg, ddp/trsigma, ddp/gns, with its own beta) are not used: everything is recomputed here.

For a group of parameters (all, one layer type, one transformer block) the squared norms are
summed over the group first, then McCandlish et al. 2018 ("An Empirical Model of Large-Batch
Training", App. A, B_small = b, B_big = B) give unbiased per-step estimates of the true
gradient's squared norm and of the trace of the per-example gradient covariance S:

    |G|^2  ~ (B |G_B|^2 - b |G_b|^2) / (B - b)
    tr(S)  ~ (|G_b|^2 - |G_B|^2) / (1/b - 1/B)

(from E|G_n|^2 = |G|^2 + tr(S)/n at n = b and n = B). A step where B = b (one micro-batch on one
process) carries no information and is skipped, as is a step where the group's parameters have
different B or b.

Single-step estimates are very noisy (|G|^2 is often negative), so each is smoothed on its own
with an exponential moving average over the steps that have an estimate,

    ema_t = alpha * ema_{t-1} + (1 - alpha) * x_t,   ema_0 = 0,   reported as ema_t / (1 - alpha^t)

(the division is Adam's bias correction: without it the zero start drags early values down; with
it the first value is x_1 and every later one a weighted mean with weights alpha^age). alpha = 0.99
averages over roughly the last 1/(1 - alpha) = 100 measured steps. The noise scale is the ratio
of the two averages, GNS = EMA(tr(S)) / EMA(|G|^2), never an average of per-step ratios (a ratio
of noisy estimates is biased and explodes where |G|^2 crosses zero).

The main estimator (--prefix, default train/gns, the exact one) is broken down into groups: total
(all parameters), LayerNorm (names with ln_*), Embedding (wte, wpe), Linear (the rest), and each
transformer block h.N. GPT ties lm_head to wte, so transformer.wte.weight (its first name)
carries the head's share of the gradient too and sits in Embedding. The paper's question (Gray et
al. 2024): how well does the LayerNorm-only GNS track the total? Answered with the ratio LayerNorm
GNS / total GNS (median and mean) and their Pearson correlation over the steps where the EMA has
filled its window (all steps if the run is shorter).

Every other estimator gets its total, compared with the main estimator's total the same way (ratio
of GNS, median over the run, and Pearson r). The Linear hooks cover only some parameters (not
LayerNorm, Embedding or the tied head), so where an estimator covers other parameters than the
main one, both are also summed over just the parameters they share and compared on those.

Writes OUT_DIR/gns_analysis.csv with, per step that has a measurement from any estimator:
  main estimator, per group:  {group}/sq_norm and {group}/trace (the per-step estimates),
      {group}/sq_norm_ema, {group}/trace_ema, {group}/gns and {group}/ema_steps (estimates the EMA
      has seen); and batch_size, small_batch_size (the main estimator's B and b);
  every other estimator E:    E/total/... (the same six), E/batch_size, E/small_batch_size;
      where E and the main one cover different parameters, also E/common/... (E summed over the
      parameters both cover) and E/main_common/... (the main estimator over the same ones).
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
KINDS = ("norm", "pegn", "batch_size", "small_batch_size")
# known estimators, in the order they are tried as the main one and listed; others follow, ddp last
KNOWN_PREFIXES = ["train/gns", "train/gnshooks", "train/sogns", "train/microbatch_gns"]
DDP = "ddp"
DDP_NAME = "(whole model)"  # the DDP estimator's one pseudo-parameter: it logs model totals
DDP_COLUMNS = {"norm": "ddp/big_batch_norm", "pegn": "ddp/small_batch_norm",
               "batch_size": "ddp/big_batch_size", "small_batch_size": "ddp/small_batch_size"}
EMA_COLUMNS = ("sq_norm", "trace", "sq_norm_ema", "trace_ema", "gns", "ema_steps")


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


def unbiased_estimates(big_sq, small_sq, B, b=1):
    """
    McCandlish et al. 2018, App. A with B_small = b, B_big = B: estimates of (|G|^2, tr(S)) from
    |G_B|^2 and |G_b|^2. Arrays or floats; NaN where B <= b (nothing to estimate from) or b < 1.
    """
    B, b = np.asarray(B, dtype=float), np.asarray(b, dtype=float)
    ok = (b >= 1) & (B > b)
    B, b = np.where(ok, B, np.nan), np.where(ok, b, np.nan)
    sq_norm = (B * big_sq - b * small_sq) / (B - b)
    trace = (small_sq - big_sq) / (1 / b - 1 / B)
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


def find_estimators(df):
    """
    {prefix: {parameter name: {kind: column}}} of every estimator in the log: each prefix with a
    column PREFIX/<name>/<kind> (kind in KINDS, a name without '/'), and 'ddp' with one
    pseudo-parameter when the four raw ddp/ columns are there. Known prefixes first, then the
    others in the order of their first column, ddp last.
    """
    found = {}
    for col in df.columns:
        parts = col.rsplit("/", 2)
        if len(parts) == 3 and all(parts) and parts[2] in KINDS:
            found.setdefault(parts[0], {}).setdefault(parts[1], {})[parts[2]] = col
    # a prefix is an estimator if one of its parameters has the norm and pegn pair
    found = {p: names for p, names in found.items() if any({"norm", "pegn"} <= set(c) for c in names.values())}
    order = [p for p in KNOWN_PREFIXES if p in found] + [p for p in found if p not in KNOWN_PREFIXES]
    estimators = {p: found[p] for p in order}
    if all(c in df.columns for c in DDP_COLUMNS.values()) and DDP not in estimators:
        estimators[DDP] = {DDP_NAME: dict(DDP_COLUMNS)}
    return estimators


def load_estimator(df, prefix, columns):
    """
    One estimator's raw numbers over all log rows: dict with names (parameters with at least one
    measurement), index (name -> column), big_sq, small_sq, B, b, measured ([rows, params]),
    incomplete and never (names left out). Raises AnalysisError if nothing is left.
    """
    def numeric(col):
        return pd.to_numeric(df[col], errors="coerce").to_numpy(dtype=float)

    complete = {n: c for n, c in columns.items() if {"norm", "pegn", "batch_size"} <= set(c)}
    incomplete = sorted(set(columns) - set(complete))
    if not complete:
        has = ", ".join(sorted(columns[incomplete[0]]))
        raise AnalysisError(f"the GNS columns under '{prefix}' are incomplete (each parameter needs "
                            f"/norm, /pegn and /batch_size; e.g. {incomplete[0]} has {has})")
    names = list(complete)
    big_sq = np.stack([numeric(complete[n]["norm"]) ** 2 for n in names], axis=1)  # [rows, params]
    small_sq = np.stack([numeric(complete[n]["pegn"]) ** 2 for n in names], axis=1)
    B = np.stack([numeric(complete[n]["batch_size"]) for n in names], axis=1)
    # b = 1 (per-example) unless the estimator logs its small batch size
    b = np.stack([numeric(complete[n]["small_batch_size"]) if "small_batch_size" in complete[n]
                  else np.ones(len(df)) for n in names], axis=1)
    measured = np.isfinite(big_sq) & np.isfinite(small_sq) & np.isfinite(B) & np.isfinite(b)
    keep = measured.any(0)
    if not keep.any():
        raise AnalysisError(f"the GNS columns under '{prefix}' hold no numbers yet")
    never = [n for n, k in zip(names, keep) if not k]
    names = [n for n, k in zip(names, keep) if k]
    return dict(prefix=prefix, names=names, index={n: i for i, n in enumerate(names)}, big_sq=big_sq[:, keep],
                small_sq=small_sq[:, keep], B=B[:, keep], b=b[:, keep], measured=measured[:, keep],
                incomplete=incomplete, never=never)


def group_estimates(est, members):
    """
    (sq_norm, trace, B, b, mixed) per log row for the parameters `members` of an estimator: the
    squared norms summed over the members first, then the estimators. A row counts only if every
    member was measured with one B and one b (mixed: rows left out for differing B or b);
    NaN elsewhere, and where B <= b.
    """
    cols = [est["index"][n] for n in members]
    B, b = est["B"][:, cols[0]], est["b"][:, cols[0]]
    all_measured = est["measured"][:, cols].all(1)
    same = (est["B"][:, cols] == B[:, None]).all(1) & (est["b"][:, cols] == b[:, None]).all(1)
    ok = all_measured & same
    # summing |G_b|^2 over parameters is fine for any b: each is a mean over the same micro-batches
    sq_norm, trace = unbiased_estimates(est["big_sq"][:, cols].sum(1), est["small_sq"][:, cols].sum(1), B, b)
    return (np.where(ok, sq_norm, np.nan), np.where(ok, trace, np.nan), np.where(ok, B, np.nan),
            np.where(ok, b, np.nan), int((all_measured & ~same).sum()))


def smoothed(sq_norm, trace, alpha, name):
    """The six per-step columns of a group, under `name/`: raw estimates, their EMAs, GNS, EMA count."""
    sq_norm_ema, seen = debiased_ema(sq_norm, alpha)
    trace_ema, _ = debiased_ema(trace, alpha)
    with np.errstate(divide="ignore", invalid="ignore"):
        gns = trace_ema / sq_norm_ema
    return {f"{name}/{k}": v for k, v in zip(EMA_COLUMNS, (sq_norm, trace, sq_norm_ema, trace_ema, gns, seen))}


def main_groups(names, prefix):
    """The main estimator's groups: total, LayerNorm/Linear/Embedding (those present), then h.N in order."""
    groups = {"total": names}
    if prefix == DDP:
        return groups
    for kind in TYPE_GROUPS:
        members = [n for n in names if layer_type(n) == kind]
        if members:
            groups[kind] = members
    blocks = sorted({block_of(n) for n in names} - {None}, key=lambda b: int(b[2:]))
    for b in blocks:
        groups[b] = [n for n in names if block_of(n) == b]
    return groups


def choose_main(df, estimators, prefix):
    """
    (main prefix, {prefix: loaded estimator} of the usable ones, note or None). The main one is
    `prefix` if usable; otherwise the first usable estimator, with a note saying why. Raises
    AnalysisError when no estimator is usable.
    """
    loaded, problems = {}, {}
    for p, columns in estimators.items():
        try:
            loaded[p] = load_estimator(df, p, columns)
        except AnalysisError as e:
            problems[p] = str(e)
    if prefix in loaded:
        return prefix, loaded, None
    if prefix in problems:
        why = problems[prefix]
    elif loaded:
        why = f"no GNS columns '{prefix}/<parameter>/norm, /pegn, /batch_size' in the log"
    else:
        examples = ", ".join(list(df.columns[1:6])) or "none"
        why = (f"no GNS columns '{prefix}/<parameter>/norm, /pegn, /batch_size' in the log "
               f"(its columns start with: {examples})")
    if not loaded:
        others = [p for p in problems if p != prefix]
        also = f"; under {', '.join(others)}: none usable either" if others else ""
        raise AnalysisError(f"{why}{also}; is --prefix right?")
    main = next(iter(loaded))
    return main, loaded, f"{why}; showing '{main}' instead (estimators in the log: {', '.join(loaded)})"


def analyze(df, alpha, prefix="train/gns"):
    """
    (results DataFrame, info dict) for a loaded log: the main estimator (`prefix`, or the first
    usable one if it is absent) per group, every other estimator's total, and their comparison
    with the main one. Raises AnalysisError.
    """
    prefix = prefix.rstrip("/")
    main, loaded, note = choose_main(df, find_estimators(df), prefix)
    est = loaded[main]
    groups = main_groups(est["names"], main)

    out = {"step": df["step"].to_numpy()}
    for col in ("iter_num", "tokens_processed"):
        if col in df.columns:
            out[col] = pd.to_numeric(df[col], errors="coerce").to_numpy(dtype=float)
    mixed_batch_rows = 0
    for group, members in groups.items():
        sq_norm, trace, B, b, mixed = group_estimates(est, members)
        if group == "total":
            out["batch_size"], out["small_batch_size"], mixed_batch_rows = B, b, mixed
        out.update(smoothed(sq_norm, trace, alpha, group))

    others = {}
    for p, other in loaded.items():
        if p == main:
            continue
        sq_norm, trace, B, b, mixed = group_estimates(other, other["names"])
        out.update(smoothed(sq_norm, trace, alpha, f"{p}/total"))
        out[f"{p}/batch_size"], out[f"{p}/small_batch_size"] = B, b
        # the same parameters on both sides, where they cover different ones (the Linear hooks)
        shared = [n for n in other["names"] if n in est["index"]]
        differ = len(shared) < len(other["names"]) or len(shared) < len(est["names"])
        if shared and differ:
            out.update(smoothed(*group_estimates(other, shared)[:2], alpha, f"{p}/common"))
            out.update(smoothed(*group_estimates(est, shared)[:2], alpha, f"{p}/main_common"))
        others[p] = dict(params=len(other["names"]), shared=len(shared), common=shared if shared and differ else None,
                         mixed_batch_rows=mixed, incomplete=other["incomplete"], never_measured=other["never"])

    # keep the rows where any estimator measured anything; the EMAs carry over the others
    rows = np.zeros(len(df), dtype=bool)
    for e in loaded.values():
        rows |= e["measured"].any(1)
    main_rows = int(est["measured"].any(1).sum())
    results = pd.DataFrame(out)[rows].reset_index(drop=True)

    for p, o in others.items():
        o["comparison"] = compare(results[f"{p}/total/gns"], results["total/gns"],
                                  np.minimum(results[f"{p}/total/ema_steps"], results["total/ema_steps"]), alpha)
        if o["common"] is not None:
            o["common_comparison"] = compare(
                results[f"{p}/common/gns"], results[f"{p}/main_common/gns"],
                np.minimum(results[f"{p}/common/ema_steps"], results[f"{p}/main_common/ema_steps"]), alpha)
    ln = None
    if "LayerNorm" in groups:
        ln = compare(results["LayerNorm/gns"], results["total/gns"],
                     np.minimum(results["LayerNorm/ema_steps"], results["total/ema_steps"]), alpha)
    info = dict(main=main, requested=prefix, note=note, groups=groups, incomplete=est["incomplete"],
                never_measured=est["never"], mixed_batch_rows=mixed_batch_rows, log_rows=len(df),
                main_rows=main_rows, comparison=ln, estimators=others)
    return results, info


def ema_window(alpha):
    """~1/(1 - alpha), the estimates an EMA averages over, as a whole number (1 - 0.8 is not exactly 0.2)."""
    return math.ceil(round(1 / (1 - alpha), 6))


def compare(numerator, denominator, seen, alpha):
    """
    How well one GNS series tracks another: ratio numerator/denominator (median, mean) and Pearson
    r over the steps where both are defined and both EMAs have filled their window (min_ema_steps,
    ~1/(1 - alpha) estimates); over every step where both are defined if the run is shorter.
    """
    a, d, seen = (np.asarray(v, dtype=float) for v in (numerator, denominator, seen))
    window = ema_window(alpha)
    both = np.isfinite(a) & np.isfinite(d) & (d != 0)
    warm = both & (seen >= window)
    if not warm.any():
        warm, window = both, 1  # a run shorter than the window: use every step
    ratio = a[warm] / d[warm]
    pearson = np.nan
    if warm.sum() >= 3 and np.std(a[warm]) > 0 and np.std(d[warm]) > 0:
        pearson = float(np.corrcoef(a[warm], d[warm])[0, 1])
    return dict(steps=int(warm.sum()), min_ema_steps=window, ratio_median=float(np.median(ratio)) if len(ratio) else np.nan,
                ratio_mean=float(np.mean(ratio)) if len(ratio) else np.nan, pearson=pearson)


# -- terminal output ----------------------------------------------------------------------------

def plots(results, df, info):
    x_name, x = x_axis(results)
    main = info["main"]
    sq, tr = results["total/sq_norm_ema"].to_numpy(), results["total/trace_ema"].to_numpy()
    text = ["", f"log10 of the EMAs of tr(S) and |G|^2 ({main}, all its parameters) over {x_name}:",
            figure([(x, log10_positive(tr), "log10 tr(S)"), (x, log10_positive(sq), "log10 |G|^2")], x_name, "log10"),
            "", f"phase plot, log10 tr(S) against log10 |G|^2 ({main} EMAs, all its parameters):",
            figure([(log10_positive(sq), log10_positive(tr), "total")], "log10 |G|^2", "log10 tr(S)", scatter=True),
            "", f"GNS over {x_name}:"]
    series = [(x, results[f"{g}/gns"].to_numpy(), f"{main} {g}") for g in ("total", "LayerNorm") if f"{g}/gns" in results]
    series += [(x, results[f"{p}/total/gns"].to_numpy(), f"{p} total") for p in info["estimators"]]
    if DDP not in info["estimators"] and main != DDP and "ddp/gns" in df.columns:
        # an older log with only the online DDP estimate (its own EMA), not the raw norms
        series.append((x_axis(df)[1], pd.to_numeric(df["ddp/gns"], errors="coerce").to_numpy(dtype=float),
                       "ddp/gns (online EMA)"))
    text.append(figure(series, x_name, "GNS"))
    return "\n".join(text)


def last_finite(values):
    values = np.asarray(values, dtype=float)
    ok = np.isfinite(values)
    return values[ok][-1] if ok.any() else np.nan


def left_out_lines(what_names, indent="  "):
    lines = []
    for what, names in what_names:
        if names:
            lines.append(f"{indent}{what}: {', '.join(names[:4])}{' ...' if len(names) > 4 else ''} ({len(names)})")
    return lines


def summary(results, info, path, alpha):
    groups, main = info["groups"], info["main"]
    last = results.iloc[-1]
    if main == DDP:
        covered = "totals over the whole model (DDP: small batch = one rank's batch)"
    else:
        counts = ", ".join(f"{k} {len(groups[k])}" for k in TYPE_GROUPS if k in groups)
        covered = f"{len(groups['total'])} parameters ({counts})"
    lines = [f"{path}: {info['log_rows']} rows, {info['main_rows']} steps with GNS measurements under '{main}', {covered}"]
    if info["note"]:
        lines.append(f"  note: {info['note']}")
    lines += left_out_lines([("incomplete columns, left out", info["incomplete"]),
                             ("never measured, left out", info["never_measured"])])
    if info["mixed_batch_rows"]:
        lines.append(f"  {info['mixed_batch_rows']} steps with different batch sizes across parameters were left out")
    seen = int(last["total/ema_steps"])
    lines.append(f"EMA alpha={alpha} (averages over ~{1 / (1 - alpha):.0f} steps); the EMA of all parameters "
                 f"has seen {seen} measured steps")
    if seen == 0:
        lines.append(f"  no step under '{main}' has B > B_small (one micro-batch on one process?): nothing to estimate")
    where = f"step {int(last['step'])}"
    if "tokens_processed" in results and np.isfinite(last["tokens_processed"]):
        where += f", {last['tokens_processed']:,.0f} tokens"
    B, b = last_finite(results["batch_size"]), last_finite(results["small_batch_size"])
    lines.append(f"at the last step ({where}), B = {B:.0f}" + (f", B_small = {b:.0f}:" if b != 1 else ":"))
    lines.append(f"  {'group':<10} {'GNS':>12} {'|G|^2':>12} {'tr(S)':>12} {'params':>7}")
    for g in ["total"] + [k for k in TYPE_GROUPS if k in groups]:
        lines.append(f"  {g:<10} {last[f'{g}/gns']:>12.4g} {last[f'{g}/sq_norm_ema']:>12.4g} "
                     f"{last[f'{g}/trace_ema']:>12.4g} {len(groups[g]) if main != DDP else '-':>7}")
    blocks = [g for g in groups if g.startswith("h.")]
    if blocks:
        cells = [f"{b} {last[f'{b}/gns']:.4g}" for b in blocks]
        lines.append("  GNS per block: " + ", ".join(cells[:12]) + (" ..." if len(cells) > 12 else ""))
    c = info["comparison"]
    if c is None:
        if main != DDP:
            lines.append("LayerNorm vs total: no LayerNorm parameters in the log")
    elif c["steps"] == 0:
        lines.append("LayerNorm vs total: no step where both GNS are defined")
    else:
        lines.append(f"LayerNorm vs total GNS over {c['steps']} steps (EMA seen >= {c['min_ema_steps']}): "
                     f"ratio LN/total median {c['ratio_median']:.3f}, mean {c['ratio_mean']:.3f}; "
                     f"Pearson r {c['pearson']:.3f}")
    lines += estimator_table(results, info, alpha)
    return "\n".join(lines)


def estimator_table(results, info, alpha):
    """Every estimator at the last step side by side, and how each other one tracks the main one."""
    main, others = info["main"], info["estimators"]
    if not others:
        return [f"estimators in the log: {main} only"]
    window = ema_window(alpha)
    lines = [f"every estimator in the log at the last step; ratio (median) and Pearson r of its GNS against",
             f"{main}'s, over the steps where both EMAs have seen >= {window} estimates (all steps if none has):",
             f"  {'estimator':<22} {'B_small':>7} {'GNS':>10} {'|G|^2':>10} {'tr(S)':>10} {'params':>7} "
             f"{'steps':>6} {'ratio':>7} {'r':>6}"]

    def row(name, col, b, params, extra=""):
        cells = [f"{last_finite(results[f'{col}/{k}']):>10.4g}" for k in ("gns", "sq_norm_ema", "trace_ema")]
        b = f"{b:.0f}" if np.isfinite(b) else "-"
        seen = int(results[f"{col}/ema_steps"].iloc[-1])
        return f"  {name:<22} {b:>7} {' '.join(cells)} {params:>7} {seen:>6}{extra}"

    main_params = "model" if main == DDP else len(info["groups"]["total"])
    lines.append(row(main + " (main)", "total", last_finite(results["small_batch_size"]), main_params))
    for p, o in others.items():
        c = o["comparison"]
        extra = f" {c['ratio_median']:>7.3f} {c['pearson']:>6.3f}" if c["steps"] else f" {'-':>7} {'-':>6}"
        if o["common"] is not None:
            cc = o["common_comparison"]
            extra += (f"  on the {len(o['common'])} shared params: ratio {cc['ratio_median']:.3f}, r {cc['pearson']:.3f}"
                      if cc["steps"] else f"  on the {len(o['common'])} shared params: no step where both are defined")
        elif p != DDP and main != DDP and not o["shared"]:
            extra += "  (no parameter in common)"
        elif p != DDP and main != DDP:
            extra += "  (same parameters)"
        lines.append(row(p, f"{p}/total", last_finite(results[f"{p}/small_batch_size"]),
                         "model" if p == DDP else o["params"], extra))
        if int(results[f"{p}/total/ema_steps"].iloc[-1]) == 0:
            lines.append(f"    {p}: no step with B > B_small (one micro-batch on one process?): nothing to estimate")
        lines += left_out_lines([("incomplete columns, left out", o["incomplete"]),
                                 ("never measured, left out", o["never_measured"])], indent=f"    {p}: ")
        if o["mixed_batch_rows"]:
            lines.append(f"    {p}: {o['mixed_batch_rows']} steps with different batch sizes across parameters were left out")
    return lines


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
        description="Gradient noise scale (GNS) of a run from the raw gradient norms in OUT_DIR/log.csv: "
                    "unbiased per-step estimates of |G|^2 and tr(S) (McCandlish et al. 2018, App. A), "
                    "summed over parameter groups, smoothed separately, GNS = EMA(tr S) / EMA(|G|^2). "
                    "Every estimator in the log is analysed (exact per-example train/gns, Linear hooks "
                    "train/gnshooks, SOGNS train/sogns, micro-batch train/microbatch_gns, DDP ddp/...) and "
                    "compared with the main one. Prints a summary and terminal plots; writes "
                    "OUT_DIR/gns_analysis.csv.")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="the run's output directory (holding log.csv), or a log CSV file")
    parser.add_argument("--alpha", type=alpha_type, default=0.99,
                        help="EMA smoothing factor in [0, 1): ema = alpha * ema + (1 - alpha) * estimate at each "
                             "measured step, bias-corrected at the start; averages over ~1/(1 - alpha) steps; "
                             "0 = no smoothing (default: 0.99)")
    parser.add_argument("--prefix", default="train/gns",
                        help="the main estimator, broken down by parameter group and the one the others are "
                             "compared with: the column prefix PREFIX/<param>/norm, or 'ddp' for the DDP "
                             "estimator; if the log lacks it, the first estimator present is used, with a "
                             "note (default: train/gns)")
    parser.add_argument("--no-plots", action="store_true", help="print only the summary (default: plots too)")
    args = parser.parse_args(argv)

    try:
        df, path = load_log(args.out_dir)
        results, info = analyze(df, args.alpha, args.prefix)
    except (LogError, AnalysisError) as e:
        print(f"gns-analysis.py: error: {e}", file=sys.stderr)
        return 1
    if not args.no_plots:
        print(plots(results, df, info))
        print()
    print(summary(results, info, path, args.alpha))
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
