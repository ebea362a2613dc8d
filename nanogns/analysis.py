"""
Gradient noise scale of a run, offline, from the raw norms in log.csv, for every GNS estimator the
run logged, side by side: the package's `gns-analysis` command (nanogns.commands), which the clone's
gns-analysis.py runs too.

    gns-analysis out-shakespeare-char
    gns-analysis out --alpha 0.999 --no-plots
    gns-analysis out --prefix train/microbatch_gns

Each estimator's columns (named in nanogns/maths.py: PREFIX/<param>/norm, /pegn, /batch_size and
/small_batch_size, or the DDP estimator's ddp/ totals) are summed over a group of parameters, then
give per-step estimates of |G|^2 and tr(S) (McCandlish et al. 2018, "An Empirical Model of
Large-Batch Training", App. A), each smoothed on its own by the bias-corrected EMA over the steps
that have one; GNS = EMA(tr S) / EMA(|G|^2). The maths is nanogns/maths.py's, the training run's.

The main estimator (--prefix, default train/gns) is broken down by layer type (the kinds recorded
when the layers were measured, OUT_DIR/layer_kinds.json, else GPT's parameter names) and
transformer block, and its normalisation-only GNS (the group named LayerNorm, RMSNorm or both,
after what the model has) compared with the total (Gray et al. 2024: the LayerNorm gradients
alone predict the GNS); every other estimator's total is compared with the main one's,
also on just the parameters both cover where they cover different ones.

Writes OUT_DIR/gns_analysis.csv: per group the estimates, their EMAs, the GNS and the EMA's count,
and the reference implementation's columns (--help says why their numbers differ). Reads the
reference's logs too, leaving out, with a note, what it measures wrong: its tied weight, and its
DDP columns under float16. Cells that are not finite numbers, and numbers no measurement gives (a
negative norm, a batch size below 1 or not whole, a small batch above the batch), are left out with
their step and named; a step logged twice keeps its later copy, with a warning where the copies
differ (nanogns.logread).

Exit status: 0 done; 2 bad input (usage, a missing, unreadable or invalid log, a --prefix that is
not in it), one line on stderr; 1 the result could not be written, one line on stderr.
"""
import argparse
import json
import math
import os
import re
import sys

import numpy as np
import pandas as pd

from nanogns.logread import (REFERENCE_PAIR, LogError, ToolParser, figure, load_log, log10_positive, log_columns,
                       x_axis)
from nanogns.maths import (EMA_BETA, KINDS, KINDS_NAME, NORM_CELLS, PREFIXES, REACHED_CELL, REQUIRED_CELLS, WRITER,  # noqa: F401
                     WRITER_KEY, debiased_ema, layer_groups, layer_type, parse_column, total_columns, unbiased_estimates)
from nanogns.extras import extra_missing
from nanogns.figures import GNS_FIGURE, NORM_FIGURE, PIXELS, write_figures  # matplotlib loads only when drawing
from nanogns.refusals import module_refusals
from nanogns.runlog import atomic_write

# known estimators, in the order they are tried as the main one and listed; others follow, ddp last
# train/gnshooks: the hooks' prefix before it became train/hooks_gns (the reference's readers
# take every column starting with train/gns for theirs)
KNOWN_PREFIXES = [PREFIXES["exact"], PREFIXES["hooks_exact"], "train/gnshooks", PREFIXES["hooks_sogns"],
                  PREFIXES["microbatch"], PREFIXES["adam"]]
DDP = PREFIXES["ddp"]
DDP_NAME = "(whole model)"  # the DDP estimator's one pseudo-parameter: it logs model totals
DDP_COLUMNS = total_columns(DDP)
DDP_GNS = f"{DDP}/gns"  # the DDP estimator's own online GNS (GradientNoiseScale.get_msg)
EMA_COLUMNS = ("sq_norm", "trace", "sq_norm_ema", "trace_ema", "gns", "ema_steps")
# the reference's gns_analysis.csv columns, from the main estimator's total: {ours: reference's}
REFERENCE_COLUMNS = {"total/sq_norm": "gtg", "total/trace": "trsigma", "total/sq_norm_ema": "gtg_ema",
                     "total/trace_ema": "trsigma_ema", "total/gns": "gns"}
TIED = ("wte", "lm_head")  # the reference's analysis leaves out every parameter whose name holds one
NOT_NUMBERS = ("nan", "-nan", "+nan")  # text that is a (non-finite) number
# what load_estimator tells of the cells it left out, carried into analyze's info for the summary
CELL_REPORTS = ("overflow_steps", "bad_cells", "bad_examples", "out_of_range", "out_of_range_examples")
SHOWN_CELLS = 5  # cells named in the summary's line on each kind of cell left out
# an expert that fewer examples than this reach per step, on average, has a noisy GNS: the summary says so
FEW_REACHED = 8
EXPERT_NAME = re.compile(r"^(.*)\.[^.\[\]]+\[(\d+)\]$")  # <experts module>.<weight>[e]: one expert's weight
LISTED_EXPERT = re.compile(r"^(.*experts?)\.(\d+)\.")  # <experts list>.<e>.<...>: experts written as Linears


class AnalysisError(Exception):
    """The log has no usable GNS data; the message is one line for the user."""


def block_of(name):
    """'h.3' for transformer.h.3.attn.c_attn.weight, None outside the blocks."""
    m = re.search(r"(?:^|\.)h\.(\d+)\.", name)
    return f"h.{m.group(1)}" if m else None


def analysis_columns(columns):
    """The log columns the analysis reads: every GNS column, the DDP ones, the x axes, and the examples
    that reached each expert of a mixture of experts (PREFIX/<experts>[e]/reached)."""
    extra = {"step", "iter_num", "tokens_processed", DDP_GNS, *DDP_COLUMNS.values()}
    return [c for c in columns if c in extra or parse_column(c) or c.endswith(f"]/{REACHED_CELL}")]


def expert_groups(names, kinds=None):
    """{expert: its weights' names} of a mixture of experts' experts among `names`, in order: each weight
    measured per expert, <experts module>.<weight>[e], and (where the kinds recorded say "experts")
    experts written as Linears, <experts list>.<e>.<...>; the expert is <experts module or list>[e]."""
    groups = {}
    for name in names:
        m = EXPERT_NAME.match(name)
        if m is None and (kinds or {}).get(name) == "experts":
            m = LISTED_EXPERT.match(name)
        if m:
            groups.setdefault(f"{m.group(1)}[{m.group(2)}]", []).append(name)
    return groups


def expert_reach(df, prefix, experts):
    """{expert: the examples that reached it at each row (NaN where not logged)} of those in `experts`
    whose PREFIX/<expert>/reached column the log has."""
    reach = {}
    for expert in experts:
        col = f"{prefix}/{expert}/{REACHED_CELL}"
        if col in df.columns:
            reach[expert] = pd.to_numeric(df[col], errors="coerce").to_numpy(dtype=float)
    return reach


def tied_columns(columns):
    """The per-parameter GNS columns of the tied weight wte = lm_head (names holding 'wte' or 'lm_head')."""
    return [c for c in columns if parse_column(c) and any(t in parse_column(c)[1] for t in TIED)]


def find_estimators(df):
    """
    {prefix: {parameter name: {kind: column}}} of every estimator in the log: each prefix with a
    column PREFIX/<name>/<kind> (kind in nanogns.maths.KINDS, a name without '/'), and 'ddp' with one
    pseudo-parameter when the four raw ddp/ columns are there. Known prefixes first, then the
    others in the order of their first column, ddp last.
    """
    found = {}
    for col in df.columns:
        parts = parse_column(col)
        if parts:
            found.setdefault(parts[0], {}).setdefault(parts[1], {})[parts[2]] = col
    # a prefix is an estimator if one of its parameters has the norm and pegn pair
    found = {p: names for p, names in found.items() if any(set(NORM_CELLS) <= set(c) for c in names.values())}
    order = [p for p in KNOWN_PREFIXES if p in found] + [p for p in found if p not in KNOWN_PREFIXES]
    estimators = {p: found[p] for p in order}
    if all(c in df.columns for c in DDP_COLUMNS.values()) and DDP not in estimators:
        estimators[DDP] = {DDP_NAME: dict(DDP_COLUMNS)}
    return estimators


def read_cells(cells):
    """(values, bad) of a GNS column: its numbers (NaN where empty or text), and the cells that hold
    something other than a finite number (an empty cell, not measured, is not bad)."""
    values = pd.to_numeric(cells, errors="coerce").to_numpy(dtype=float)
    bad = ~np.isfinite(values) & cells.notna().to_numpy()
    return values, bad


def cell_text(cell):
    """A cell as the summary names it: text quoted, a number as it reads ('-0.5', not np.float64(-0.5))."""
    return repr(cell) if isinstance(cell, str) else str(cell)


def out_of_range(kind, values):
    """The finite cells of a column of `kind` that no measurement gives: a negative norm (norm, pegn),
    a batch size (batch_size, small_batch_size) below 1 or not a whole number. (load_estimator also
    leaves out a small_batch_size above its batch_size.)"""
    finite = np.isfinite(values)
    safe = np.where(finite, values, 0.0)
    if kind in NORM_CELLS:
        return finite & (safe < 0)
    return finite & ((safe < 1) | (safe != np.round(safe)))


def load_estimator(df, prefix, columns):
    """
    One estimator's raw numbers over all log rows: dict with names (parameters with at least one
    measurement), index (name -> column), big_sq, small_sq, B, b, measured ([rows, params]),
    incomplete and never (names left out), overflow_steps (steps with a non-finite norm), bad_cells
    and bad_examples (the other cells that are not finite numbers: how many, and the first few as
    'step N name/kind (cell)'), out_of_range and out_of_range_examples (the same of the numbers no
    measurement gives: out_of_range(), and a small_batch_size above its batch_size). A cell left
    out leaves its step out of every group holding its parameter. Raises AnalysisError if nothing
    is left.
    """
    complete = {n: c for n, c in columns.items() if set(REQUIRED_CELLS) <= set(c)}
    incomplete = sorted(set(columns) - set(complete))
    if not complete:
        has = ", ".join(sorted(columns[incomplete[0]]))
        raise AnalysisError(f"the GNS columns under '{prefix}' are incomplete (each parameter needs "
                            f"/norm, /pegn and /batch_size; e.g. {incomplete[0]} has {has})")
    names = list(complete)
    steps = df["step"].to_numpy()
    shape = (len(df), len(names))
    # filled in place, one column at a time: the log holds many parameters over many steps
    big_sq, small_sq, B, b = np.empty(shape), np.empty(shape), np.empty(shape), np.ones(shape)
    overflow = np.zeros(len(df), dtype=bool)
    bad_cells, bad_examples, wrong_cells, wrong_examples = 0, [], 0, []
    for i, name in enumerate(names):
        for kind, out in zip(KINDS, (big_sq, small_sq, B, b)):  # norm, pegn, batch_size, small_batch_size
            if kind not in complete[name]:
                continue  # no small_batch_size: b = 1, per-example
            cells = df[complete[name][kind]]
            values, bad = read_cells(cells)
            wrong = out_of_range(kind, values)
            if wrong.any():
                rows = np.flatnonzero(wrong)
                values = np.where(wrong, np.nan, values)  # a copy: values may be the log's own column
                wrong_cells += len(rows)
                wrong_examples += [f"step {steps[r]} {name}/{kind} ({cell_text(cells.iloc[r])})"
                                   for r in rows[:SHOWN_CELLS - len(wrong_examples)]]
            out[:, i] = values ** 2 if kind in NORM_CELLS else values
            if not bad.any():
                continue
            rows = np.flatnonzero(bad)
            if kind in NORM_CELLS:  # inf or nan written as a number: an overflow
                text = cells.iloc[rows].astype(str).str.strip().str.lower()
                number = np.isinf(values[rows]) | text.isin(NOT_NUMBERS).to_numpy()
                overflow[rows[number]] = True
                rows = rows[~number]
            bad_cells += len(rows)
            bad_examples += [f"step {steps[r]} {name}/{kind} ({cell_text(cells.iloc[r])})"
                             for r in rows[:SHOWN_CELLS - len(bad_examples)]]
        # the small batches are parts of the batch: b > B is no measurement (B == b, one micro-batch, is)
        rows = np.flatnonzero(np.where(np.isfinite(B[:, i]) & np.isfinite(b[:, i]), b[:, i] > B[:, i], False))
        if len(rows):
            B[rows, i] = b[rows, i] = np.nan
            wrong_cells += len(rows)
            cells = df[complete[name]["small_batch_size"]]
            wrong_examples += [f"step {steps[r]} {name}/small_batch_size ({cell_text(cells.iloc[r])} > batch_size "
                               f"{cell_text(df[complete[name]['batch_size']].iloc[r])})"
                               for r in rows[:SHOWN_CELLS - len(wrong_examples)]]
    measured = np.isfinite(big_sq) & np.isfinite(small_sq) & np.isfinite(B) & np.isfinite(b)
    keep = measured.any(0)
    if not keep.any():
        why = f" ({overflow.sum()} steps with non-finite norms)" if overflow.any() else ""
        why += f" ({bad_cells} cells that are not finite numbers, e.g. {bad_examples[0]})" if bad_cells else ""
        why += f" ({wrong_cells} cells out of range, e.g. {wrong_examples[0]})" if wrong_cells else ""
        raise AnalysisError(f"the GNS columns under '{prefix}' hold no numbers yet{why}")
    never = [n for n, k in zip(names, keep) if not k]
    names = [n for n, k in zip(names, keep) if k]
    if not keep.all():
        big_sq, small_sq, B, b, measured = (a[:, keep] for a in (big_sq, small_sq, B, b, measured))
    return dict(prefix=prefix, names=names, index={n: i for i, n in enumerate(names)}, big_sq=big_sq,
                small_sq=small_sq, B=B, b=b, measured=measured, incomplete=incomplete, never=never,
                overflow_steps=steps[overflow].tolist(), bad_cells=bad_cells, bad_examples=bad_examples,
                out_of_range=wrong_cells, out_of_range_examples=wrong_examples)


def group_estimates(est, members):
    """
    Per log row for the parameters `members` of an estimator, a dict: big_sq and small_sq (the
    squared norms summed over the members), sq_norm and trace (the estimates from those sums), B,
    b, and mixed (rows left out for differing B or b). A row counts only if every member was
    measured with one B and one b; NaN elsewhere, and where B <= b.
    """
    cols = [est["index"][n] for n in members]
    B, b = est["B"][:, cols[0]], est["b"][:, cols[0]]
    all_measured = est["measured"][:, cols].all(1)
    same = (est["B"][:, cols] == B[:, None]).all(1) & (est["b"][:, cols] == b[:, None]).all(1)
    ok = all_measured & same
    # summing |G_b|^2 over parameters is fine for any b: each is a mean over the same micro-batches
    big_sq, small_sq = est["big_sq"][:, cols].sum(1), est["small_sq"][:, cols].sum(1)
    sq_norm, trace = unbiased_estimates(big_sq, small_sq, B, b)
    out = dict(big_sq=big_sq, small_sq=small_sq, sq_norm=sq_norm, trace=trace, B=B, b=b)
    out = {k: np.where(ok, v, np.nan) for k, v in out.items()}
    out["mixed"] = int((all_measured & ~same).sum())
    return out


def smoothed(sq_norm, trace, alpha, name):
    """The six per-step columns of a group, under `name/`: raw estimates, their EMAs, GNS, EMA count."""
    sq_norm_ema, seen = debiased_ema(sq_norm, alpha)
    trace_ema, _ = debiased_ema(trace, alpha)
    with np.errstate(divide="ignore", invalid="ignore"):
        gns = trace_ema / sq_norm_ema
    return {f"{name}/{k}": v for k, v in zip(EMA_COLUMNS, (sq_norm, trace, sq_norm_ema, trace_ema, gns, seen))}


def main_groups(names, prefix, kinds=None, norm="layernorm"):
    """The main estimator's groups: total, the layer types present (the normalisation group named
    LayerNorm, RMSNorm or both, then Linear, Embedding: nanogns.maths.layer_groups, by the kinds recorded
    when the layers were measured, else by GPT's names), then h.N in order."""
    groups = {"total": names}
    if prefix == DDP:
        return groups
    groups.update(layer_groups(names, kinds, norm))
    blocks = sorted({block_of(n) for n in names} - {None}, key=lambda b: int(b[2:]))
    for b in blocks:
        groups[b] = [n for n in names if block_of(n) == b]
    return groups


def choose_main(df, estimators, prefix, fallback=True):
    """
    (main prefix, {prefix: loaded estimator} of the usable ones, note or None). The main one is
    `prefix` if usable; otherwise, with fallback, the first usable estimator, with a note saying
    why. Raises AnalysisError when no estimator is usable, or `prefix` is not and not fallback.
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
    if not fallback:
        raise AnalysisError(f"{why}; estimators in the log: {', '.join(loaded)}")
    main = next(iter(loaded))
    return main, loaded, f"{why}; showing '{main}' instead (estimators in the log: {', '.join(loaded)})"


def analyze(df, alpha, prefix="train/gns", fallback=True, kinds=None, norm="layernorm", experts=False):
    """
    (results DataFrame, info dict) for a loaded log: the main estimator (`prefix`, or with
    fallback the first usable one if it is absent) per group, every other estimator's total, and
    their comparison with the main one (info's comparison: the normalisation group's with the
    total, over the results' rows norm_compared); results also hold the reference's columns (module
    docstring). The log is taken as it is: leave out a reference log's tied weight beforehand
    (tied_columns). kinds, norm: how parameters are grouped (read_kinds). experts: also a group for
    each expert of a mixture of experts (its weights), with the examples that reached it. Raises
    AnalysisError.
    """
    prefix = prefix.rstrip("/")
    main, loaded, note = choose_main(df, find_estimators(df), prefix, fallback)
    est = loaded[main]
    groups = main_groups(est["names"], main, kinds, norm)
    each_expert = expert_groups(est["names"], kinds) if main != DDP else {}
    reach = expert_reach(df, main, each_expert)
    type_groups = [g for g in groups if g != "total" and not g.startswith("h.")]
    norm_name = type_groups[0] if type_groups and type_groups[0] not in ("Linear", "Embedding") else None

    out = {"step": df["step"].to_numpy()}
    for col in ("iter_num", "tokens_processed"):
        if col in df.columns:
            out[col] = pd.to_numeric(df[col], errors="coerce").to_numpy(dtype=float)
    mixed_batch_rows = 0
    for group, members in groups.items():
        g = group_estimates(est, members)
        if group == "total":
            out["batch_size"], out["small_batch_size"], mixed_batch_rows = g["B"], g["b"], g["mixed"]
            total = g
        out.update(smoothed(g["sq_norm"], g["trace"], alpha, group))
    for expert, members in each_expert.items() if experts else ():
        g = group_estimates(est, members)
        out.update(smoothed(g["sq_norm"], g["trace"], alpha, expert))
        if expert in reach:
            out[f"{expert}/{REACHED_CELL}"] = reach[expert]
    # the reference's columns (copies of the total's), for code that reads its gns_analysis.csv
    reference = {name: out[ours] for ours, name in REFERENCE_COLUMNS.items()}
    reference.update(sgn=total["big_sq"], spegn=total["small_sq"])
    if DDP_GNS in df.columns:
        reference["ddp_gns"] = pd.to_numeric(df[DDP_GNS], errors="coerce").to_numpy(dtype=float)

    others = {}
    for p, other in loaded.items():
        if p == main:
            continue
        g = group_estimates(other, other["names"])
        out.update(smoothed(g["sq_norm"], g["trace"], alpha, f"{p}/total"))
        out[f"{p}/batch_size"], out[f"{p}/small_batch_size"] = g["B"], g["b"]
        # the same parameters on both sides, where they cover different ones (the Linear hooks)
        shared = [n for n in other["names"] if n in est["index"]]
        differ = len(shared) < len(other["names"]) or len(shared) < len(est["names"])
        if shared and differ:
            for side, e in (("common", other), ("main_common", est)):
                common = group_estimates(e, shared)
                out.update(smoothed(common["sq_norm"], common["trace"], alpha, f"{p}/{side}"))
        others[p] = dict(params=len(other["names"]), shared=len(shared), common=shared if shared and differ else None,
                         mixed_batch_rows=g["mixed"], incomplete=other["incomplete"], never_measured=other["never"],
                         **{k: other[k] for k in CELL_REPORTS})

    # keep the rows where any estimator measured anything; the EMAs carry over the others
    rows = np.zeros(len(df), dtype=bool)
    for e in loaded.values():
        rows |= e["measured"].any(1)
    main_rows = int(est["measured"].any(1).sum())
    measured_rows = est["measured"].any(1)
    with np.errstate(invalid="ignore"):  # an expert never logged: NaN
        reached = {e: float(np.nanmean(r[measured_rows])) if np.isfinite(r[measured_rows]).any() else math.nan
                   for e, r in reach.items()}
    kept = {k: est[k] for k in ("incomplete", "never", *CELL_REPORTS)}
    est = other = loaded = None  # the raw [rows, params] arrays: freed before the results take their place
    first = [c for c in ("step", "iter_num", "tokens_processed", "batch_size", "small_batch_size") if c in out]
    data = {**{c: out.pop(c) for c in first}, **reference, **out}
    out = reference = None
    # each column filtered once, its unfiltered array freed as it goes; pandas need not copy them again
    results = pd.DataFrame({k: data.pop(k)[rows] for k in list(data)}, copy=False)

    for p, o in others.items():
        o["comparison"] = compare(results[f"{p}/total/gns"], results["total/gns"],
                                  np.minimum(results[f"{p}/total/ema_steps"], results["total/ema_steps"]), alpha)
        if o["common"] is not None:
            o["common_comparison"] = compare(
                results[f"{p}/common/gns"], results[f"{p}/main_common/gns"],
                np.minimum(results[f"{p}/common/ema_steps"], results[f"{p}/main_common/ema_steps"]), alpha)
    ln = norm_compared = None
    if norm_name is not None:
        pair = (results[f"{norm_name}/gns"], results["total/gns"],
                np.minimum(results[f"{norm_name}/ema_steps"], results["total/ema_steps"]), alpha)
        ln, norm_compared = compare(*pair), compared_steps(*pair)[0]
    info = dict(main=main, requested=prefix, note=note, notes=[], groups=groups, type_groups=type_groups,
                norm_group=norm_name,
                incomplete=kept["incomplete"], never_measured=kept["never"], mixed_batch_rows=mixed_batch_rows,
                **{k: kept[k] for k in CELL_REPORTS},
                log_rows=len(df), main_rows=main_rows, comparison=ln, norm_compared=norm_compared, estimators=others,
                experts=dict(groups=each_expert, reached=reached, shown=experts))
    return results, info


def ema_window(alpha):
    """~1/(1 - alpha), the estimates an EMA averages over, as a whole number (1 - 0.8 is not exactly 0.2)."""
    return math.ceil(round(1 / (1 - alpha), 6))


def compared_steps(numerator, denominator, seen, alpha):
    """
    (mask, window) of the steps compare() uses: where both GNS series are defined and both EMAs have
    filled their window (~1/(1 - alpha) estimates); every step where both are defined, window 1, if
    the run is shorter.
    """
    a, d, seen = (np.asarray(v, dtype=float) for v in (numerator, denominator, seen))
    window = ema_window(alpha)
    both = np.isfinite(a) & np.isfinite(d) & (d != 0)
    warm = both & (seen >= window)
    if not warm.any():
        warm, window = both, 1  # a run shorter than the window: use every step
    return warm, window


def compare(numerator, denominator, seen, alpha):
    """
    How well one GNS series tracks another: ratio numerator/denominator (median, mean) and Pearson
    r over compared_steps() (min_ema_steps: the EMA window they start at).
    """
    a, d = (np.asarray(v, dtype=float) for v in (numerator, denominator))
    warm, window = compared_steps(a, d, seen, alpha)
    ratio = a[warm] / d[warm]
    pearson = np.nan
    if warm.sum() >= 3 and np.std(a[warm]) > 0 and np.std(d[warm]) > 0:
        pearson = float(np.corrcoef(a[warm], d[warm])[0, 1])
    return dict(steps=int(warm.sum()), min_ema_steps=window, ratio_median=float(np.median(ratio)) if len(ratio) else np.nan,
                ratio_mean=float(np.mean(ratio)) if len(ratio) else np.nan, pearson=pearson)


# -- logs of the reference implementation --------------------------------------------------------

def log_origin(path, declared=None):
    """
    ('fork', 'reference' or None when it cannot tell, why, config) of the log at path, from what
    was written to say so, never from a guess: `declared` (--origin); this fork's tracker writes
    WRITER_KEY into config.json; only this fork writes a layer_kinds.json; only the reference
    writes the in-progress pair log_header.csv.tmp + log_data.csv.tmp. A finished log of the
    reference, or of this fork before it wrote WRITER_KEY and without layer_kinds.json, cannot
    be told apart by its settings: None.
    """
    try:
        with open(os.path.join(os.path.dirname(path), "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        config = None
    config = config if isinstance(config, dict) else {}
    if declared is not None:
        return declared, f"--origin {declared}", config
    if config.get(WRITER_KEY) == WRITER:
        return "fork", f"its config.json says {WRITER_KEY}: {WRITER}", config
    if os.path.isfile(os.path.join(os.path.dirname(path), KINDS_NAME)):
        return "fork", f"it has a {KINDS_NAME} (LogWrapper.record_kinds)", config
    if os.path.basename(path) == REFERENCE_PAIR[1]:
        return "reference", f"written as {' + '.join(REFERENCE_PAIR)}", config
    return None, f"nothing beside it says: no {WRITER_KEY} in a config.json, no {KINDS_NAME}", config


def reference_fixes(columns, path, tied="auto", declared=None):
    """
    (columns to leave out, note lines) for the log at path with these columns. tied: 'auto'
    (leave out the tied weight of a reference log, keep this fork's), 'keep' or 'drop'. Also
    leaves out a float16 reference log's ddp/ columns. Raises AnalysisError where the tied weight
    is logged and auto cannot tell whose log it is.
    """
    origin, why, config = log_origin(path, declared)
    leave_out, notes = [], []
    tied_cols = tied_columns(columns)
    names = sorted({parse_column(c)[1] for c in tied_cols})
    shown = ", ".join(names)
    if tied_cols and tied == "auto":
        if origin is None:
            raise AnalysisError(f"cannot tell whether this log is this fork's, whose tied weight {shown} is "
                                f"measured exactly, or the reference implementation's, which measures it wrong "
                                f"({why}): pass --origin fork or --origin reference (or --tied keep or drop)")
        tied = "drop" if origin == "reference" else "keep"
        if tied == "drop":
            notes.append(f"a log of the reference implementation ({why}): its tied weight {shown} is measured "
                         f"wrong there (the whole gradient's norm, only the embedding's per-example norms), so it "
                         f"is left out, as its own analysis does (--tied keep keeps it)")
    elif tied_cols and tied == "drop":
        notes.append(f"the tied weight {shown} is left out (--tied drop)")
    elif tied_cols and origin == "reference":
        notes.append(f"the tied weight {shown} is kept (--tied keep), though the reference implementation "
                     f"measures it wrong ({why})")
    if tied == "drop":
        leave_out += tied_cols
    ddp = [c for c in columns if c.startswith(DDP + "/")]
    if origin is None and config.get("dtype") == "float16" and ddp:
        notes.append(f"if this is a log of the reference implementation, its ddp/ columns are wrong under float16 "
                     f"(loss-scaled small-batch norms over unscaled big-batch ones); they are kept, as nothing says "
                     f"whose log it is ({why}): --origin reference leaves them out")
    if origin == "reference" and config.get("dtype") == "float16" and ddp:
        leave_out += ddp
        notes.append("the reference implementation's DDP estimator under float16 divides loss-scaled "
                     "small-batch norms by unscaled big-batch ones: its ddp/ columns are left out")
    return leave_out, notes


def read_kinds(path):
    """
    (kinds, norm) for the log at path: kinds {parameter name: kind} as recorded when its layers were
    measured (KINDS_NAME beside it, written by the tracker), else None, and GPT's names decide with
    norm the kind of ln_* (a fork's config.json says 'norm': 'rmsnorm' for an RMSNorm GPT).
    """
    kinds = None
    try:
        with open(os.path.join(os.path.dirname(path), KINDS_NAME)) as f:
            kinds = json.load(f)
    except (OSError, ValueError):
        pass
    if not isinstance(kinds, dict):
        kinds = None
    config = log_origin(path)[2]
    norm = "rmsnorm" if isinstance(config, dict) and config.get("norm") == "rmsnorm" else "layernorm"
    return kinds, norm


def read_log(out_dir, tied="auto", declared=None):
    """
    (DataFrame, path, note lines) of the log in out_dir as the analysis reads it: the columns it
    needs, the GNS cells as written (a 'nan' is not an empty cell), a reference log's tied weight
    and float16 DDP columns left out (reference_fixes). Raises LogError, AnalysisError.
    """
    columns, path = log_columns(out_dir)
    leave_out, notes = reference_fixes(columns, path, tied, declared)
    wanted = [c for c in analysis_columns(columns) if c not in set(leave_out)]
    gns = [c for c in wanted if parse_column(c) or c in DDP_COLUMNS.values()]
    df, path = load_log(out_dir, wanted, as_written=gns)
    return df, path, notes


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
    series = [(x, results[f"{g}/gns"].to_numpy(), f"{main} {g}") for g in ("total", info["norm_group"])
              if f"{g}/gns" in results]
    series += [(x, results[f"{p}/total/gns"].to_numpy(), f"{p} total") for p in info["estimators"]]
    if DDP not in info["estimators"] and main != DDP and DDP_GNS in df.columns:
        # an older log with only the online DDP estimate (its own EMA), not the raw norms
        series.append((x_axis(df)[1], pd.to_numeric(df[DDP_GNS], errors="coerce").to_numpy(dtype=float),
                       f"{DDP_GNS} (online EMA)"))
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


def bad_cell_lines(e, indent="  "):
    """The summary's lines on the GNS cells left out with their steps: not finite numbers, or out of range."""
    lines = []
    steps = e["overflow_steps"]
    if steps:
        shown = ", ".join(map(str, steps[:4])) + (" ..." if len(steps) > 4 else "")
        lines.append(f"{indent}{len(steps)} steps with non-finite norms (e.g. float16 overflow; the optimizer "
                     f"skipped them), left out: steps {shown}")
    if e["bad_cells"]:
        more = " ..." if e["bad_cells"] > len(e["bad_examples"]) else ""
        lines.append(f"{indent}{e['bad_cells']} cells that are not finite numbers, left out with their steps: "
                     f"{'; '.join(e['bad_examples'])}{more}")
    if e["out_of_range"]:
        more = " ..." if e["out_of_range"] > len(e["out_of_range_examples"]) else ""
        lines.append(f"{indent}{e['out_of_range']} cells out of range (a negative norm, a batch size below 1 or "
                     f"not whole, a small batch above the batch), left out with their steps: "
                     f"{'; '.join(e['out_of_range_examples'])}{more}")
    return lines


def summary(results, info, path, alpha):
    groups, main = info["groups"], info["main"]
    last = results.iloc[-1]
    if main == DDP:
        covered = "totals over the whole model (DDP: small batch = one rank's batch)"
    else:
        counts = ", ".join(f"{k} {len(groups[k])}" for k in info["type_groups"])
        covered = f"{len(groups['total'])} parameters ({counts})"
    lines = [f"{path}: {info['log_rows']} rows, {info['main_rows']} steps with GNS measurements under '{main}', {covered}"]
    lines += [f"  note: {note}" for note in [info["note"]] * bool(info["note"]) + info["notes"]]
    lines += left_out_lines([("incomplete columns, left out", info["incomplete"]),
                             ("never measured, left out", info["never_measured"])])
    lines += bad_cell_lines(info)
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
    width = max([10, *(len(g) for g in info["type_groups"])])  # "shared expert" is longer than the others
    lines.append(f"  {'group':<{width}} {'GNS':>12} {'|G|^2':>12} {'tr(S)':>12} {'params':>7}")
    for g in ["total"] + info["type_groups"]:
        lines.append(f"  {g:<{width}} {last[f'{g}/gns']:>12.4g} {last[f'{g}/sq_norm_ema']:>12.4g} "
                     f"{last[f'{g}/trace_ema']:>12.4g} {len(groups[g]) if main != DDP else '-':>7}")
    blocks = [g for g in groups if g.startswith("h.")]
    if blocks:
        cells = [f"{b} {last[f'{b}/gns']:.4g}" for b in blocks]
        lines.append("  GNS per block: " + ", ".join(cells[:12]) + (" ..." if len(cells) > 12 else ""))
    lines += expert_lines(last, info)
    c, norm = info["comparison"], info["norm_group"]
    if c is None:
        if main != DDP:
            lines.append("LayerNorm vs total: no LayerNorm parameters in the log (nor RMSNorm)")
    elif c["steps"] == 0:
        lines.append(f"{norm} vs total: no step where both GNS are defined")
    else:
        lines.append(f"{norm} vs total GNS over {c['steps']} steps (EMA seen >= {c['min_ema_steps']}): "
                     f"ratio {'LN' if norm == 'LayerNorm' else norm}/total median {c['ratio_median']:.3f}, "
                     f"mean {c['ratio_mean']:.3f}; Pearson r {c['pearson']:.3f}")
    lines += estimator_table(results, info, alpha)
    return "\n".join(lines)


def expert_lines(last, info):
    """The summary's lines on a mixture of experts' experts: how many examples reached each (an expert
    that few reach has a noisy GNS, named), and with --experts each expert's GNS at the last step."""
    found = info.get("experts") or {}
    groups, reached = found.get("groups") or {}, found.get("reached") or {}
    if not groups:
        return []
    layers = {expert.rsplit("[", 1)[0] for expert in groups}
    line = f"  experts: {len(groups)} in {len(layers)} layer{'s' * (len(layers) > 1)}"
    known = {e: v for e, v in reached.items() if math.isfinite(v)}
    if known:
        low, high = min(known, key=known.get), max(known, key=known.get)
        line += (f"; examples that reached an expert per step, on average: {known[low]:.3g} ({low}) to "
                 f"{known[high]:.3g} ({high})")
    else:
        line += " (the log does not say how many examples reached each)"
    lines = [line]
    few = [e for e, v in known.items() if v < FEW_REACHED]
    if few:
        lines.append(f"  note: {len(few)} expert{'s were' if len(few) > 1 else ' was'} reached by fewer than "
                     f"{FEW_REACHED} examples a step on average, so {'their' if len(few) > 1 else 'its'} GNS is "
                     f"noisy: {', '.join(few[:SHOWN_CELLS])}{' ...' if len(few) > SHOWN_CELLS else ''}")
    if found.get("shown"):
        lines.append(f"  {'expert':<40} {'GNS':>12} {'|G|^2':>12} {'tr(S)':>12} {'reached':>8}")
        for expert in groups:
            cells = " ".join(f"{last[f'{expert}/{k}']:>12.4g}" for k in ("gns", "sq_norm_ema", "trace_ema"))
            lines.append(f"  {expert:<40} {cells} {reached.get(expert, math.nan):>8.3g}")
    return lines


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
        lines += bad_cell_lines(o, indent=f"    {p}: ")
        if o["mixed_batch_rows"]:
            lines.append(f"    {p}: {o['mixed_batch_rows']} steps with different batch sizes across parameters were left out")
    return lines


def figures_folder_problem(folder):
    """Why --figures `folder` cannot be made or written into (one line), else None: checked before
    anything is written, so that the analysis' CSV is not written when its figures would fail."""
    path = os.path.abspath(folder)
    while not os.path.exists(path):  # the folder is made if missing: its nearest existing ancestor decides
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        return f"--figures {folder}: {path} is not a directory"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"--figures {folder}: {path} is not writable"
    return None


def alpha_type(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{value} is outside [0, 1)")
    return value


def main(argv=None, prog="gns-analysis"):
    parser = ToolParser(
        prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="""\
Gradient noise scale (GNS) of a run from the raw gradient norms in OUT_DIR/log.csv: unbiased
per-step estimates of |G|^2 and tr(S) (McCandlish et al. 2018, App. A), summed over parameter
groups, smoothed separately, GNS = EMA(tr S) / EMA(|G|^2). Every estimator in the log is analysed
(exact per-example train/gns, Linear hooks train/hooks_gns, SOGNS train/sogns, micro-batch
train/microbatch_gns, DDP ddp/...) and compared with the main one. Prints a summary and terminal
plots; writes OUT_DIR/gns_analysis.csv, and with --figures the figures as PNG files. Reads the
reference implementation's logs too.""",
        epilog="""\
gns_analysis.csv also has the reference implementation's columns, from the main estimator's
total: step, batch_size, sgn and spegn (summed |G_B|^2, |G_b|^2), gtg and trsigma (per-step
estimates), gtg_ema, trsigma_ema, gns (smoothed), tokens_processed, ddp_gns (the log's ddp/gns).
They differ from the reference's numbers because:
  - the EMA is bias-corrected (pandas' adjusted ewm), not ewm(adjust=False);
  - steps without a measurement are skipped, not zeros;
  - the tied weight wte = lm_head is included (the reference measures it wrong and leaves it out);
  - gns is not clipped (the reference divides by max(gtg_ema, 1e-6));
  - tokens_processed comes only from the log (the reference made up step * batch_size).
GNS cells that are not finite numbers (inf, nan, text) or out of range (a negative norm, a batch
size below 1 or not whole, a small batch above the batch) are left out with their steps and named
in the summary; empty cells are steps without a measurement. A step logged twice keeps its later
copy, with a warning on stderr naming the steps whose copies differ.
Exit status: 0 done, 2 bad input (one line on stderr), 1 the result could not be written.""")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="the run's output directory (holding log.csv), or a log CSV file")
    parser.add_argument("--alpha", type=alpha_type, default=EMA_BETA,
                        help="EMA smoothing factor in [0, 1): ema = alpha * ema + (1 - alpha) * estimate at each "
                             "measured step, bias-corrected at the start; averages over ~1/(1 - alpha) steps; "
                             f"0 = no smoothing (default: {EMA_BETA})")
    parser.add_argument("--prefix", default=None,
                        help="the main estimator, broken down by parameter group and the one the others are "
                             "compared with: the column prefix PREFIX/<param>/norm, or 'ddp' for the DDP "
                             "estimator; a PREFIX given that the log lacks is an error (default: train/gns, or "
                             "if the log lacks it the first estimator present, with a note)")
    parser.add_argument("--no-plots", action="store_true", help="print only the summary (default: plots too)")
    parser.add_argument("--experts", action="store_true",
                        help="a mixture of experts: also the GNS of each expert (its weights' <name>[e] columns "
                             "summed) in the summary and in gns_analysis.csv, with the examples that reached it "
                             "per step on average (the summary always names the experts that fewer than "
                             f"{FEW_REACHED} reach: their GNS is noisy; default: the experts as one group)")
    parser.add_argument("--figures", metavar="DIR", default=None,
                        help=f"also write the figures as {PIXELS[0]} x {PIXELS[1]} PNG files into DIR (made if "
                             f"missing): {GNS_FIGURE}, the GNS of each layer type over tokens, and {NORM_FIGURE}, the "
                             "LayerNorm (or RMSNorm) GNS against the total, as in Gray et al. 2024; needs matplotlib: "
                             "pip install 'nanogns[figures]' (default: no figures)")
    parser.add_argument("--tied", choices=("auto", "keep", "drop"), default="auto",
                        help="the tied weight wte = lm_head: keep it (this fork measures it exactly), drop it "
                             "(the reference implementation measures it wrong), or auto: drop it from the "
                             "reference's logs, keep it in this fork's (default: auto)")
    parser.add_argument("--origin", choices=("fork", "reference"), default=None,
                        help="whose log it is, where nothing beside it says: this fork's tracker writes "
                             f"{WRITER_KEY} into config.json, the reference implementation nothing that tells "
                             "(default: read it from the run's files; asked for where it matters and they do not say)")
    args = parser.parse_args(argv)
    missing = None if args.no_plots else extra_missing("analysis", ["plotille"], "the terminal plots (--no-plots "
                                                                                 "leaves them out) need")
    if args.figures is not None:
        missing = missing or extra_missing("figures", ["matplotlib"], "--figures needs")
        missing = missing or figures_folder_problem(args.figures)
    if missing:
        print(f"{prog}: error: {missing}", file=sys.stderr)
        return 2

    try:
        df, path, notes = read_log(args.out_dir, args.tied, args.origin)
        kinds, norm = read_kinds(path)
        results, info = analyze(df, args.alpha, args.prefix or "train/gns", fallback=args.prefix is None,
                                kinds=kinds, norm=norm, experts=args.experts)
    except (LogError, AnalysisError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    info["notes"] += notes
    if not args.no_plots:
        print(plots(results, df, info))
        print()
    print(summary(results, info, path, args.alpha))
    out_path = os.path.join(os.path.dirname(path), "gns_analysis.csv")
    try:
        atomic_write(out_path, lambda f: results.to_csv(f, index=False), mode="w")
    except OSError as e:
        print(f"{prog}: error: cannot write {out_path} ({e.strerror})", file=sys.stderr)
        return 1
    print(f"wrote {out_path}")
    if args.figures is not None:
        try:
            for written in write_figures(results, info, info["norm_compared"], args.figures):
                print(f"wrote {written}")
        except OSError as e:
            print(f"{prog}: error: cannot write the figures into {args.figures} ({e.strerror or e})", file=sys.stderr)
            return 1
    return 0


# -- the reference implementation's names that are not kept (nanogns/refusals.py) -----------------

__getattr__ = module_refusals("gns_analysis")
