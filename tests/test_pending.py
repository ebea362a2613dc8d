"""nanogns/pending.py: the loop's per-step values read in one copy, the estimators' collected sums finished
in step order, the same rows as reading every step."""
import math

import pytest
import torch

import nanogns.estimators.exact as gnstracking
from gns_fixtures import brute_force_norms, regression_loss, train_step
from nanogns.pending import PendingSteps
from nanogns.layers import measure
from test_estimators_adam import Net, batches, example_loss
from test_estimators_exact import make_batch, make_model


def count_copies(monkeypatch):
    """The bytes of each copy to the host (Tensor.cpu) and each read of values (item, tolist), as they come."""
    calls = []
    for name in ("cpu", "tolist", "item"):
        method = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, method=method, name=name, *a, **k:
                            calls.append((name, self.numel() * self.element_size())) or method(self, *a, **k))
    return calls


def test_every_pending_step_is_read_in_one_copy_into_its_own_row(monkeypatch):
    calls = count_copies(monkeypatch)
    pending = PendingSteps()
    rows, finished = [], []
    for step in range(4):
        row = {"iter_num": step, "loss": torch.tensor(step + 0.5, dtype=torch.bfloat16), "dt": 0.25,
               "norm": torch.tensor([2.0 * step])}
        collected = [(torch.arange(3.0) + 10 * step, lambda host, step=step: finished.append(step) or {"sums": sum(host)}),
                     (None, lambda host: {"read": len(host)})]
        pending.add(row, collected)
        rows.append(row)
    assert len(pending) == 4 and calls == []  # nothing read while the steps go
    read = list(pending.read())
    assert calls == [("cpu", 4 * (2 + 4 + 3 * 4))]  # one copy of all of them, each in its own dtype
    assert read == rows and read[2] is rows[2]  # the rows themselves, filled in where they stand
    assert read[2] == {"iter_num": 2, "loss": 2.5, "dt": 0.25, "norm": 4.0, "sums": 63.0, "read": 0}
    assert list(read[0]) == ["iter_num", "loss", "dt", "norm", "sums", "read"]
    assert finished == [0, 1, 2, 3] and len(pending) == 0
    assert list(pending.read()) == [] and len(calls) == 1  # nothing pending: no copy


def test_the_exact_estimator_read_later_gives_what_it_gives_read_each_step():
    """Three steps collected and read together: the same rows (against brute force), the same live
    GNS and skipped count as measure() every step; the buffers zeroed at each collect."""
    now_model, later_model = make_model(), make_model()
    now, = gnstracking.estimators_for(now_model)
    later, = gnstracking.estimators_for(later_model)
    pending, expected = PendingSteps(), []
    for step in range(3):
        x, y = make_batch(6, seed=step)
        norms = brute_force_norms(now_model, regression_loss, x, y)
        for model in (now_model, later_model):
            train_step(model, [(x[:3], y[:3]), (x[3:], y[3:])])
        if step == 1:  # a non-finite step: counted, and its cells inf
            for model in (now_model, later_model):
                model.head.weight.grad.fill_(math.inf)
        expected.append(gnstracking.measure_all([now], step, 6, None))
        pending.add({"iter_num": step}, gnstracking.collect_all([later], step, 6, None))
        assert all(float(sq) == 0 for sq in later.buffers)
        if step != 1:
            for name, (big, small) in norms.items():
                assert expected[-1][f"train/gns/{name}/pegn"] == pytest.approx(small, rel=1e-5)
        for model, e in ((now_model, now), (later_model, later)):
            model.zero_grad()
            e.reset()
    assert later.skipped_steps == 0 and later.gns.state_dict() != now.gns.state_dict()  # not yet read
    rows = list(pending.read())
    assert [{k: v for k, v in row.items() if k != "iter_num"} for row in rows] == expected
    assert math.isinf(rows[1]["train/gns/head.weight/norm"]) and later.skipped_steps == now.skipped_steps == 1
    assert later.gns.state_dict() == now.gns.state_dict() and later.status() == now.status()
    assert later.groups["LayerNorm"].state_dict() == now.groups["LayerNorm"].state_dict()


class Halves(gnstracking.Estimator):
    """An estimator of the two parts alone: its sums on the device, its finish on the host."""
    def __init__(self):
        self.finished = []

    def sums(self, step, examples, scaler, skipped=None):
        return (torch.tensor([step, examples / 2]), step) if step >= 0 else (None, step)

    def finish(self, host, context):
        self.finished.append(context)
        return {"step": context, "host": list(host)}


def test_an_estimators_two_parts_make_its_measure_and_its_collect(monkeypatch):
    """measure() reads and finishes at once; collect() leaves the values on the device and finishes
    when they are read; an estimator that is not deferred reads and finishes when collected."""
    estimator = Halves()
    assert estimator.measure(3, 8, None) == {"step": 3, "host": [3.0, 4.0]} and estimator.finished == [3]
    assert estimator.measure(-1, 8, None) == {"step": -1, "host": []}  # nothing on the device: nothing read
    calls = count_copies(monkeypatch)
    values, finish = estimator.collect(5, 6, None)
    assert calls == [] and estimator.finished == [3, -1]  # nothing read, nothing finished yet
    assert finish([5.0, 3.0]) == {"step": 5, "host": [5.0, 3.0]} and estimator.finished == [3, -1, 5]
    estimator.deferred = False
    values, finish = estimator.collect(7, 2, None)
    assert values is None and calls == [("tolist", 8)] and estimator.finished == [3, -1, 5, 7]
    assert finish([]) == {"step": 7, "host": [7.0, 1.0]} and estimator.finished == [3, -1, 5, 7]


@pytest.mark.filterwarnings("ignore:measure:UserWarning")  # the Linears are left to the hooks
@pytest.mark.parametrize("which", ["hooks", "microbatch", "adam"])
def test_the_estimators_read_when_collected_give_what_measure_gives(monkeypatch, which):
    """The hooks', micro-batch and Adam estimators read their sums when collected (one read each) and
    give the rows measure() gives each step; their pending finish reads nothing more."""
    models, optimizers, built = [], [], []
    for _ in range(2):
        torch.manual_seed(0)
        model = measure(Net(), linear=None, embedding=None, norm="shim")  # nn.Linears: the hooks' to measure
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        estimators = gnstracking.estimators_for(model, hooks="exact" if which == "hooks" else "none",
                                                microbatch=which == "microbatch",
                                                adam_optimizer=optimizer if which == "adam" else None)
        models.append(model), optimizers.append(optimizer), built.append(estimators[-1])
    now, later = built
    pending, expected, reads = PendingSteps(), [], []
    for step in range(3):
        for model in models:
            for x, y in batches(step):
                (example_loss(model, x, y) / len(batches(step))).backward()
        expected.append(gnstracking.measure_all([now], step, 6, None))
        calls = count_copies(monkeypatch)
        pending.add({"iter_num": step}, gnstracking.collect_all([later], step, 6, None))
        reads.append(len(calls))
        monkeypatch.undo()
        for model, optimizer, e in zip(models, optimizers, built):
            optimizer.step()
            optimizer.zero_grad()
            e.reset()
    calls = count_copies(monkeypatch)
    rows = [{k: v for k, v in row.items() if k != "iter_num"} for row in pending.read()]
    assert calls == [] and rows == expected and any(rows)  # the first Adam step logs nothing (no state yet)
    assert reads == [1 if row else 0 for row in expected] and later.status() == now.status()


def test_each_value_keeps_its_dtype_and_an_int64_stays_exact():
    pending = PendingSteps()
    pending.add({"tokens": torch.tensor(123_456_789, dtype=torch.int64), "big": torch.tensor(2**53 - 1),
                 "flag": torch.tensor(True), "half": torch.tensor(0.1, dtype=torch.float16),
                 "bf16": torch.tensor(-3.140625, dtype=torch.bfloat16), "f64": torch.tensor(0.1, dtype=torch.float64),
                 "f32": torch.tensor(0.1), "i8": torch.tensor(-7, dtype=torch.int8), "plain": 5})
    row, = pending.read()
    assert row == {"tokens": 123_456_789, "big": 2**53 - 1, "flag": True, "half": float(torch.tensor(0.1).half()),
                   "bf16": -3.140625, "f64": 0.1, "f32": float(torch.tensor(0.1)), "i8": -7, "plain": 5}
    assert type(row["tokens"]) is int and type(row["flag"]) is bool and type(row["f32"]) is float


def test_a_finish_that_raises_keeps_the_rows_before_it():
    """A loop that logs each row as it comes keeps every good step before the one whose finish raises."""
    pending, logged = PendingSteps(), []
    def finish(host, step):
        if step == 2:
            raise ValueError("step 2's buffers counted 12 examples but batch_size=8")
        return {"sum": sum(host)}
    for step in range(4):
        pending.add({"iter_num": step, "loss": torch.tensor(float(step))},
                    [(torch.tensor([1.0, step]), lambda host, step=step: finish(host, step))])
    with pytest.raises(ValueError, match="step 2"):
        for row in pending.read():
            logged.append(row)
    assert logged == [{"iter_num": 0, "loss": 0.0, "sum": 1.0}, {"iter_num": 1, "loss": 1.0, "sum": 2.0}]
    assert len(pending) == 0
