import json
import math
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch

import nanogns.layers as buffered
import nanogns.estimators.ddp as ddpgns
import nanogns.maths as gnsmath
import nanogns.estimators.exact as gnstracking
from conftest import REPO
from nanogns.logread import load_log
from gns_fixtures import (MEASURED, ToyGPT, brute_force_norms, fill_buffers, gpt_batches, measure, per_example_grads,
                          regression_loss, tiny_gpt, train_step)
from nanogns.estimators.exact import AccumulateMeasurements, Measurement, MeasurementTracker
from nanogns.refusals import ReferenceNameError
from nanogns.runlog import LogWrapper


def make_model(seed=0):
    torch.manual_seed(seed)
    return measure(ToyGPT())


def make_batch(n, seed=1, T=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 11, (n, T), generator=g), torch.randn(n, generator=g)


def assert_matches_brute_force(measurements, model, x, y, B, rel=1e-5):
    expected = brute_force_norms(model, regression_loss, x, y)
    assert [m.metadata["name"] for m in measurements] == [n for n, _ in model.named_parameters()]
    for m in measurements:
        big, small = expected[m.metadata["name"]]
        assert m.big_batch_norm == pytest.approx(big, rel=rel, abs=1e-9), m.metadata["name"]
        assert m.small_batch_norm == pytest.approx(small, rel=rel, abs=1e-9), m.metadata["name"]
        assert (m.big_batch_size, m.small_batch_size) == (B, 1)


def buffers_are_zero(model):
    return all(float(sq) == 0 and float(c) == 0 for _, _, sq, c in buffered.find_sqgradnorm_buffers(model))


def test_float32_with_grad_accumulation_matches_brute_force():
    model = make_model()
    x, y = make_batch(12)
    B = train_step(model, [(x[:4], y[:4]), (x[4:8], y[4:8]), (x[8:], y[8:])])
    tracker = MeasurementTracker.from_model(model)
    measurements = tracker.step(batch_size=B)
    assert_matches_brute_force(measurements, model, x, y, B)
    assert all(m.metadata["step"] == 0 for m in measurements)
    assert buffers_are_zero(model), "the tracker zeroes the buffers it read"


def test_batch_size_defaults_to_the_buffer_count():
    model = make_model()
    x, y = make_batch(6)
    train_step(model, [(x, y)])
    measurements = MeasurementTracker.from_model(model).step()
    assert_matches_brute_force(measurements, model, x, y, 6)


def test_grad_scaler_scale_is_divided_out():
    model = make_model()
    x, y = make_batch(8)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    B = train_step(model, [(x[:4], y[:4]), (x[4:], y[4:])], scaler=scaler)
    assert model.head.weight.grad.norm() > 100 * brute_force_norms(model, regression_loss, x, y)["head.weight"][0]
    measurements = MeasurementTracker.from_model(model, scaler=scaler).step(batch_size=B)
    assert_matches_brute_force(measurements, model, x, y, B)


def test_disabled_scaler_is_ignored():
    model = make_model()
    x, y = make_batch(4)
    train_step(model, [(x, y)])
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    assert_matches_brute_force(MeasurementTracker.from_model(model, scaler=scaler).step(4), model, x, y, 4)


def test_overflow_step_gives_inf_measurements_with_the_batch_size_and_is_counted():
    model = make_model()
    calls = []
    tracker = MeasurementTracker.from_model(model, callback=calls.append)
    x, y = make_batch(4)
    train_step(model, [(x, y)])
    model.transformer.h[0].mlp.c_fc.weight.grad[0, 0] = float("inf")
    measurements = tracker.step(batch_size=4)
    assert tracker.skipped_steps == 1 and calls == measurements
    assert [m.metadata["name"] for m in measurements] == [n for n, _ in model.named_parameters()]
    for m in measurements:  # every parameter, not only the one that overflowed
        assert (m.big_batch_norm, m.small_batch_norm, m.big_batch_size, m.small_batch_size) == (math.inf, math.inf, 4, 1)
        assert m.metadata["step"] == 0
    assert buffers_are_zero(model), "buffers are zeroed on skipped steps too"
    # the next step is measured normally, and knows it is step 1
    model.zero_grad()
    train_step(model, [(x, y)])
    measurements = tracker.step(batch_size=4)
    assert_matches_brute_force(measurements, model, x, y, 4)
    assert measurements[0].metadata["step"] == 1 and tracker.skipped_steps == 1


def test_nan_buffer_and_bad_scale_are_overflows_too():
    model = make_model()
    tracker = MeasurementTracker.from_model(model)
    x, y = make_batch(4)
    train_step(model, [(x, y)])
    model.transformer.ln_f._buffers["bias_sqgradnorm"].fill_(float("nan"))
    measurements = tracker.step()  # the batch size from the counts
    assert tracker.skipped_steps == 1 and len(measurements) == len(list(model.parameters()))
    assert all(m.big_batch_norm == m.small_batch_norm == math.inf and m.big_batch_size == 4 for m in measurements)
    # a count that does not match is still an error on such a step
    train_step(model, [(x, y)])
    model.transformer.ln_f._buffers["bias_sqgradnorm"].fill_(float("inf"))
    with pytest.raises(ValueError, match="counted 4 examples but batch_size=8"):
        tracker.step(batch_size=8)
    # a GradScaler whose scale is no longer finite
    model.zero_grad()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
    tracker = MeasurementTracker.from_model(model, scaler=scaler)
    train_step(model, [(x, y)], scaler=scaler)
    scaler._scale.fill_(float("inf"))
    assert all(m.big_batch_norm == math.inf for m in tracker.step(batch_size=4)) and tracker.skipped_steps == 1


def test_an_overflow_row_keeps_one_batch_size_per_step_and_sums_to_inf(tmp_path):
    """What the reference's gns-analysis.py and notebook check on every row of log.csv."""
    model = make_model()
    logs = AccumulateMeasurements(prefix="train/gns/")
    tracker = MeasurementTracker.from_model(model, callback=logs)
    x, y = make_batch(4)
    with LogWrapper(out_dir=tmp_path) as log:
        for step in range(3):
            model.zero_grad()
            train_step(model, [(x, y)])
            if step == 1:
                model.head.weight.grad.fill_(float("nan"))
            tracker.step(batch_size=4)
            log.log({"iter_num": step, **logs.get_msg()})
            log.step()
    df, _ = load_log(tmp_path)
    batch_size_cols = [c for c in df.columns if c.endswith("/batch_size")]
    assert len(batch_size_cols) == len(list(model.parameters()))
    assert (df[batch_size_cols].nunique(axis=1) == 1).all() and (df[batch_size_cols] == 4).all().all()
    squares = (df[[c for c in df.columns if c.endswith("/norm") or c.endswith("/pegn")]] ** 2).sum(axis=1)
    assert np.isfinite(squares[0]) and np.isfinite(squares[2]) and squares[1] == np.inf


def test_one_host_device_transfer_per_step(monkeypatch):
    """Every Tensor -> Python conversion is counted: step() may make exactly one."""
    model = make_model()
    x, y = make_batch(8)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    tracker = MeasurementTracker.from_model(model, scaler=scaler)
    train_step(model, [(x, y)], scaler=scaler)
    conversions = []
    for method in ["item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__"]:
        original = getattr(torch.Tensor, method)

        def counted(self, *args, _original=original, _method=method, **kwargs):
            conversions.append(_method)
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, method, counted)
    measurements = tracker.step(batch_size=8)
    monkeypatch.undo()
    assert len(measurements) == len(list(model.parameters()))
    assert conversions == ["tolist"]


def test_world_size_rescales_summed_rank_buffers():
    """
    Two simulated DDP ranks, each with half the batch: each rank's layers see the gradient of its
    own mean loss, so its buffers hold sum_b ||g_b / B_rank||^2; the buffers and counts are summed
    and .grad averaged, as DDP + all-reduce do. With world_size=2 the tracker must agree with one
    process that saw the whole batch.
    """
    x, y = make_batch(8)
    single = make_model()
    train_step(single, [(x, y)])
    expected = MeasurementTracker.from_model(single).step(batch_size=8)

    ranks = [make_model() for _ in range(2)]
    for r, model in enumerate(ranks):
        train_step(model, [(x[4 * r:4 * r + 4], y[4 * r:4 * r + 4])])
    summed = ranks[0]
    with torch.no_grad():
        for (_, p0, sq0, c0), (_, p1, sq1, c1) in zip(*(buffered.find_sqgradnorm_buffers(m) for m in ranks)):
            p0.grad = (p0.grad + p1.grad) / 2
            sq0 += sq1
        for m0, m1 in zip(ranks[0].modules(), ranks[1].modules()):
            if "example_count" in m0._buffers:
                m0._buffers["example_count"] += m1._buffers["example_count"]
    state = {n: (p.grad.clone(), sq.clone(), c.clone()) for n, p, sq, c in buffered.find_sqgradnorm_buffers(summed)}
    got = MeasurementTracker.from_model(summed, world_size=2).step(batch_size=8)
    for e, g in zip(expected, got):
        assert g.big_batch_norm == pytest.approx(e.big_batch_norm, rel=1e-5)
        assert g.small_batch_norm == pytest.approx(e.small_batch_norm, rel=1e-5)
    # the naive B * S (world_size left at 1) is W^2 = 4 times too large in |G_1|^2
    with torch.no_grad():
        for n, p, sq, c in buffered.find_sqgradnorm_buffers(summed):
            p.grad, _ = state[n][0], sq.copy_(state[n][1])
            c.copy_(state[n][2])
    naive = MeasurementTracker.from_model(summed).step(batch_size=8)
    for e, g in zip(expected, naive):
        assert g.small_batch_norm ** 2 == pytest.approx(4 * e.small_batch_norm ** 2, rel=1e-5)


def test_several_callbacks_all_run_and_one_may_return_a_value():
    model = make_model()
    x, y = make_batch(4)
    train_step(model, [(x, y)])
    logs = AccumulateMeasurements()
    seen = []

    def halve(m):
        return Measurement(m.big_batch_norm / 2, m.small_batch_norm / 2, m.big_batch_size, 1, m.metadata)

    tracker = MeasurementTracker.from_model(model, callback=[logs, halve, seen.append])
    returned = tracker.step(batch_size=4)
    n_params = len(list(model.parameters()))
    assert len(seen) == len(returned) == n_params and len(logs.pop()) == 3 * n_params
    for original, kept in zip(seen, returned):
        assert kept.big_batch_norm == original.big_batch_norm / 2
        assert kept.small_batch_norm == original.small_batch_norm / 2


def test_two_callbacks_returning_values_is_an_error():
    model = make_model()
    x, y = make_batch(4)
    train_step(model, [(x, y)])
    tracker = MeasurementTracker.from_model(model, callback=[lambda m: m, lambda m: m])
    with pytest.raises(ValueError, match="more than one callback"):
        tracker.step(batch_size=4)


def test_accumulate_measurements_columns():
    logs = AccumulateMeasurements()
    name = "transformer.h.0.ln_1.weight"
    logs(Measurement(1.5, 2.5, 32, 1, {"name": name, "step": 0}))
    assert logs.pop() == {f"train/gns/{name}/norm": 1.5, f"train/gns/{name}/pegn": 2.5,
                          f"train/gns/{name}/batch_size": 32}
    assert logs.pop() == {}
    ddp = AccumulateMeasurements(prefix="ddp/")
    ddp(Measurement(1.0, 2.0, 8, 1, {"name": "a", "step": 0}))
    ddp(Measurement(1.0, 2.0, 8, 1, {"name": "b", "step": 1}))  # a new step without pop(): a fresh row
    assert list(ddp.pop()) == ["ddp/b/norm", "ddp/b/pegn", "ddp/b/batch_size"]
    # a prefix is used as given when empty or ending in '/', else a '/' is added
    for prefix, key in [("", "w/norm"), ("train/gns", "train/gns/w/norm"), ("train/gns/", "train/gns/w/norm")]:
        logs = AccumulateMeasurements(prefix)
        logs(Measurement(1.0, 2.0, 8, 1, {"name": "w", "step": 0}))
        assert logs.prefix == prefix and list(logs.pop())[0] == key


def test_accumulate_measurements_reference_names_msg_step_and_get_msg():
    logs = AccumulateMeasurements(prefix="train/gns/")
    assert logs.msg == {} and logs.step is None
    logs(Measurement(1.0, 2.0, 8, 1, {"name": "w", "step": 3}))
    assert logs.step == 3 and logs.msg == {"train/gns/w/norm": 1.0, "train/gns/w/pegn": 2.0, "train/gns/w/batch_size": 8}
    msg = logs.msg
    assert logs.get_msg() is msg and logs.msg == {} and logs.step == 3
    assert logs.get_msg() == {}


def test_tracker_feeds_accumulator_with_gpt_names():
    model = make_model()
    x, y = make_batch(4)
    train_step(model, [(x, y)])
    logs = AccumulateMeasurements()
    measurements = MeasurementTracker.from_model(model, callback=logs).step(batch_size=4)
    row = logs.pop()
    assert row["train/gns/transformer.h.1.ln_1.weight/batch_size"] == 4
    for m in measurements:
        assert row[f"train/gns/{m.metadata['name']}/norm"] == m.big_batch_norm
        assert row[f"train/gns/{m.metadata['name']}/pegn"] == m.small_batch_norm


def test_count_mismatch_is_reported():
    model = make_model()
    x, y = make_batch(4)
    tracker = MeasurementTracker.from_model(model)
    train_step(model, [(x, y)])
    with pytest.raises(ValueError, match="counted 4 examples but batch_size=8"):
        tracker.step(batch_size=8)
    # buffers left unzeroed from a previous step show up the same way
    train_step(model, [(x, y)])
    fill_buffers(model, x, y, 4)
    with pytest.raises(ValueError, match="counted 8 examples"):
        tracker.step(batch_size=4)


def test_parameters_without_gradient_are_left_out():
    model = make_model()
    x, y = make_batch(4)
    train_step(model, [(x, y)])
    model.transformer.ln_f.bias.grad = None
    names = [m.metadata["name"] for m in MeasurementTracker.from_model(model).step(batch_size=4)]
    assert "transformer.ln_f.bias" not in names and "transformer.ln_f.weight" in names
    assert buffers_are_zero(model)


def test_module_that_did_not_run_is_left_out():
    # a gradient kept from before (zero_grad(set_to_none=False)) but no examples counted this step
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    a.grad, b.grad = torch.ones(3), torch.zeros(2)
    f32 = dict(dtype=torch.float32)
    entries = [("a", a, torch.full((), 0.5, **f32), torch.full((), 4.0, **f32)),
               ("b", b, torch.zeros((), **f32), torch.zeros((), **f32))]
    measurements = MeasurementTracker(entries).step(batch_size=4)
    assert [m.metadata["name"] for m in measurements] == ["a"]


def test_step_without_gradients_still_zeroes_the_buffers():
    model = make_model()
    x, y = make_batch(4)
    train_step(model, [(x, y)])
    assert not buffers_are_zero(model)
    model.zero_grad(set_to_none=True)
    assert MeasurementTracker.from_model(model).step(batch_size=4) == []
    assert buffers_are_zero(model)


def test_step_count_counts_calls_and_is_the_default_step():
    p = torch.nn.Parameter(torch.zeros(2))
    tracker = MeasurementTracker([("p", p, torch.zeros(()), torch.zeros(()))])
    steps = []
    for given in (None, None, 10, None):
        p.grad = torch.ones(2)
        tracker.entries[0][2].fill_(1.0)
        tracker.entries[0][3].fill_(2.0)
        steps.append(tracker.step(step=given)[0].metadata["step"])
    # as in the reference: a given step goes into the metadata, the default is the number of calls
    assert steps == [0, 1, 10, 3] and tracker.step_count == 4


def test_float16_gradient_past_float16_range():
    # every element finite (300), the norm (~1.3e5) past float16's largest value: measured in float32
    p = torch.nn.Parameter(torch.zeros(200_000, dtype=torch.float16))
    p.grad = torch.full((200_000,), 300.0, dtype=torch.float16)
    measurement, = MeasurementTracker([("w", p, torch.full((), 1.0), torch.full((), 4.0))]).step(batch_size=4)
    assert measurement.big_batch_norm == pytest.approx(300.0 * 200_000 ** 0.5, rel=1e-6)


def test_from_model_unwraps_compile_and_requires_buffers():
    model = make_model()
    tracker = MeasurementTracker.from_model(torch.compile(model))
    assert [n for n, *_ in tracker.entries] == [n for n, _ in model.named_parameters()]
    with pytest.raises(ValueError, match="no per-example gradient norm buffers"):
        MeasurementTracker.from_model(torch.nn.Linear(2, 2))


def test_formula_in_docstring_gives_unbiased_estimates():
    """|G_1|^2 and |G_B|^2 from the tracker, put through McCandlish's estimators, are exact for
    the batch's own sample statistics: tr(S) is the sum of the per-coordinate sample variances."""
    model = make_model()
    x, y = make_batch(10)
    train_step(model, [(x, y)])
    grads = per_example_grads(model, regression_loss, x, y)
    for m in MeasurementTracker.from_model(model).step(batch_size=10):
        g = grads[m.metadata["name"]].flatten(1).double()
        B = m.big_batch_size
        trace = (m.small_batch_norm ** 2 - m.big_batch_norm ** 2) / (1 - 1 / B)
        sq_norm = (B * m.big_batch_norm ** 2 - m.small_batch_norm ** 2) / (B - 1)
        assert trace == pytest.approx(g.var(0, unbiased=True).sum().item(), rel=1e-4, abs=1e-10)
        # |mean|^2 - tr(S)/B is the unbiased |G|^2
        assert sq_norm == pytest.approx((g.mean(0).pow(2).sum() - g.var(0).sum() / B).item(), rel=1e-4, abs=1e-10)


@pytest.mark.parametrize("threads", [1, 2])
def test_big_batch_norm_of_a_large_gradient_is_precise(threads):
    # 7M elements: on CPU a float32 vector_norm is off by ~5e-4 relative in |G|^2 here, one
    # dot by 1.6e-4 on one thread (6e-5 on two), the dots over 64k-element pieces by ~1e-7
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check_large_gradient_norm()
    finally:
        torch.set_num_threads(before)


def check_large_gradient_norm():
    p = torch.nn.Parameter(torch.zeros(7 << 20))
    p.grad = torch.randn(7 << 20, generator=torch.Generator().manual_seed(0)) * 1e-2
    sq, count = torch.full((), 3.0), torch.full((), 4.0)
    measurement, = MeasurementTracker([("w", p, sq, count)]).step(batch_size=4)
    expected = p.grad.double().square().sum().sqrt().item()
    assert abs(measurement.big_batch_norm - expected) / expected < 2e-6


# ---------------------------------------------------------------- the reference implementation's names

def test_measurement_msg_and_str():
    m = Measurement(1.5, 2.5, 32, 1, {"name": "transformer.wte.weight", "step": 7})
    assert m.msg() == {"big_batch_norm": 1.5, "small_batch_norm": 2.5, "big_batch_size": 32, "small_batch_size": 1}
    assert m.msg(prefix="ddp/") == {"ddp/big_batch_norm": 1.5, "ddp/small_batch_norm": 2.5,
                                    "ddp/big_batch_size": 32, "ddp/small_batch_size": 1}
    assert str(m) == "name transformer.wte.weight, step 7: |G_B| 1.5 over 32 examples, |G_b| 2.5 over 1"
    bare = Measurement(3.0, 4.0, 16, 8)  # positional, as the reference's train.py builds the DDP one
    assert bare.metadata is None and str(bare) == "|G_B| 3 over 16 examples, |G_b| 4 over 8"


def test_measurements_keeps_what_the_reference_keeps():
    model = make_model()
    x, y = make_batch(4)
    # no callback: every measurement of every step
    tracker = MeasurementTracker.from_model(model)
    for _ in range(2):
        train_step(model, [(x, y)])
        returned = tracker.step(batch_size=4)
        model.zero_grad()
    n = len(list(model.parameters()))
    assert len(tracker.measurements) == 2 * n and tracker.measurements[n:] == returned
    assert [m.metadata["step"] for m in tracker.measurements] == [0] * n + [1] * n
    tracker = MeasurementTracker.from_model(model, callback=[])  # an empty list is no callback
    train_step(model, [(x, y)])
    assert tracker.step(batch_size=4) == tracker.measurements
    model.zero_grad()
    # a callback that returns nothing (AccumulateMeasurements): nothing kept
    tracker = MeasurementTracker.from_model(model, callback=AccumulateMeasurements())
    train_step(model, [(x, y)])
    assert len(tracker.step(batch_size=4)) == n and tracker.measurements == []
    model.zero_grad()
    # a callback that returns a replacement: the replacement
    tracker = MeasurementTracker.from_model(model, callback=lambda m: m.big_batch_norm)
    train_step(model, [(x, y)])
    returned = tracker.step(batch_size=4)
    assert tracker.measurements == returned and all(isinstance(v, float) for v in returned)


def test_from_model_takes_the_reference_positional_order_and_enforces_coverage():
    model = make_model()
    x, y = make_batch(8)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 6)
    logs = AccumulateMeasurements()
    # (model, callback, enforce_coverage, scaler), as the reference; world_size after
    tracker = MeasurementTracker.from_model(model, logs, True, scaler)
    assert tracker.callback is logs and tracker.scaler is scaler and tracker.world_size == 1
    assert tracker.names == [n for n, _ in model.named_parameters()]
    B = train_step(model, [(x, y)], scaler=scaler)
    assert_matches_brute_force(tracker.step(batch_size=B), model, x, y, B)
    assert len(logs.pop()) == 3 * len(tracker.names)
    # a trainable parameter whose layer does not measure: named
    torch.manual_seed(0)
    partly = ToyGPT()
    measure(partly.transformer)
    with pytest.raises(ValueError, match=r"^enforce_coverage: the trainable parameter head\.weight has no "
                                         r"per-example gradient norm buffer \("):
        MeasurementTracker.from_model(partly, enforce_coverage=True)
    assert "head.weight" not in MeasurementTracker.from_model(partly).names  # without it: left out
    partly.head.weight.requires_grad_(False)  # a frozen one is not missing
    assert MeasurementTracker.from_model(partly, enforce_coverage=True).names == \
        [n for n, p in partly.named_parameters() if p.requires_grad]


@pytest.mark.parametrize("call", [
    lambda p, b: MeasurementTracker([(p, b)]),
    lambda p, b: MeasurementTracker([(p, b)], names=["w"], indexes=[0]),
    lambda p, b: MeasurementTracker([("w", p, b[0], b[1])], shared_params=[]),
])
def test_the_reference_constructor_form_is_refused_with_from_model(call):
    p, upegsqnorm = torch.nn.Parameter(torch.zeros(3)), torch.zeros(2)
    with pytest.raises(ReferenceNameError, match=r"reference implementation's constructor .* use "
                                                 r"MeasurementTracker\.from_model\(model, callback=\.\.\., scaler=\.\.\.\)"):
        call(p, upegsqnorm)


@pytest.mark.parametrize("name, hint", [("params_and_buffers", ".entries"), ("indexes", ".names"),
                                        ("shared_params", "buffered.tie_weights")])
def test_reference_tracker_attributes_not_kept_are_refused(name, hint):
    tracker = MeasurementTracker.from_model(make_model())
    with pytest.raises(ReferenceNameError, match=rf"MeasurementTracker\.{name} is the reference implementation's.*{hint}"):
        getattr(tracker, name)


@pytest.mark.parametrize("name, hint", [("exists", "is not None"), ("shared_weights", "buffered.tie_weights"),
                                        ("named_parameters_and_buffers", "buffered.find_sqgradnorm_buffers")])
def test_reference_module_helpers_are_refused(name, hint):
    with pytest.raises(ReferenceNameError, match=rf"gnstracking\.{name} is the reference implementation's.*{hint}"):
        getattr(gnstracking, name)


REFERENCE_STYLE_SCRIPT = textwrap.dedent('''
    # the calls the reference implementation's train.py makes, in its order, on a GPT of our layers
    import json, math, sys
    import torch
    sys.path.insert(0, {root!r})
    import nanogns.layers.config as lc
    from nanogns.layers import (PEGradNormLinear, PEGradNormEmbedding, PEGradNormSeparatedLayerNorm,
                          zero_sqgradnorm_buffers)
    import nanogns.estimators.exact as gnstracking
    import nanogns.estimators.ddp as ddpgns
    from nanogns.runlog import LogWrapper

    with lc.set_contextual_config(Linear=PEGradNormLinear, Embedding=PEGradNormEmbedding,
                                  LayerNorm=PEGradNormSeparatedLayerNorm):
        from model import GPTConfig, GPT
        torch.manual_seed(0)
        model = GPT(GPTConfig(block_size=8, vocab_size=32, n_layer=1, n_head=2, n_embd=16))
    scaler = torch.amp.GradScaler('cpu', init_scale=2.0 ** 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    accumulate_gns = gnstracking.AccumulateMeasurements(prefix="train/gns/")
    gns_tracker = gnstracking.MeasurementTracker.from_model(model, callback=accumulate_gns, scaler=scaler)
    ddp_gns_stats = ddpgns.GradientNoiseScale()
    rows, raw = [], []
    def log(msg):
        rows.append(dict(msg))
    tracker = LogWrapper(log, config=dict(batch_size=4), out_dir={out!r})
    ga_steps, batch_size, log_interval = 2, 4, 2
    g = torch.Generator().manual_seed(1)
    for iter_num in range(4):
        for micro_step in range(ga_steps):
            X = torch.randint(0, 32, (batch_size, 8), generator=g)
            logits, loss = model(X, X)
            loss = loss / ga_steps
            scaler.scale(loss).backward()
        gns_tracker.step(batch_size=ga_steps * batch_size * 1)
        zero_sqgradnorm_buffers(model)
        scaler.unscale_(optimizer)
        grad_norm = math.sqrt(sum(p.grad.norm().item() ** 2 for p in model.parameters()))
        # stand-ins for the DDP hook's numbers: two "ranks" of one process
        sq_norm_small_batch, sq_norm_large_batch = 2 * grad_norm ** 2, grad_norm ** 2
        big_batch_size, small_batch_size = X.shape[0] * 2 * ga_steps, X.shape[0] * ga_steps
        ddp_gns_stats.update(sq_norm_small_batch, sq_norm_large_batch, small_batch_size, big_batch_size)
        raw.append((sq_norm_small_batch, sq_norm_large_batch))
        ddp_gns_measurement = gnstracking.Measurement(sq_norm_large_batch ** 0.5, sq_norm_small_batch ** 0.5,
                                                      big_batch_size, small_batch_size)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if iter_num % log_interval == 0:
            lossf = loss.item() * ga_steps
            tracker.log({{"dt": 0.5, "lr": 0.1, "grad_norm": grad_norm, "train/lossf": lossf}})
            tracker.print(f"{{iter_num=}}: " + "{{train_lossf=:.4f}}, dt={{dt:.3f}}s")
            tracker.log(ddp_gns_measurement.msg(prefix="ddp/"))
            tracker.log(ddp_gns_stats.get_msg(prefix="ddp/"))
        tracker.log({{
            **accumulate_gns.get_msg(),
        }})
        if tracker.log_dict:
            tracker.log({{"iter_num": iter_num, "tokens_processed": (iter_num + 1) * ga_steps * batch_size * 8}})
        tracker.step()
    tracker.close()
    names = [n for n, _ in model.named_parameters()]
    json.dump(dict(rows=rows, raw=raw, names=names), open({out!r} + "/script.json", "w"))
''')


@pytest.mark.slow
def test_a_script_written_for_the_reference_runs_unchanged(tmp_path):
    out = tmp_path / "out"
    script = REFERENCE_STYLE_SCRIPT.format(root=REPO, out=str(out))
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stderr[-3000:]
    printed = [line for line in p.stdout.splitlines() if line.startswith("iter_num=")]
    assert [line.split(": ")[0] for line in printed] == ["iter_num=0", "iter_num=2"]
    assert all("train/lossf=" in line and line.endswith("dt=0.500s") for line in printed)
    df, _ = load_log(out)
    assert df["step"].tolist() == df["iter_num"].tolist() == [0, 1, 2, 3]
    ran = json.load(open(out / "script.json"))
    # every parameter of the GPT (the tied wte/lm_head once), measured on every row, one batch size
    names = ran["names"]
    assert {c[len("train/gns/"):-len("/norm")] for c in df.columns if c.endswith("/norm") and
            c.startswith("train/gns/")} == set(names)
    for kind in ("norm", "pegn", "batch_size"):
        assert df[[f"train/gns/{n}/{kind}" for n in names]].notna().all().all(), kind
    assert (df[[f"train/gns/{n}/batch_size" for n in names]] == 8).all().all()
    # the DDP columns on the logged iterations, smoothed with the reference's default beta 0.995
    replay = ddpgns.GradientNoiseScale(beta=0.995)
    for iter_num, (sq_small, sq_big) in enumerate(ran["raw"]):
        replay.update(sq_small, sq_big, 8, 16)
        row = df[df["iter_num"] == iter_num].iloc[0]
        if iter_num % 2:
            assert np.isnan(row["ddp/gns"])
            continue
        assert row["ddp/big_batch_norm"] == pytest.approx(sq_big ** 0.5, rel=1e-12)
        assert row["ddp/small_batch_norm"] == pytest.approx(sq_small ** 0.5, rel=1e-12)
        assert (row["ddp/big_batch_size"], row["ddp/small_batch_size"]) == (16, 8)
        for key, value in replay.get_msg("ddp/").items():
            assert row[key] == pytest.approx(value, rel=1e-12), key
    # logf got the rows without a "step" key, as many as the CSV has
    assert len(ran["rows"]) == 4 and all("step" not in r for r in ran["rows"])
    assert [r["iter_num"] for r in ran["rows"]] == [0, 1, 2, 3]


# ---------------------------------------------------------------- the maths' home is nanogns/maths.py (tests/test_maths.py)

def test_ddpgns_keeps_the_same_gradient_noise_scale_class():
    assert ddpgns.GradientNoiseScale is gnstracking.GradientNoiseScale is gnsmath.GradientNoiseScale


def test_accumulate_measurements_writes_a_small_batch_above_one():
    """Else a reader takes a micro-batch's norm for a per-example one (b = 1) and gets the GNS b times off."""
    logs = AccumulateMeasurements(prefix="x")
    logs(Measurement(1.0, 2.0, 16, 4, {"name": "w", "step": 0}))
    assert logs.pop() == {"x/w/norm": 1.0, "x/w/pegn": 2.0, "x/w/batch_size": 16, "x/w/small_batch_size": 4}


# ---------------------------------------------------------------- every estimator behind one interface

def gpt_micro_batches(steps, m, b, seed=5):
    batches = gpt_batches(steps * m, b, seed)
    return [batches[k * m:(k + 1) * m] for k in range(steps)]


def backward(model, micro_batches, scaler):
    for X, Y in micro_batches:
        scaler.scale(model(X, Y)[1] / len(micro_batches)).backward()


def todays_run(model, steps, hooks, scaler):
    """The loop as train.py ran each estimator before the interface: the exact tracker before
    scaler.unscale_, the hooks and micro-batch ones after it, each zeroed its own way."""
    import nanogns.estimators.hooks as gnshooks
    from nanogns.estimators.microbatch import MicrobatchGNS
    logs = AccumulateMeasurements(prefix="train/gns")
    tracker = MeasurementTracker.from_model(model, callback=logs, scaler=scaler)
    live_gns = gnstracking.GradientNoiseScale(beta=0.99)
    gnshooks.add_hooks_to_model(model, {"exact": gnshooks.add_exact_hooks, "sogns": gnshooks.add_sogns_hooks}[hooks])
    microbatch = MicrobatchGNS(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rows = []
    for step, micro_batches in enumerate(steps):
        backward(model, micro_batches, scaler)
        B = sum(len(X) for X, _ in micro_batches)
        measurements = tracker.step(batch_size=B, step=step)
        live_gns.update(sum(m.small_batch_norm ** 2 for m in measurements),
                        sum(m.big_batch_norm ** 2 for m in measurements), 1, B)
        row = logs.pop()
        scaler.unscale_(opt)
        row.update(gnshooks.hook_measurements(model, hooks, loss_scale=scaler.get_scale()))
        row.update(microbatch.measurements(len(micro_batches[0][0]), loss_scale=scaler.get_scale()))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        buffered.zero_sqgradnorm_buffers(model)
        gnshooks.zero_hook_results(model)
        microbatch.zero()
        rows.append((row, f"gns {live_gns.get_gns():.4g}"))
    return rows, live_gns.state_dict()


def interface_run(model, steps, hooks, scaler):
    estimators = gnstracking.estimators_for(model, hooks=hooks, microbatch=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rows = []
    for step, micro_batches in enumerate(steps):
        backward(model, micro_batches, scaler)
        row = gnstracking.measure_all(estimators, step, sum(len(X) for X, _ in micro_batches), scaler)
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        gnstracking.reset_all(estimators)
        rows.append((row, gnstracking.status_line(estimators)))
    return rows, estimators


@pytest.mark.parametrize("hooks", ["exact", "sogns"])
@pytest.mark.parametrize("scale", [None, 2.0 ** 12], ids=["no-scaler", "grad-scaler"])
def test_the_interface_logs_what_todays_functions_log(hooks, scale):
    """Three steps of two micro-steps: the same columns, in the same order, with the same numbers,
    to the bit (the hooks and micro-batch estimators now read p.grad before unscale_ and divide the
    scale out: a power of two, as GradScaler's always is, divides exactly). Two models: their
    Linears choose from the shapes, as two timed choices need not agree."""
    steps = gpt_micro_batches(3, 2, 3)
    make_scaler = lambda: torch.amp.GradScaler("cpu", init_scale=scale or 1.0, enabled=scale is not None)
    models = [tiny_gpt(**MEASURED), tiny_gpt(**MEASURED)]
    for model in models:
        buffered.set_per_example_mode(model, "shapes")
    want, live_state = todays_run(models[0], steps, hooks, make_scaler())
    got, estimators = interface_run(models[1], steps, hooks, make_scaler())
    assert [e.name for e in estimators] == ["train/gns", f"train/{'hooks_gns' if hooks == 'exact' else 'sogns'}",
                                            "train/microbatch_gns"]
    for (want_row, want_status), (got_row, got_status) in zip(want, got):
        assert list(got_row) == list(want_row)
        assert {c.split("/")[1] for c in got_row} == {"gns", "microbatch_gns", "hooks_gns" if hooks == "exact" else "sogns"}
        assert got_row == want_row
        assert got_status == want_status and got_status.startswith("gns ")
    assert estimators[0].state_dict() == {**live_state, "skipped_steps": 0}


def test_the_interface_reads_p_grad_before_unscale_and_divides_the_scale_out():
    """Against a run without a scaler, on the same batches: a scale left in would be off 4096x."""
    steps = gpt_micro_batches(1, 2, 3)
    plain, _ = interface_run(tiny_gpt(**MEASURED), steps, "exact", torch.amp.GradScaler("cpu", enabled=False))
    scaled, _ = interface_run(tiny_gpt(**MEASURED), steps, "exact", torch.amp.GradScaler("cpu", init_scale=2.0 ** 12))
    assert plain[0][0].keys() == scaled[0][0].keys()
    for c, v in plain[0][0].items():
        assert scaled[0][0][c] == pytest.approx(v, rel=1e-5), c


def test_estimators_for_builds_what_the_model_and_flags_ask_for():
    plain = torch.nn.Linear(3, 2)
    assert gnstracking.estimators_for(plain) == [] and gnstracking.skipped_steps([]) == 0
    assert gnstracking.status_line([]) == "" and gnstracking.measure_all([], 0, 4, None) == {}
    names = [e.name for e in gnstracking.estimators_for(torch.compile(make_model()), microbatch=True)]
    assert names == ["train/gns", "train/microbatch_gns"]
    assert [e.name for e in gnstracking.estimators_for(torch.nn.Linear(3, 2), hooks="sogns")] == ["train/sogns"]
    with pytest.raises(ValueError, match=r"^hooks='ghost' is not one of none, exact, sogns$"):
        gnstracking.estimators_for(plain, hooks="ghost")
    with pytest.raises(ValueError, match=r"world_size=2: the DDP estimator needs the DistributedDataParallel model"):
        gnstracking.estimators_for(plain, world_size=2)
    # nothing to measure, nothing to keep, nothing to say
    hooks, = gnstracking.estimators_for(torch.nn.Linear(3, 2), hooks="exact")
    assert hooks.status() == "" and hooks.state_dict() == {} and hooks.skipped_steps == 0
    with pytest.raises(ValueError, match="keeps no state"):
        hooks.load_state_dict({"beta": 0.9})


def test_the_exact_estimator_counts_skipped_steps_and_takes_one_example():
    model = make_model()
    exact, = gnstracking.estimators_for(model)
    x, y = make_batch(4)
    train_step(model, [(x, y)])
    model.head.weight.grad.fill_(float("inf"))
    row = exact.measure(0, 4, None)
    assert exact.skipped_steps == gnstracking.skipped_steps([exact]) == 1 and all(v == math.inf for k, v in row.items() if not k.endswith("batch_size"))
    model.zero_grad()
    exact.reset()
    train_step(model, [(x[:1], y[:1])])
    row = exact.measure(1, 1, None)  # B = 1: measured, but no small batch for the live GNS
    assert row["train/gns/head.weight/batch_size"] == 1 and exact.status() == "gns nan"


def test_reset_zeroes_the_buffers():
    model = make_model()
    exact, = gnstracking.estimators_for(model)
    x, y = make_batch(4)
    train_step(model, [(x, y)])
    assert not buffers_are_zero(model)
    exact.reset()  # a step where measure() was not called
    assert buffers_are_zero(model)


def run_exact(model, steps=3):
    exact, = gnstracking.estimators_for(model)
    for step in range(steps):
        x, y = make_batch(6, seed=step)
        train_step(model, [(x, y)])
        exact.measure(step, 6, None)
        model.zero_grad()
    return exact


def test_checkpoint_states_round_trip_and_older_checkpoints_load(tmp_path):
    exact = run_exact(make_model())
    ddp = object.__new__(ddpgns.DDPGNS)  # its state alone (the hook needs a process group)
    ddp.gns = gnstracking.GradientNoiseScale()
    ddp.gns.update(5.0, 1.0, 4, 8)
    checkpoint = {"model": {}}
    gnstracking.save_states([exact, ddp], checkpoint)
    assert set(checkpoint["gns_estimators"]) == {"train/gns", "ddp"}
    torch.save(checkpoint, tmp_path / "ckpt.pt")
    loaded = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    fresh_exact, fresh_ddp = gnstracking.estimators_for(make_model())[0], object.__new__(ddpgns.DDPGNS)
    fresh_ddp.gns = gnstracking.GradientNoiseScale()
    gnstracking.load_states([fresh_exact, fresh_ddp], loaded)
    assert fresh_exact.state_dict() == exact.state_dict() and fresh_ddp.state_dict() == ddp.state_dict()
    assert fresh_exact.gns.beta == 0.99 and fresh_ddp.gns.beta == 0.995
    assert fresh_exact.status() == exact.status() != "gns nan"
    # this fork's older checkpoints: the two states under keys of their own
    older = {"live_gns": exact.state_dict(), "ddp_gns": ddp.state_dict()}
    again, again_ddp = gnstracking.estimators_for(make_model())[0], object.__new__(ddpgns.DDPGNS)
    again_ddp.gns = gnstracking.GradientNoiseScale()
    gnstracking.load_states([again, again_ddp], older)
    assert again.state_dict() == exact.state_dict() and again_ddp.state_dict() == ddp.state_dict()
    # nanoGPT's and the reference's checkpoints have none: fresh; a state without its estimator: ignored
    nothing = gnstracking.estimators_for(make_model())
    gnstracking.load_states(nothing, {"model": {}, "iter_num": 3})
    gnstracking.load_states(nothing, {"ddp_gns": ddp.state_dict()})
    assert nothing[0].status() == "gns nan"


def test_the_linears_methods_go_into_the_checkpoint_and_a_resumed_model_keeps_them():
    """A resumed run measures as the run it continues: each measured Linear's method ('auto': chosen
    at its first call) is saved with the estimators' states and restored before any step."""
    model = tiny_gpt(0, **MEASURED)
    exact, = gnstracking.estimators_for(model)
    for step, (x, y) in enumerate(gpt_batches(2, 3)):
        model(x, y)[1].backward()
        exact.measure(step, 3, None)
        exact.reset()
        model.zero_grad()
    methods = buffered.linear_norm_methods(model)
    assert len(methods) == len(buffered.measured_linears(model)) > 0
    checkpoint = {}
    gnstracking.save_states([exact], checkpoint)
    assert checkpoint[gnstracking.METHODS_KEY] == methods
    # the opposite of each, so that a fresh choice could not give them back by chance
    flipped = {name: "ghost" if method == "materialise" else "materialise" for name, method in methods.items()}
    checkpoint[gnstracking.METHODS_KEY] = flipped
    fresh = tiny_gpt(0, **MEASURED)
    assert buffered.linear_norm_methods(fresh) == {}
    gnstracking.estimators_for(fresh, checkpoint=checkpoint)
    assert buffered.linear_norm_methods(fresh) == flipped
    x, y = gpt_batches(1, 3, seed=9)[0]
    fresh(x, y)[1].backward()
    assert buffered.linear_norm_methods(fresh) == flipped  # kept, not chosen again


def test_the_layernorm_group_has_a_live_gns_of_its_own():
    """live_gns('LayerNorm') is the EMA of the estimates from the LayerNorm parameters' sums alone,
    'total' from all of them: both against a GradientNoiseScale fed from the brute-force norms."""
    model = make_model()
    exact, = gnstracking.estimators_for(model)
    assert gnstracking.measured_groups([exact]) == ["total", "LayerNorm"]
    expected = {"total": gnstracking.GradientNoiseScale(0.99), "LayerNorm": gnstracking.GradientNoiseScale(0.99)}
    for step in range(4):
        x, y = make_batch(6, seed=step)
        norms = brute_force_norms(model, regression_loss, x, y)
        train_step(model, [(x, y)])
        exact.measure(step, 6, None)
        model.zero_grad()
        for group, gns in expected.items():
            members = [v for name, v in norms.items() if group == "total" or ".ln_" in f".{name}"]
            gns.update(sum(small ** 2 for _, small in members), sum(big ** 2 for big, _ in members), 1, 6)
    for group, gns in expected.items():
        value, averaged = gnstracking.live_gns([exact], group)
        assert averaged == 4 and value == pytest.approx(gns.get_gns(), rel=1e-4), group
    assert gnstracking.live_gns([exact], "LayerNorm")[0] != pytest.approx(gnstracking.live_gns([exact])[0], rel=1e-3)
    # the groups' states go into the checkpoint and come back; an older checkpoint (the total alone) loads
    checkpoint = {}
    gnstracking.save_states([exact], checkpoint)
    fresh, = gnstracking.estimators_for(make_model())
    gnstracking.load_states([fresh], checkpoint)
    assert gnstracking.live_gns([fresh], "LayerNorm") == gnstracking.live_gns([exact], "LayerNorm")
    assert gnstracking.live_gns([fresh]) == gnstracking.live_gns([exact])
    del checkpoint[gnstracking.GROUPS_KEY]
    again, = gnstracking.estimators_for(make_model())
    gnstracking.load_states([again], checkpoint)
    assert again.gns.state_dict() == exact.gns.state_dict() and gnstracking.live_gns([again], "LayerNorm")[1] == 0


def test_measured_groups_put_layernorm_first_when_it_is_all_that_is_measured():
    from nanogns.layers.config import classes_for_flags
    only_ln = gnstracking.estimators_for(tiny_gpt(0, **classes_for_flags(lnclass="shim")))
    assert gnstracking.measured_groups(only_ln) == ["LayerNorm", "total"]
    no_ln = gnstracking.estimators_for(tiny_gpt(0, **classes_for_flags(linearclass="gns")))
    assert gnstracking.measured_groups(no_ln) == ["total"]
    assert gnstracking.measured_groups([]) == [] and math.isnan(gnstracking.live_gns([])[0])
    assert gnstracking.live_gns(no_ln, "LayerNorm")[1] == 0


def test_the_gradients_squared_norms_from_one_multi_tensor_kernel_are_the_dots():
    """On a GPU the tracker takes every ||grad||^2 from torch._foreach_norm (one launch, not one per
    gradient); they are the per-gradient dots' numbers within float32 rounding."""
    from nanogns.estimators.exact import _grad_sqnorms
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(shape, generator=generator) * scale
             for shape, scale in (((7,), 1e-3), ((33, 17), 1.0), ((512, 96), 30.0), ((1,), 0.0))]
    dots = _grad_sqnorms(grads, torch.device("cpu"), foreach=False)
    fused = _grad_sqnorms(grads, torch.device("cpu"), foreach=True)
    assert len(fused) == len(grads) and all(f.dim() == 0 and f.dtype == torch.float32 for f in fused)
    torch.testing.assert_close(torch.stack(fused), torch.stack(dots), rtol=1e-6, atol=0)
    assert fused[-1].item() == 0.0


def test_a_step_the_optimizer_skips_is_skipped_by_the_estimator_too():
    """One decision: the optimizer's (from the norm of every gradient, measured or not). A step it skips,
    here for a non-finite gradient of a parameter no layer measures, neither enters the live GNS nor
    gives finite cells; a step it takes does both."""
    from nanogns.pending import PendingSteps
    model = make_model()
    estimator, = gnstracking.estimators_for(model)
    pending = PendingSteps()
    for step, skipped in enumerate([0.0, 1.0, 0.0]):
        x, y = make_batch(6, seed=step)
        train_step(model, [(x, y)])  # every measured gradient finite
        pending.add({"iter_num": step}, gnstracking.collect_all([estimator], step, 6, None, torch.tensor(skipped)))
        model.zero_grad()
        estimator.reset()
    rows = list(pending.read())
    assert estimator.skipped_steps == 1
    norms = [row["train/gns/head.weight/norm"] for row in rows]
    assert math.isfinite(norms[0]) and math.isinf(norms[1]) and math.isfinite(norms[2])
    # the live GNS is that of steps 0 and 2 alone
    alone = make_model()
    reference, = gnstracking.estimators_for(alone)
    for step in (0, 2):
        x, y = make_batch(6, seed=step)
        train_step(alone, [(x, y)])
        gnstracking.measure_all([reference], step, 6, None)
        alone.zero_grad()
        reference.reset()
    assert estimator.gns.state_dict() == pytest.approx(reference.gns.state_dict())


def test_the_count_of_skipped_steps_goes_into_the_checkpoint_and_comes_back():
    model = make_model()
    estimator, = gnstracking.estimators_for(model)
    x, y = make_batch(4)
    train_step(model, [(x, y)])
    next(model.parameters()).grad.fill_(math.inf)
    gnstracking.measure_all([estimator], 0, 4, None)
    assert estimator.skipped_steps == 1
    checkpoint = {}
    gnstracking.save_states([estimator], checkpoint)
    resumed, = gnstracking.estimators_for(make_model(), checkpoint=checkpoint)
    assert resumed.skipped_steps == 1 and resumed.gns.state_dict() == estimator.gns.state_dict()
    # a checkpoint from before the count was kept resumes with none counted
    older = {gnstracking.CHECKPOINT_KEY: {"train/gns/": estimator.gns.state_dict()}}
    assert gnstracking.estimators_for(make_model(), checkpoint=older)[0].skipped_steps == 0


def _norm_and_linear():
    torch.manual_seed(3)
    return torch.nn.Sequential(buffered.PEGradNormFusedLayerNorm(16), buffered.PEGradNormLinear(16, 8))


def _gradients(model, way, x):
    """The parameters' .grad by way of backward(), backward(inputs=...) or torch.autograd.grad."""
    loss = model(x).square().mean()
    params = [p for p in model.parameters()]
    if way == "backward":
        loss.backward()
    elif way == "inputs":
        loss.backward(inputs=params)
    else:
        for p, g in zip(params, torch.autograd.grad(loss, params)):
            p.grad = g


@pytest.mark.parametrize("way", ["inputs", "autograd.grad"])
def test_eager_layers_measure_under_autograd_grad_and_backward_inputs(way):
    """In eager mode the layers' backward writes the sums itself, whichever call runs it."""
    x = torch.randn(4, 6, 16)
    expected, model = _norm_and_linear(), _norm_and_linear()
    _gradients(expected, "backward", x)
    _gradients(model, way, x)
    want = {n: (sq.item(), count.item()) for n, _, sq, count in buffered.find_sqgradnorm_buffers(expected)}
    got = {n: (sq.item(), count.item()) for n, _, sq, count in buffered.find_sqgradnorm_buffers(model)}
    assert got.keys() == want.keys() and all(count == 4 for _, count in got.values())
    for name in want:  # (each Linear chooses its method for itself: equal up to rounding)
        assert got[name] == pytest.approx(want[name], rel=1e-6)


@pytest.mark.parametrize("way", ["inputs", "autograd.grad"])
def test_compiled_parameters_whose_sums_went_astray_are_named_once(way):
    """Compiled, a measured layer's sums leave the backward as its sink's gradient, which
    backward(inputs=) and autograd.grad do not compute: the tracker names the parameters that got a
    gradient without sums, once, rather than leave them out in silence; a layer not run stays quiet."""
    model = _norm_and_linear()
    model.append(buffered.PEGradNormLinear(8, 8))  # in the model, never run: no gradient, no warning
    compiled = torch.compile(model[:2], backend="aot_eager")
    tracker = MeasurementTracker(buffered.find_sqgradnorm_buffers(model))
    _gradients(compiled, way, torch.randn(4, 6, 16))
    with pytest.warns(UserWarning, match=r"^0\.weight, 0\.bias, 1\.weight, 1\.bias: received a gradient but no per-example sums") as seen:
        names = [m.metadata["name"] for m in tracker.step()]
    assert len([w for w in seen if "per-example sums" in str(w.message)]) == 1
    assert "0.weight" not in names and "2.weight" not in " ".join(str(w.message) for w in seen)
    model.zero_grad()
    _gradients(compiled, way, torch.randn(4, 6, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # named once: not again
        tracker.step()
