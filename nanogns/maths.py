"""
The gradient noise scale maths and log.csv's GNS column names, without torch: what a training
run's estimators (nanogns/estimators/exact.py) and the offline analysis (gns-analysis.py) share, so that the
analysis starts without loading torch (and nanogns/runlog.py, which reads the log's name, without numpy).

Maths (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training", App. A): from the
squared norms |G_B|^2 of a step's mean gradient over B examples and |G_b|^2, the mean squared norm
of mean gradients over b examples, unbiased_estimates() gives |G|^2 and tr(S); each is smoothed by
a bias-corrected EMA (GradientNoiseScale online, debiased_ema() over a log's columns) and the GNS
is the ratio of the two EMAs, never an EMA of ratios.
"""
import math

# ---------------------------------------------------------------------------------------------
# The maths: the unbiased estimates and their bias-corrected EMA (McCandlish et al. 2018, App. A)

# the default smoothing: gns-analysis.py's --alpha, and the exact estimator's live GNS on the
# status line, whose last value is therefore the analysis' total GNS
EMA_BETA = 0.99


def unbiased_estimates(big_sq, small_sq, B, b=1):
    """
    (|G|^2, tr(S)) from |G_B|^2 and |G_b|^2 (McCandlish et al. 2018, App. A, B_big = B, B_small = b):
        |G|^2 ~ (B |G_B|^2 - b |G_b|^2) / (B - b),    tr(S) ~ (|G_b|^2 - |G_B|^2) / (1/b - 1/B).
    Floats or arrays, elementwise; NaN where B <= b or b < 1 (nothing to estimate from).
    """
    import numpy as np  # here: nanogns/runlog.py reads the column names without loading numpy
    B, b = np.asarray(B, dtype=float), np.asarray(b, dtype=float)
    ok = (b >= 1) & (B > b)
    B, b = np.where(ok, B, np.nan), np.where(ok, b, np.nan)
    with np.errstate(invalid="ignore"):  # inf - inf: a step that overflowed, NaN like any unmeasured one
        sq_norm = (B * big_sq - b * small_sq) / (B - b)
        trace = (small_sq - big_sq) / (1 / b - 1 / B)
    return sq_norm, trace


class GradientNoiseScale:
    """
    The simple gradient noise scale B_simple = tr(S) / |G|^2, online: an exponential moving average
    of each unbiased estimate (ema = beta * ema + (1 - beta) * estimate, from 0), debiased like
    Adam's by 1 - beta^updates, and the GNS the ratio of the two averages (as k-diffusion does).
    debiased_ema() is the same average over a log's columns.

    ema_sq_norm, ema_var: the EMAs of |G|^2 and tr(S), not debiased; beta_cumprod: beta^updates;
    gradient_noise_scale: the GNS after the last update (NaN before the first). The GNS clamps each
    (biased) average to eps first, so a GNS of ~0 or ~1/eps flags one that dipped below zero.
    """

    def __init__(self, beta=0.995, eps=1e-8):
        self.beta = beta
        self.eps = eps
        self.ema_sq_norm = 0.0
        self.ema_var = 0.0
        self.beta_cumprod = 1.0
        self.gradient_noise_scale = float('nan')

    def update(self, sq_small, sq_big, n_small, n_big):
        """
        Add one step: sq_small is the mean squared norm of gradients over n_small examples each,
        sq_big the squared norm of their mean over n_big examples. A non-finite input (a float16
        overflow step, which GradScaler skips too) is ignored. Returns the current GNS.
        """
        if not 0 < n_small < n_big:
            raise ValueError(f"GradientNoiseScale needs 0 < n_small < n_big, got {n_small} and {n_big}")
        if not (math.isfinite(sq_small) and math.isfinite(sq_big)):
            return self.gradient_noise_scale
        sq_norm, var = map(float, unbiased_estimates(sq_big, sq_small, n_big, n_small))
        self.ema_sq_norm = self.beta * self.ema_sq_norm + (1 - self.beta) * sq_norm
        self.ema_var = self.beta * self.ema_var + (1 - self.beta) * var
        self.beta_cumprod *= self.beta
        self.gradient_noise_scale = self._ratio()
        return self.gradient_noise_scale

    def _ratio(self):
        return max(self.ema_var, self.eps) / max(self.ema_sq_norm, self.eps)

    def get_stats(self):
        """(|G|^2, tr(S)): the debiased EMAs; NaN before the first update."""
        if self.beta_cumprod == 1.0:
            return float('nan'), float('nan')
        debias = 1 - self.beta_cumprod
        return self.ema_sq_norm / debias, self.ema_var / debias

    def get_gns(self):
        """EMA(tr(S)) / EMA(|G|^2), each clamped to eps; NaN before the first update."""
        return self.gradient_noise_scale

    def get_msg(self, prefix=''):
        """{prefix}gtg, {prefix}trsigma (the debiased EMAs) and {prefix}gns, for a logger row."""
        gtg, trsigma = self.get_stats()
        return {f'{prefix}gtg': gtg, f'{prefix}trsigma': trsigma, f'{prefix}gns': self.get_gns()}

    def state_dict(self):
        return dict(beta=self.beta, eps=self.eps, ema_sq_norm=self.ema_sq_norm, ema_var=self.ema_var,
                    beta_cumprod=self.beta_cumprod, gradient_noise_scale=self.gradient_noise_scale)

    def load_state_dict(self, state):
        """Loads state_dict()'s dict, or that of this fork's older checkpoints (ema_gtg, ema_trsigma)."""
        state = dict(state)
        for old, new in (('ema_gtg', 'ema_sq_norm'), ('ema_trsigma', 'ema_var')):
            if old in state:
                state[new] = state.pop(old)
        unknown = set(state) - set(self.state_dict())
        if unknown:
            raise ValueError(f"GradientNoiseScale.load_state_dict: unknown keys {sorted(unknown)}")
        # beta comes back too: beta_cumprod only debiases the EMAs for the beta that made them
        for key, value in state.items():
            setattr(self, key, value)
        if 'gradient_noise_scale' not in state:  # older checkpoints did not store it
            self.gradient_noise_scale = float('nan') if self.beta_cumprod == 1.0 else self._ratio()


def debiased_ema(x, alpha):
    """
    (EMA, estimates seen) of the series x at every step: GradientNoiseScale's debiased average with
    beta = alpha over x's finite entries; the others carry the previous EMA forward (NaN before the first).
    """
    import numpy as np
    import pandas as pd  # the analysis' dependency, not training's
    x = pd.Series(np.where(np.isfinite(x), x, np.nan))
    # pandas' adjusted EWM is exactly sum_i alpha^i x_{t-i} / sum_i alpha^i = the debiased EMA
    ema = x.ewm(alpha=1 - alpha, adjust=True, ignore_na=True).mean().to_numpy()
    seen = np.cumsum(x.notna().to_numpy())
    return np.where(seen > 0, ema, np.nan), seen


# ---------------------------------------------------------------------------------------------
# log.csv's GNS columns, named here only. A per-parameter estimator logs for each parameter, under
# its prefix, PREFIX/<name>/norm (|G_B|), /pegn (|G_b|), /batch_size (B) and, where b > 1,
# /small_batch_size (b; absent: b = 1). The DDP estimator logs model totals under ddp/, named after
# Measurement's fields (the reference's columns): ddp/big_batch_norm, ...

LOG_NAME = "log.csv"  # out_dir/LOG_NAME: one row per step, first column `step` (nanogns/runlog.py writes it)
# written into out_dir/config.json by this fork's tracker, so that a reader knows whose log it is
# (the reference implementation measures the tied weight wrong; gns-analysis.py leaves it out there)
WRITER_KEY, WRITER = "log_written_by", "nanoGPT GNS fork: tracker.LogWrapper"
# the x axes a log offers, the first one logged being the default (tokens, then nanoGPT's iterations)
X_COLUMNS = ("tokens_processed", "iter_num", "step")
PREFIXES = dict(exact="train/gns", hooks_exact="train/hooks_gns", hooks_sogns="train/sogns",
                microbatch="train/microbatch_gns", adam="train/adam_gns", ddp="ddp")
# the kind of a cell -> the Measurement field it holds
KINDS = {"norm": "big_batch_norm", "pegn": "small_batch_norm", "batch_size": "big_batch_size",
         "small_batch_size": "small_batch_size"}
# a mixture-of-experts layer's experts also log PREFIX/<experts>[e]/reached: the examples of the step
# that sent expert e a token (its GNS is over all B examples; an estimate from few that reached it is noisy)
REACHED_CELL = "reached"
NORM_CELLS = ("norm", "pegn")  # the cells that hold norms; the others hold batch sizes
REQUIRED_CELLS = (*NORM_CELLS, "batch_size")  # every measured parameter's; small_batch_size only where b > 1


def column(prefix, name, kind):
    """PREFIX/<name>/<kind>; a prefix that is empty or ends in '/' is used as it is."""
    return f"{prefix}{'' if prefix == '' or prefix.endswith('/') else '/'}{name}/{kind}"


def parameter_columns(prefix, name, norm, pegn, batch_size, small_batch_size=None):
    """One parameter's cells of one step; small_batch_size where given (b = 1 without it)."""
    cells = {column(prefix, name, "norm"): norm, column(prefix, name, "pegn"): pegn,
             column(prefix, name, "batch_size"): batch_size}
    if small_batch_size is not None:
        cells[column(prefix, name, "small_batch_size")] = small_batch_size
    return cells


def parse_column(col):
    """(prefix, parameter name, kind) of a per-parameter column PREFIX/<name>/<kind>, else None."""
    parts = col.rsplit("/", 2)
    if len(parts) == 3 and all(parts) and parts[2] in KINDS:
        return tuple(parts)
    return None


def total_columns(prefix):
    """{kind: column} of an estimator logging model totals, e.g. ddp/big_batch_norm for 'norm'."""
    return {kind: f"{prefix}/{field}" for kind, field in KINDS.items()}


# The kinds of measured layer (nanogns.layers.MEASURED_CLASSES' keys) and the analysis's name for each;
# measure-time kinds are kept in out_dir/KINDS_NAME ({parameter name: kind}) for the analysis
# (experts: a mixture-of-experts layer's routed expert weights, one entry per expert, <name>[e]; router:
# the Linear that routes tokens to them; shared_expert: the MLP every token goes through beside them, and
# the gate that scales its output, as Qwen2-MoE's shared_expert and shared_expert_gate, DeepSeek-V3's shared_experts)
KIND_NAMES = {"linear": "Linear", "embedding": "Embedding", "layernorm": "LayerNorm", "rmsnorm": "RMSNorm",
              "experts": "experts", "router": "router", "shared_expert": "shared expert"}
NORM_KINDS = ("layernorm", "rmsnorm")
KINDS_NAME = "layer_kinds.json"
# each measured Linear's ghost/materialise method ({layer name: method}), recorded after the first step
METHODS_NAME = "linear_norm_methods.json"


def layer_kind(name, kinds=None, norm="layernorm"):
    """A parameter's kind: the one recorded when it was measured (kinds: {name: kind}), else, for
    a log without the record, by GPT's names: `norm` (the run's normalisation) for ln_1, ln_2,
    ln_f, ..., embedding for wte, wpe, experts for one expert's weights (<name>[e]), router for
    model.py's mlp.router, linear for everything else."""
    if kinds and name in kinds:
        return kinds[name]
    if name.endswith("]") and "[" in name:
        return "experts"
    parts = name.split(".")
    if "router" in parts:
        return "router"
    if any(p.startswith("ln_") for p in parts):
        return norm
    if any(p in ("wte", "wpe") for p in parts):
        return "embedding"
    return "linear"


def layer_type(name, kinds=None, norm="layernorm"):
    """The name of a parameter's kind: LayerNorm, RMSNorm, Linear or Embedding (layer_kind)."""
    return KIND_NAMES[layer_kind(name, kinds, norm)]


def norm_group(kinds_present):
    """The normalisation group's name after the kinds a model has: LayerNorm, RMSNorm or LayerNorm+RMSNorm."""
    return "+".join(KIND_NAMES[k] for k in NORM_KINDS if k in kinds_present)


def layer_groups(names, kinds=None, norm="layernorm"):
    """{group: members} of those present, in the order normalisation (one group, named by
    norm_group), Linear, Embedding, experts, router, shared expert."""
    by_kind = {name: layer_kind(name, kinds, norm) for name in names}
    groups = {norm_group(set(by_kind.values())): [n for n in names if by_kind[n] in NORM_KINDS]}
    for kind in ("linear", "embedding", "experts", "router", "shared_expert"):
        groups[KIND_NAMES[kind]] = [n for n in names if by_kind[n] == kind]
    return {g: members for g, members in groups.items() if g and members}


# ---------------------------------------------------------------------------------------------
# The critical batch size measured directly (McCandlish et al. 2018, App. D; Merrill et al. 2025)

def _reached(batch_sizes, steps):
    """[(B, S)] of the batch sizes whose branch reached the target (a step count that is None, NaN or not
    positive did not); ValueError on a batch size that is not a positive number."""
    points = [(float(b), float(s)) for b, s in zip(batch_sizes, steps)
              if s is not None and math.isfinite(float(s)) and float(s) > 0]
    if any(not (math.isfinite(b) and b > 0) for b, _ in points):
        raise ValueError(f"fit_critical_batch: batch sizes must be positive numbers, got {list(batch_sizes)}")
    return points


def _fit_lines(inv_batch, steps):
    """(S_min, E_min) of the least-squares lines steps = S_min + E_min * inv_batch along the last axis,
    each residual relative to its step count (weights 1 / steps^2)."""
    weights = 1 / steps ** 2
    total = weights.sum(-1)
    x_mean = (weights * inv_batch).sum(-1) / total
    y_mean = (weights * steps).sum(-1) / total
    dx = inv_batch - x_mean[..., None]
    e_min = (weights * dx * (steps - y_mean[..., None])).sum(-1) / (weights * dx ** 2).sum(-1)
    return y_mean - e_min * x_mean, e_min


def fit_critical_batch(batch_sizes, steps):
    """
    (S_min, E_min) of the steps-to-target curve S(B) = S_min + E_min / B, McCandlish's
    (S/S_min - 1)(E/E_min - 1) = 1 with E = B S solved for S: a straight line in 1/B, fitted by least
    squares to the batch sizes whose branch reached the target (a step count that is None, NaN or
    not positive did not), each residual relative to its S (weights 1/S^2): step counts span orders
    of magnitude and their noise grows with them, so plain residuals would let the smallest batch
    decide S_min alone. The critical batch size is B_crit = E_min / S_min. ValueError, one line
    naming the problem, when fewer than two batch sizes reached the target or the fit is not positive.
    A batch size that did not reach the target is right-censored (it needed more steps than it ran):
    the fit leaves it out, and the caller should say which ones it left.
    """
    import numpy as np
    points = _reached(batch_sizes, steps)
    if len({b for b, _ in points}) < 2:
        raise ValueError(f"fit_critical_batch: {len({b for b, _ in points})} batch size(s) reached the target "
                         f"(steps {list(steps)} at batch sizes {list(batch_sizes)}); the fit needs at least 2")
    s_min, e_min = map(float, _fit_lines(np.array([1 / b for b, _ in points]), np.array([s for _, s in points])))
    if not (s_min > 0 and e_min > 0):
        raise ValueError(f"fit_critical_batch: the fit S(B) = S_min + E_min/B is not positive (S_min {s_min:.4g}, "
                         f"E_min {e_min:.4g}): the steps do not fall with the batch size as the model says")
    return s_min, e_min


def critical_batch_interval(batch_sizes, steps, level=0.9, resamples=2000, seed=0):
    """
    (low, high): an interval for fit_critical_batch's B_crit = E_min / S_min at `level` (0.9: from the
    5th to the 95th percentile), by a residual bootstrap: each resample puts the fit's log residuals
    log(S / S_fit), drawn with replacement and scaled by sqrt(n / (n - 2)) (two parameters fitted to n
    points), back on the fitted curve, and fits again. It says how far the step counts' scatter about
    the curve moves B_crit; it cannot see an error the curve itself makes, and with few batch sizes
    it errs on the narrow side (tests/test_maths.py measures how often it holds the true B_crit
    of simulated step counts). A resample whose S_min is not positive counts as B_crit = inf (no
    floor on the steps in sight), one whose E_min is not positive as 0. (nan, nan) when fewer than
    three batch sizes reached the target: a line through two leaves no scatter to resample.
    ValueError as fit_critical_batch's; the same input and seed give the same interval.
    """
    import numpy as np
    s_min, e_min = fit_critical_batch(batch_sizes, steps)
    points = _reached(batch_sizes, steps)
    if len({b for b, _ in points}) < 3:
        return math.nan, math.nan
    inv_batch, observed = np.array([1 / b for b, _ in points]), np.array([s for _, s in points])
    fitted = s_min + e_min * inv_batch
    residuals = np.log(observed / fitted) * math.sqrt(len(points) / (len(points) - 2))
    resampled = fitted * np.exp(np.random.default_rng(seed).choice(residuals, size=(resamples, len(points))))
    boot_s, boot_e = _fit_lines(np.broadcast_to(inv_batch, resampled.shape), resampled)
    b_crit = np.where(boot_e <= 0, 0.0, np.where(boot_s > 0, boot_e / np.where(boot_s > 0, boot_s, 1.0), np.inf))
    tail = (1 - level) / 2  # order statistics, not interpolation: an inf stays an inf
    return float(np.quantile(b_crit, tail, method='lower')), float(np.quantile(b_crit, 1 - tail, method='higher'))
