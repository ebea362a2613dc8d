"""
adamgns.AdamGNS: the Adam-preconditioned norms of the normalisation layers against brute force.
Per-example gradients (torch.func.vmap) times P = 1 / (sqrt(v_hat) + eps), with P from a real
torch.optim.AdamW state after a few steps, give |P G_B| and sqrt(mean_b ||P g_b||^2): the
estimator must log exactly those, with gradient accumulation, for LayerNorm (gain and bias) and
RMSNorm gains; the first step, with no optimizer state yet, logs nothing.
"""
import math

import pytest
import torch
import torch.nn as nn

import nanogns.estimators.exact as gnstracking
from nanogns.estimators.adam import AdamGNS
from nanogns.layers import PEGradNormSeparatedRMSNorm, measure
from gns_fixtures import one_thread  # noqa: F401  (autouse: tiny tensors, one thread)
from gns_fixtures import per_example_grads

D, B_MICRO, T, MICRO_STEPS = 6, 3, 4, 2


class Net(nn.Module):
    """A LayerNorm (gain and bias) and an RMSNorm between Linears: the two normalisation kinds."""

    def __init__(self):
        super().__init__()
        self.inp, self.ln, self.mid, self.rms, self.out = (nn.Linear(5, D), nn.LayerNorm(D), nn.Linear(D, D),
                                                           nn.RMSNorm(D), nn.Linear(D, 3))

    def forward(self, x):
        return self.out(self.rms(torch.tanh(self.mid(self.ln(self.inp(x))))))


def example_loss(forward, x, y):
    return (forward(x) - y).square().mean()


def batches(seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(B_MICRO, T, 5, generator=g), torch.randn(B_MICRO, T, 3, generator=g))
            for _ in range(MICRO_STEPS)]


def preconditioner(optimizer, p):
    state, group = optimizer.state[p], optimizer.param_groups[0]
    v_hat = state["exp_avg_sq"].double() / (1 - group["betas"][1] ** float(state["step"]))
    return 1 / (v_hat.sqrt() + group["eps"])


@pytest.mark.parametrize("scale", [1.0, 1024.0], ids=["no-scaler", "loss-scale"])
def test_preconditioned_norms_equal_brute_force_under_accumulation(scale):
    torch.manual_seed(0)
    model = Net()
    plain = Net()
    plain.load_state_dict(model.state_dict())
    measure(model, linear=None, embedding=None, norm="shim")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-6)
    adam = AdamGNS(model, optimizer)
    assert [name for name, _, _ in adam.entries] == ["ln.weight", "ln.bias", "rms.weight"]
    scaler = torch.amp.GradScaler("cpu", init_scale=scale, enabled=scale != 1.0)
    B = B_MICRO * MICRO_STEPS
    for step in range(4):
        data = batches(step)
        for x, y in data:
            scaler.scale(example_loss(model, x, y) / MICRO_STEPS).backward()
        row = adam.measure(step, B, scaler)
        if step == 0:
            assert row == {}  # no optimizer state yet: no preconditioner, nothing logged
        else:
            plain.load_state_dict(model.state_dict())
            grads = {}
            for x, y in data:  # each example's gradient of its own loss, both micro-batches
                for name, g in per_example_grads(plain, example_loss, x, y).items():
                    grads.setdefault(name, []).append(g)
            for name in ("ln.weight", "ln.bias", "rms.weight"):
                g_b = torch.cat(grads[name]).double()  # [B, D]
                P = preconditioner(optimizer, dict(model.named_parameters())[name])
                big = (P * g_b.mean(0)).norm().item()
                small = math.sqrt((P * g_b).square().sum(1).mean().item())
                assert row[f"train/adam_gns/{name}/norm"] == pytest.approx(big, rel=1e-4)  # float32 .grad
                assert row[f"train/adam_gns/{name}/pegn"] == pytest.approx(small, rel=1e-4)
                assert row[f"train/adam_gns/{name}/batch_size"] == B
            assert not any("inp" in c or "mid" in c or "out." in c for c in row)  # the norm layers alone
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        adam.reset()
    assert math.isfinite(adam.gns.get_gns())


def test_the_preconditioner_is_what_adamw_divides_by():
    """P g is AdamW's step direction: with beta1 = 0 its update is -lr * P * g (weight decay 0)."""
    p = nn.Parameter(torch.randn(D))
    optimizer = torch.optim.AdamW([p], lr=0.1, betas=(0.0, 0.9), eps=1e-3, weight_decay=0.0)
    for _ in range(3):
        p.grad = torch.randn(D)
        optimizer.step()
    p.grad = torch.randn(D)
    model = nn.Sequential(PEGradNormSeparatedRMSNorm(D))
    model[0].weight = p
    adam = AdamGNS(model, optimizer)
    state = optimizer.state[p]
    expected = 1 / ((state["exp_avg_sq"] * 0.9 + 0.1 * p.grad ** 2) / (1 - 0.9 ** 4)).sqrt().add(1e-3)
    before = p.detach().clone()
    P_before_step = adam.preconditioner(p)
    optimizer.step()
    assert (p.detach() - before) == pytest.approx(-0.1 * expected * p.grad, rel=1e-5)
    # the estimator's P is the state of the step before: the one this step's update started from
    state_before = (optimizer.state[p]["exp_avg_sq"] - 0.1 * p.grad ** 2) / 0.9
    assert P_before_step == pytest.approx(1 / ((state_before / (1 - 0.9 ** 3)).sqrt() + 1e-3), rel=1e-5)


def test_a_model_without_separated_norms_is_refused_in_one_line():
    model = nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3))
    measure(model, linear="gns", embedding=None, norm="fused")
    with pytest.raises(ValueError, match="no measured LayerNorm or RMSNorm that keeps per-coordinate sums"):
        AdamGNS(model, torch.optim.AdamW(model.parameters()))


def test_estimators_for_adds_it_and_its_columns_are_its_own_estimator():
    model = Net()
    measure(model, linear="gns", embedding=None, norm="shim")
    optimizer = torch.optim.AdamW(model.parameters())
    estimators = gnstracking.estimators_for(model, adam_optimizer=optimizer)
    assert [type(e).__name__ for e in estimators] == ["ExactGNS", "AdamGNS"]
    assert estimators[1].name == "train/adam_gns"


class Net2D(nn.Module):
    """A LayerNorm over a 2-D normalized_shape: P has the gain's [2, 3] shape, the sums are flat."""

    def __init__(self):
        super().__init__()
        self.inp, self.ln, self.out = nn.Linear(5, D), nn.LayerNorm((2, 3)), nn.Linear(D, 3)

    def forward(self, x):
        return self.out(self.ln(self.inp(x).unflatten(-1, (2, 3))).flatten(-2))


def test_a_norm_over_two_dimensions_equals_brute_force():
    torch.manual_seed(1)
    model, plain = Net2D(), Net2D()
    plain.load_state_dict(model.state_dict())
    measure(model, linear=None, embedding=None, norm="shim")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    adam = AdamGNS(model, optimizer)
    for step in range(2):
        x, y = batches(step)[0]
        example_loss(model, x, y).backward()
        row = adam.measure(step, B_MICRO, None)
        if step == 1:
            plain.load_state_dict(model.state_dict())
            g_b = per_example_grads(plain, example_loss, x, y)["ln.weight"].double().reshape(B_MICRO, -1)
            P = preconditioner(optimizer, model.ln.weight).reshape(-1)
            assert row["train/adam_gns/ln.weight/norm"] == pytest.approx((P * g_b.mean(0)).norm().item(), rel=1e-4)
            assert row["train/adam_gns/ln.weight/pegn"] == pytest.approx(
                math.sqrt((P * g_b).square().sum(1).mean().item()), rel=1e-4)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        adam.reset()


@pytest.mark.parametrize("make", [lambda ps: torch.optim.SGD(ps, lr=0.1), lambda ps: torch.optim.RMSprop(ps),
                                  lambda ps: torch.optim.Adagrad(ps)], ids=["SGD", "RMSprop", "Adagrad"])
def test_an_optimizer_that_is_not_adam_is_refused_in_one_line(make):
    model = Net()
    measure(model, linear=None, embedding=None, norm="shim")
    with pytest.raises(ValueError, match="needs torch.optim.Adam or AdamW") as e:
        AdamGNS(model, make(model.parameters()))
    assert "\n" not in str(e.value)


def test_with_amsgrad_the_preconditioner_is_the_running_maximum():
    p = nn.Parameter(torch.randn(D))
    optimizer = torch.optim.AdamW([p], lr=0.1, betas=(0.9, 0.9), eps=1e-3, amsgrad=True)
    for scale in (10.0, 1.0, 0.1):  # shrinking gradients: the maximum stays above exp_avg_sq
        p.grad = scale * torch.randn(D)
        optimizer.step()
    model = nn.Sequential(PEGradNormSeparatedRMSNorm(D))
    model[0].weight = p
    adam = AdamGNS(model, optimizer)
    state, bias = optimizer.state[p], 1 - 0.9 ** 3
    assert not torch.allclose(state["max_exp_avg_sq"], state["exp_avg_sq"])
    assert adam.preconditioner(p) == pytest.approx(1 / ((state["max_exp_avg_sq"] / bias).sqrt() + 1e-3), rel=1e-6)
