"""nanogns/estimators/hooks.py against brute force: the shared oracle's per-example gradients (tests/gns_fixtures.py)
for the exact hooks, the defining formula for SOGNS, and a per-example backward loop through a tiny
GPT. The DDP rank rescaling is checked in tests/test_estimators_microbatch.py (one 2-process run covers
both files)."""
import copy
import math

import pytest
import torch
import torch.nn as nn

import nanogns.layers as buffered
from gns_fixtures import one_thread  # noqa: F401  (an autouse fixture)
from gns_fixtures import example_sqnorms, gpt_batches, output_grad_loss, per_example_grads, sqgradnorm_sums, tiny_gpt
from nanogns.estimators.hooks import (add_exact_hooks, add_hooks_to_model, add_sogns_hooks, exact_linear_sqnorms,
                      gather_hook_results, hook_measurements, zero_hook_results)


def squared_error(forward, x, y):
    """l_b = mean((model(x_b) - y_b)^2), the loss of train_step below for one example."""
    return (forward(x) - y).square().mean()


def mlp(K, H, L, bias):
    return nn.Sequential(nn.Linear(K, H, bias=bias), nn.GELU(), nn.Linear(H, L, bias=bias))


def train_step(model, xs, ys, scaler=None, ctx=None):
    """One optimizer step's backward passes, nanoGPT-style: mean loss / number of micro-steps."""
    for x, y in zip(xs, ys):
        with ctx if ctx is not None else torch.autocast('cpu', enabled=False):
            loss = (model(x).float() - y).square().mean(dim=tuple(range(1, y.dim()))).mean() / len(xs)
        (scaler.scale(loss) if scaler is not None else loss).backward()


# T=3, K=8, H=16, L=2: the first layer takes the ghost path, the second materialises W_b
# (nanogns/layers' shim rule and chunk bound, which the hooks share)
@pytest.mark.parametrize("inner", [(), (3,), (2, 3)], ids=["2d", "3d", "4d"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("chunk_elements", [buffered.PEGradNormShimLinear.max_chunk_numel, 1],
                         ids=["one-chunk", "per-example"])
def test_exact_hooks_match_vmap_brute_force(inner, bias, chunk_elements, monkeypatch):
    monkeypatch.setattr(buffered.PEGradNormShimLinear, "max_chunk_numel", chunk_elements)
    torch.manual_seed(0)
    K, H, L, b, micro_steps = 8, 16, 2, 3, 2
    model = mlp(K, H, L, bias)
    oracle = copy.deepcopy(model)
    handles = add_hooks_to_model(model, add_exact_hooks)
    assert len(handles) == 2
    xs = [torch.randn(b, *inner, K) for _ in range(micro_steps)]
    ys = [torch.randn(b, *inner, L) for _ in range(micro_steps)]
    train_step(model, xs, ys)

    B = b * micro_steps
    grads = per_example_grads(oracle, squared_error, torch.cat(xs), torch.cat(ys))
    expected = sqgradnorm_sums(oracle, squared_error, list(zip(xs, ys)))  # sum_b ||g_b / B||^2
    results = gather_hook_results(model, 'exact')
    assert [r.name for r in results] == [n for n, _ in model.named_parameters()]
    for r in results:
        torch.testing.assert_close(r.sqnorm_sum.double(), expected[r.name], rtol=1e-5, atol=0)
        assert r.example_count == B
        assert r.surrogate_grad is None
        # the real gradient is the mean of the per-example ones: the step is the one we think
        torch.testing.assert_close(r.param.grad, grads[r.name].mean(0), rtol=1e-5, atol=1e-7)

    logged = hook_measurements(model, 'exact')
    for n, p in model.named_parameters():
        assert logged[f"train/hooks_gns/{n}/batch_size"] == B
        assert logged[f"train/hooks_gns/{n}/norm"] == pytest.approx(p.grad.norm().item(), rel=1e-5)
        assert logged[f"train/hooks_gns/{n}/pegn"] == pytest.approx(
            math.sqrt(example_sqnorms(grads)[n].mean().item()), rel=1e-5)

    zero_hook_results(model)
    assert hook_measurements(model, 'exact') == {}  # nothing seen since zeroing
    for h in handles:
        h.remove()
    train_step(model, xs, ys)
    assert hook_measurements(model, 'exact') == {}  # hooks removed: nothing accumulates


def test_exact_linear_sqnorms_both_paths_agree():
    """Ghost form and materialised W_b give the same numbers on one case."""
    torch.manual_seed(1)
    x, dy = torch.randn(4, 5, 6, dtype=torch.float64), torch.randn(4, 5, 7, dtype=torch.float64)
    plain = nn.Linear(6, 7, dtype=torch.float64)
    brute = sqgradnorm_sums(plain, output_grad_loss, [(x, dy)], mean=False)  # sum_b ||W_b||^2, sum_b ||b_b||^2
    w, bias = exact_linear_sqnorms(x, dy)
    torch.testing.assert_close(w, brute["weight"].float())
    torch.testing.assert_close(bias, brute["bias"].float())
    xt, dyt = x[:, :1], dy[:, :1]  # T = 1 shortcut
    w1, _ = exact_linear_sqnorms(xt, dyt)
    torch.testing.assert_close(w1, sqgradnorm_sums(plain, output_grad_loss, [(xt, dyt)], mean=False)["weight"].float())


@pytest.mark.parametrize("bias", [True, False])
def test_sogns_equals_its_defining_formula(bias):
    """A hand-built case: dy is set by the loss sum(y * C), so dy = C exactly, and every
    example's input is replaced by its RMS to build W~_b = sigma_b (sum_t dy_bt) 1^T by hand."""
    torch.manual_seed(2)
    B, T, K, L = 3, 4, 5, 2
    layer = nn.Linear(K, L, bias=bias)
    add_sogns_hooks(layer)
    x = torch.randn(B, T, K) * torch.tensor([0.5, 1.0, 3.0]).view(B, 1, 1)  # differing scales
    C = torch.randn(B, T, L)
    (layer(x) * C).sum().backward()

    surrogate_W = []
    for bi in range(B):
        sigma = math.sqrt(sum(v * v for v in x[bi].flatten().tolist()) / (T * K))
        x_rms = torch.full((T, K), sigma)  # every entry replaced by the example's RMS
        surrogate_W.append(C[bi].t() @ x_rms)  # [L, K] = sum_t dy_bt x~_bt^T
    results = {r.name: r for r in gather_hook_results(layer, 'sogns')}
    torch.testing.assert_close(results['weight'].sqnorm_sum, sum(W.square().sum() for W in surrogate_W))
    # big batch of the surrogate: ||sum_b W~_b||, the same norm as that of the kept L-vector
    torch.testing.assert_close(results['weight'].surrogate_grad.norm(), sum(surrogate_W).norm())
    # the closed form in the docstring: (||x_b||^2 / T) ||sum_t dy_bt||^2
    closed = ((x.square().sum((1, 2)) / T) * C.sum(1).square().sum(1)).sum()
    torch.testing.assert_close(results['weight'].sqnorm_sum, closed)
    assert results['weight'].example_count == B
    if bias:
        torch.testing.assert_close(results['bias'].sqnorm_sum, C.sum(1).square().sum())
        assert results['bias'].surrogate_grad is None
    else:
        assert 'bias' not in results

    logged = hook_measurements(layer, 'sogns')
    assert logged['train/sogns/weight/norm'] == pytest.approx(sum(surrogate_W).norm().item(), rel=1e-5)
    assert logged['train/sogns/weight/pegn'] == pytest.approx(math.sqrt(B * closed.item()), rel=1e-5)
    assert logged['train/sogns/weight/batch_size'] == B
    if bias:  # biases are exact: the big batch is the real gradient
        assert logged['train/sogns/bias/norm'] == pytest.approx(layer.bias.grad.norm().item(), rel=1e-6)


@pytest.mark.parametrize("bias", [True, False])
def test_sogns_equals_exact_for_2d_inputs(bias):
    """With T = 1 the approximation is exact; both kinds of hook on one model at once."""
    torch.manual_seed(3)
    model = mlp(6, 9, 4, bias)
    add_hooks_to_model(model, add_exact_hooks)
    add_hooks_to_model(model, add_sogns_hooks)
    xs, ys = [torch.randn(5, 6) for _ in range(2)], [torch.randn(5, 4) for _ in range(2)]
    train_step(model, xs, ys)
    exact, sogns = gather_hook_results(model, 'exact'), gather_hook_results(model, add_sogns_hooks)
    assert [r.name for r in exact] == [r.name for r in sogns]
    for e, s in zip(exact, sogns):
        torch.testing.assert_close(s.sqnorm_sum, e.sqnorm_sum, rtol=1e-5, atol=0)
        assert s.example_count == e.example_count == 10


def test_sogns_differs_from_exact_on_sequences():
    """For T > 1 the approximation is an approximation (else the test above proves little)."""
    torch.manual_seed(4)
    model = mlp(6, 9, 4, True)
    add_hooks_to_model(model, add_exact_hooks)
    add_hooks_to_model(model, add_sogns_hooks)
    train_step(model, [torch.randn(5, 7, 6)], [torch.randn(5, 7, 4)])
    exact, sogns = gather_hook_results(model, 'exact'), gather_hook_results(model, 'sogns')
    weights = [(e, s) for e, s in zip(exact, sogns) if e.name.endswith('weight')]
    assert all(abs(s.sqnorm_sum / e.sqnorm_sum - 1) > 1e-3 for e, s in weights)
    biases = [(e, s) for e, s in zip(exact, sogns) if e.name.endswith('bias')]
    assert all(torch.allclose(s.sqnorm_sum, e.sqnorm_sum) for e, s in biases)


class SelfMeasuringLinear(nn.Linear):
    """Stands for nanogns/layers' layers: a Linear subclass with an example_count buffer."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer('example_count', torch.zeros(()), persistent=False)


def test_add_hooks_to_model_picks_own_plain_linear_parameters():
    """Hooked: plain Linears and subclasses, self-measuring ones included; skipped: parametrized
    (spectral-norm) weights whose bias is still measured, and weights shared with another module."""
    torch.manual_seed(7)
    sub = type('SubLinear', (nn.Linear,), {})(4, 4)
    model = nn.Sequential(nn.Linear(4, 4), SelfMeasuringLinear(4, 4), sub,
                          torch.nn.utils.parametrizations.spectral_norm(nn.Linear(4, 4)), nn.Linear(4, 4))
    shared = nn.Linear(4, 4)
    model[4].weight = shared.weight
    model.append(shared)
    add_hooks_to_model(model, add_exact_hooks)
    model(torch.randn(3, 4)).square().sum().backward()
    assert [r.name for r in gather_hook_results(model)] == ['0.weight', '0.bias', '1.weight', '1.bias',
                                                            '2.weight', '2.bias', '3.bias', '4.bias', '5.bias']
    assert all(r.example_count == 3 and r.sqnorm_sum > 0 for r in gather_hook_results(model))


def test_bad_usage_is_refused():
    with pytest.raises(AssertionError):
        add_exact_hooks(nn.LayerNorm(4))
    layer = nn.Linear(2, 2)
    add_exact_hooks(layer)
    with pytest.raises(ValueError):
        add_exact_hooks(layer)  # twice would count every example twice
    with pytest.raises(ValueError):
        gather_hook_results(layer, 'nonsense')


def test_exact_hooks_on_tiny_gpt_match_per_example_backward():
    model = tiny_gpt()
    oracle = copy.deepcopy(model)
    add_hooks_to_model(model, add_exact_hooks)
    batches = gpt_batches(2, 3)
    for X, Y in batches:
        (model(X, Y)[1] / len(batches)).backward()
    B = sum(len(X) for X, _ in batches)

    # a second oracle, kept apart from torch.func to catch a fault in the shared one: a backward per example
    expected = {}
    for X, Y in batches:
        for i in range(len(X)):
            oracle.zero_grad()
            oracle(X[i:i + 1], Y[i:i + 1])[1].backward()
            for n, p in oracle.named_parameters():
                expected[n] = expected.get(n, 0) + (p.grad / B).square().sum()
    results = gather_hook_results(model, 'exact')
    names = [r.name for r in results]
    # every Linear parameter except the weight tied to the embedding
    linear_params = [f"{mn}.{pn}" for mn, m in model.named_modules() if isinstance(m, nn.Linear)
                     for pn, _ in m.named_parameters(recurse=False)]
    assert sorted(names) == sorted(set(linear_params) - {'lm_head.weight'})
    assert len(names) > 0
    for r in results:
        torch.testing.assert_close(r.sqnorm_sum, expected[r.name], rtol=1e-4, atol=0)
        assert r.example_count == B


def test_gpt_loop_with_accumulation_all_finite():
    """A few optimizer steps of 2 micro-steps with both kinds of hooks: finite, positive values,
    zeroed between steps (the second step's counts are one step's, not two)."""
    model = tiny_gpt()
    add_hooks_to_model(model, add_exact_hooks)
    add_hooks_to_model(model, add_sogns_hooks)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = gpt_batches(6, 4)
    for step in range(3):
        for X, Y in batches[2 * step:2 * step + 2]:
            (model(X, Y)[1] / 2).backward()
        for kind, prefix in (('exact', 'train/hooks_gns'), ('sogns', 'train/sogns')):
            logged = hook_measurements(model, kind)
            assert logged and all(k.startswith(prefix + '/') for k in logged)
            assert all(math.isfinite(v) and v > 0 for v in logged.values())
            assert {v for k, v in logged.items() if k.endswith('/batch_size')} == {8}
        opt.step()
        opt.zero_grad(set_to_none=True)
        zero_hook_results(model)


def test_float16_autocast_with_grad_scaler():
    """Under float16 autocast and a GradScaler at 65536 the sums stay finite, and once divided by
    the scale they agree with a float32 run to float16 precision."""
    model = mlp(8, 16, 4, True)
    reference = copy.deepcopy(model)
    add_hooks_to_model(model, add_exact_hooks)
    add_hooks_to_model(model, add_sogns_hooks)
    add_hooks_to_model(reference, add_exact_hooks)
    add_hooks_to_model(reference, add_sogns_hooks)
    torch.manual_seed(6)
    xs, ys = [torch.randn(4, 3, 8) for _ in range(2)], [torch.randn(4, 3, 4) for _ in range(2)]
    scaler = torch.amp.GradScaler('cpu', init_scale=65536.0)
    train_step(model, xs, ys, scaler=scaler, ctx=torch.autocast('cpu', dtype=torch.float16))
    train_step(reference, xs, ys)
    scale = scaler.get_scale()
    assert scale == 65536.0
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler.unscale_(opt)
    for kind in ('exact', 'sogns'):
        raw = gather_hook_results(model, kind)
        assert all(torch.isfinite(r.sqnorm_sum) and r.sqnorm_sum > 0 for r in raw)
        got = hook_measurements(model, kind, loss_scale=scale)
        want = hook_measurements(reference, kind)
        assert got.keys() == want.keys()
        for k in want:
            assert got[k] == pytest.approx(want[k], rel=2e-2), k
