"""nanogns/maths.py: McCandlish et al.'s unbiased estimates, the online and the vectorised bias-corrected
EMA (the same average), log.csv's column names, the critical-batch fit and its interval, and that
none of it needs torch."""
import os
import subprocess
import sys

import numpy as np
import pytest

import nanogns.maths as gnsmath
from conftest import REPO


def test_unbiased_estimates_take_floats_and_arrays_alike():
    B, b = np.array([16, 16, 8, 4]), np.array([1, 4, 8, 1])
    big, small = np.array([1.0, 2.0, 3.0, 0.5]), np.array([9.0, 4.0, 5.0, 2.5])
    sq_norms, traces = gnsmath.unbiased_estimates(big, small, B, b)
    for i in range(len(B)):
        sq_norm, trace = gnsmath.unbiased_estimates(float(big[i]), float(small[i]), int(B[i]), int(b[i]))
        assert np.array_equal(sq_norm, sq_norms[i], equal_nan=True) and np.array_equal(trace, traces[i], equal_nan=True)
    # E|G_n|^2 = |G|^2 + tr(S)/n at n = b and n = B, solved by hand; B == b: nothing to estimate
    assert traces[1] == pytest.approx((4.0 - 2.0) / (1 / 4 - 1 / 16)) and sq_norms[1] == pytest.approx(2.0 - traces[1] / 16)
    assert np.isnan(sq_norms[2]) and np.isnan(traces[2])


def test_online_and_vectorised_ema_are_the_same_average_step_by_step():
    """GradientNoiseScale (train.py's status line, the DDP columns) and debiased_ema (gns-analysis.py)."""
    rng = np.random.default_rng(4)
    n, beta, B, b = 40, 0.9, 32, 4
    sq_big = rng.uniform(1, 2, n)
    sq_small = sq_big * rng.uniform(2, 6, n)  # both estimates positive: the GNS is their plain ratio
    sq_small[[3, 17]] = np.inf  # overflow steps: skipped by both
    sq_big[25] = np.nan
    online = gnsmath.GradientNoiseScale(beta=beta)
    sq_norm, trace = gnsmath.unbiased_estimates(sq_big, sq_small, B, b)
    sq_norm_ema, seen = gnsmath.debiased_ema(sq_norm, beta)
    trace_ema, _ = gnsmath.debiased_ema(trace, beta)
    for t in range(n):
        online.update(sq_small[t], sq_big[t], b, B)
        gtg, trsigma = online.get_stats()
        assert gtg == pytest.approx(sq_norm_ema[t], rel=1e-12) and trsigma == pytest.approx(trace_ema[t], rel=1e-12)
        assert online.get_gns() == pytest.approx(trace_ema[t] / sq_norm_ema[t], rel=1e-12)
    assert seen[-1] == n - 3 and online.beta_cumprod == pytest.approx(beta ** (n - 3))
    assert all(type(v) is float for v in online.state_dict().values()), "plain floats: a weights_only checkpoint"


def test_column_names():
    name = "transformer.h.0.ln_1.weight"
    assert gnsmath.column("train/gns", name, "pegn") == f"train/gns/{name}/pegn"
    assert gnsmath.column("train/gns/", name, "norm") == gnsmath.column("train/gns", name, "norm")
    assert gnsmath.parameter_columns("train/microbatch_gns", "w", 1.0, 2.0, 16, 4) == {
        "train/microbatch_gns/w/norm": 1.0, "train/microbatch_gns/w/pegn": 2.0,
        "train/microbatch_gns/w/batch_size": 16, "train/microbatch_gns/w/small_batch_size": 4}
    assert list(gnsmath.parameter_columns("p", "w", 1.0, 2.0, 16)) == ["p/w/norm", "p/w/pegn", "p/w/batch_size"]
    for col in gnsmath.parameter_columns("train/hooks_gns", name, 1.0, 2.0, 16, 4):
        assert gnsmath.parse_column(col) == ("train/hooks_gns", name, col.rsplit("/", 1)[1])
    assert gnsmath.parse_column("train/lossf") is None and gnsmath.parse_column("a/b/gns") is None
    # the DDP estimator's totals: Measurement's fields, as ddp_gns_log writes them
    import nanogns.estimators.ddp as ddpgns
    totals = gnsmath.total_columns("ddp")
    gns = gnsmath.GradientNoiseScale()
    gns.update(4.0, 1.0, 2, 8)
    assert list(totals.values()) == list(ddpgns.ddp_gns_log(gns, 4.0, 1.0, 2, 8))[:4]
    assert totals["pegn"] == "ddp/small_batch_norm"


def test_layer_types_by_parameter_name():
    assert gnsmath.layer_type("transformer.h.3.ln_2.weight") == "LayerNorm"
    assert gnsmath.layer_type("transformer.ln_f.bias") == "LayerNorm"
    assert gnsmath.layer_type("transformer.wte.weight") == "Embedding" == gnsmath.layer_type("transformer.wpe.weight")
    assert gnsmath.layer_type("transformer.h.0.attn.c_attn.weight") == "Linear" == gnsmath.layer_type("lm_head.weight")


def test_the_maths_and_the_analysis_load_without_torch():
    """gns-analysis.py starts in about a second: it needs the maths and pandas, not torch."""
    code = ("import importlib.util, sys; import nanogns.maths\n"
            "spec = importlib.util.spec_from_file_location('gns_analysis', 'gns-analysis.py')\n"
            "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
            "print(sorted(m for m in ('torch', 'nanogns.layers', 'nanogns.estimators.exact') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=REPO))
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_layer_groups_by_the_kinds_recorded_else_by_name():
    names = ["model.layers.0.input_layernorm.weight", "model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight",
             "transformer.ln_f.weight"]
    kinds = {names[0]: "rmsnorm", names[1]: "embedding", names[2]: "linear", names[3]: "rmsnorm"}
    assert gnsmath.layer_groups(names, kinds) == {"RMSNorm": [names[0], names[3]], "Linear": [names[2]],
                                                  "Embedding": [names[1]]}
    assert gnsmath.layer_type(names[0], kinds) == "RMSNorm"
    both = {**kinds, names[3]: "layernorm"}
    assert list(gnsmath.layer_groups(names, both)) == ["LayerNorm+RMSNorm", "Linear", "Embedding"]
    # a log without the record: GPT's names, ln_* of the run's normalisation
    assert gnsmath.layer_groups(names) == {"LayerNorm": [names[3]], "Linear": names[:3]}
    assert list(gnsmath.layer_groups(names, norm="rmsnorm")) == ["RMSNorm", "Linear"]


# -- fit_critical_batch: S(B) = S_min + E_min / B (McCandlish et al. 2018, App. D) ---------------

def test_fit_critical_batch_recovers_exact_points():
    batch_sizes = [4, 8, 16, 32, 64]
    s_min, e_min = 120.0, 3000.0  # B_crit = 25
    steps = [s_min + e_min / b for b in batch_sizes]
    fitted = gnsmath.fit_critical_batch(batch_sizes, steps)
    assert fitted == pytest.approx((s_min, e_min), rel=1e-12)
    # (S/S_min - 1)(E/E_min - 1) = 1 at every point: the same curve as McCandlish's
    for b, s in zip(batch_sizes, steps):
        assert (s / s_min - 1) * (b * s / e_min - 1) == pytest.approx(1.0)


def test_fit_critical_batch_within_tolerance_of_noisy_points_and_ignores_branches_that_missed():
    rng = np.random.default_rng(0)
    batch_sizes = [4, 8, 16, 32, 64, 128] * 20
    s_min, e_min = 50.0, 1600.0
    steps = [(s_min + e_min / b) * (1 + 0.03 * rng.standard_normal()) for b in batch_sizes]
    fitted_s, fitted_e = gnsmath.fit_critical_batch(batch_sizes + [256, 512], steps + [None, float("nan")])
    assert fitted_s == pytest.approx(s_min, rel=0.1) and fitted_e == pytest.approx(e_min, rel=0.05)


def test_fit_critical_batch_weighs_residuals_relative_to_the_steps():
    """Steps span orders of magnitude: 10% too many at the smallest batch must not decide S_min.
    Plain residuals give S_min 7.2 and B_crit 77 here; relative ones stay near 10 and 50."""
    batch_sizes = [4, 8, 16, 32, 64]
    s_min, e_min = 10.0, 500.0
    steps = [(s_min + e_min / b) * (1.10 if b == 4 else 1.0) for b in batch_sizes]
    fitted_s, fitted_e = gnsmath.fit_critical_batch(batch_sizes, steps)
    assert fitted_s == pytest.approx(s_min, rel=0.1) and fitted_e / fitted_s == pytest.approx(50, rel=0.15)


@pytest.mark.parametrize("batch_sizes, steps, words", [
    ([4, 8, 16], [100, None, float("nan")], "1 batch size(s) reached the target"),
    ([4, 4, 4], [100, 110, 90], "1 batch size(s) reached the target"),
    ([], [], "0 batch size(s) reached the target"),
    ([4, 8, 16], [10, 20, 40], "not positive"),  # steps growing with B: E_min < 0
    ([4, 8], [100, 100], "not positive"),  # flat: E_min = 0
    ([4, 8], [20, 5], "not positive"),  # S_min < 0
    ([0, 8], [20, 5], "batch sizes must be positive"),
])
def test_fit_critical_batch_refuses_degenerate_input_in_one_line(batch_sizes, steps, words):
    with pytest.raises(ValueError, match="fit_critical_batch") as e:
        gnsmath.fit_critical_batch(batch_sizes, steps)
    assert words in str(e.value) and "\n" not in str(e.value)


# -- critical_batch_interval: how far the step counts' scatter moves B_crit --------------------------

def test_critical_batch_interval_covers_the_true_b_crit_about_as_often_as_it_says():
    """Step counts scattered about a known curve by a few percent, as branches' are: the 90% interval
    holds the true B_crit in most draws, neither always (too wide to say anything) nor rarely (too narrow).
    Five batch sizes and two fitted parameters leave a residual bootstrap somewhat narrow, so the band
    is wide."""
    rng = np.random.default_rng(7)
    batch_sizes = np.array([4, 8, 16, 32, 64])
    s_min, e_min = 10.0, 300.0
    held = []
    for draw in range(300):
        steps = (s_min + e_min / batch_sizes) * np.exp(0.1 * rng.standard_normal(len(batch_sizes)))
        low, high = gnsmath.critical_batch_interval(batch_sizes, steps, resamples=500, seed=draw)
        held.append(low <= e_min / s_min <= high)
    assert 0.7 <= np.mean(held) <= 0.97


def test_critical_batch_interval_is_the_fit_itself_on_exact_points_and_none_on_two():
    batch_sizes = [4, 8, 16, 32]
    steps = [10 + 300 / b for b in batch_sizes]
    low, high = gnsmath.critical_batch_interval(batch_sizes, steps)
    assert low == pytest.approx(30, rel=1e-9) and high == pytest.approx(30, rel=1e-9)
    # two batch sizes (with repeats, and with a censored third): the line goes through both, no scatter to resample
    for sizes, counts in (([4, 32], steps[::3]), ([4, 4, 32], [steps[0], steps[0] * 1.1, steps[3]]),
                          ([4, 16, 32], [steps[0], None, steps[3]])):
        assert all(np.isnan(gnsmath.critical_batch_interval(sizes, counts)))
    with pytest.raises(ValueError, match="1 batch size"):
        gnsmath.critical_batch_interval([4, 8], [100, None])


def test_critical_batch_interval_widens_with_the_scatter_and_repeats_for_a_seed():
    batch_sizes = [4, 8, 16, 32, 64]
    wobble = np.array([1, -1, 0.5, 1, -1.5])
    width = []
    for scale in (0.02, 0.1):
        steps = [(10 + 300 / b) * np.exp(scale * w) for b, w in zip(batch_sizes, wobble)]
        low, high = gnsmath.critical_batch_interval(batch_sizes, steps)
        assert (low, high) == gnsmath.critical_batch_interval(batch_sizes, steps)
        assert low < high
        width.append(np.log(high / low))
    assert width[1] > 2 * width[0]


def test_critical_batch_interval_counts_a_resample_with_no_floor_as_infinite():
    """Steps that keep halving with the batch: many resamples fit S_min <= 0, a B_crit beyond any
    batch size; the interval's top says so instead of a number."""
    batch_sizes = [4, 8, 16, 32]
    steps = [1000 / b * f for b, f in zip(batch_sizes, (1.0, 1.15, 0.9, 1.1))]
    s_min, e_min = gnsmath.fit_critical_batch(batch_sizes, steps)  # a floor, barely: B_crit far beyond 32
    low, high = gnsmath.critical_batch_interval(batch_sizes, steps)
    assert e_min / s_min > 32 and high == np.inf and 0 < low
