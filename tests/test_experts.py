"""
nanogns/layers/experts.py and model.py's mixture of experts: each expert's per-example squared norms
(one sum per expert) equal per-example backward passes, with top-1 and top-k routing, an expert that
receives no token, an example none of whose tokens reach an expert, forced ghost or materialised
norms, bf16 autocast and gradient accumulation; the measured gradients are the unmeasured layer's;
and the MoE GPT, eager and compiled, with and without the load-balancing loss, against per-example
gradients of each example's share of the loss.
"""
import copy
import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanogns.estimators.exact import ExactGNS  # noqa: E402
from nanogns.layers import find_sqgradnorm_buffers, layer_kinds, measure  # noqa: E402
from nanogns.layers.config import classes_for_flags, set_contextual_config  # noqa: E402
from nanogns.layers.experts import Experts, PEGradNormExperts, route  # noqa: E402
from gns_fixtures import one_thread  # noqa: E402,F401  (autouse: tiny tensors, one thread)
from model import GPT, GPTConfig  # noqa: E402

B, T, C, H, E = 3, 5, 8, 16, 4


def routed(k, seed=0, dtype=torch.float64):
    """x [B, T, C], and the top-k experts and weights of random logits in which expert 3 gets no token
    and example 0 sends none to expert 2."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, C, generator=g, dtype=dtype)
    logits = torch.randn(B, T, E, generator=g, dtype=dtype)
    logits[..., 3] = -30
    logits[0, :, 2] = -30
    weight, index = logits.softmax(-1).topk(k, -1)
    return x, index, weight, torch.randn(B, T, C, generator=g, dtype=dtype)


def per_example_sums(layer, x, index, weight, probe):
    """{parameter: [sum_b ||g_b^e||^2 for each expert e]} of the loss sum_b <out_b, probe_b> / B, from one
    backward per example, in float64; and how many examples reached each expert."""
    sums = {n: torch.zeros(E, dtype=torch.float64) for n in ("c_fc", "c_proj")}
    for b in range(B):
        out = layer(x[b:b + 1], index[b:b + 1], weight[b:b + 1])
        grads = torch.autograd.grad((out * probe[b:b + 1]).sum() / B, [layer.c_fc, layer.c_proj])
        for n, g in zip(sums, grads):
            sums[n] += g.double().flatten(1).square().sum(1)
    reached = torch.stack([torch.isin(torch.arange(E), index[b].reshape(-1)) for b in range(B)]).sum(0)
    return sums, reached


def measured_sums(layer, x, index, weight, probe):
    for buf in layer.buffers():
        buf.zero_()
    ((layer(x, index, weight) * probe).sum() / B).backward()
    return {n: layer._buffers[f"{n}_sqgradnorm"].double() for n in ("c_fc", "c_proj")}


@pytest.mark.parametrize("mode", ["shapes", "ghost", "materialise"])
@pytest.mark.parametrize("k", [1, 2])
def test_each_experts_norms_equal_per_example_backward_passes(k, mode):
    torch.manual_seed(0)
    layer = PEGradNormExperts(E, C, H).double()
    layer.per_example_mode = mode
    x, index, weight, probe = routed(k)
    expected, reached = per_example_sums(layer, x, index, weight, probe)
    got = measured_sums(layer, x, index, weight, probe)
    for n in got:
        assert got[n][3] == 0 and expected[n][3] == 0  # the expert no token reached: nothing
        torch.testing.assert_close(got[n], expected[n], rtol=1e-6, atol=0, msg=n)
    assert layer.example_count.item() == B  # the GNS of an expert is over all B examples
    assert layer.expert_examples.tolist() == reached.tolist() and reached[2] == B - 1 and reached[3] == 0
    assert layer.c_fc_sqgradnorm.dtype == torch.float32 and layer.expert_examples.dtype == torch.float32


def test_the_measured_layer_computes_what_the_unmeasured_one_does():
    torch.manual_seed(1)
    plain = Experts(E, C, H)
    layer = PEGradNormExperts(E, C, H)
    layer.load_state_dict(plain.state_dict())
    x, index, weight, probe = routed(2, dtype=torch.float32)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    w1, w2 = weight.clone().requires_grad_(), weight.clone().requires_grad_()
    out1, out2 = plain(x1, index, w1), layer(x2, index, w2)
    torch.testing.assert_close(out2, out1, rtol=0, atol=0)
    (out1 * probe).sum().backward()
    (out2 * probe).sum().backward()
    for a, b in [(plain.c_fc.grad, layer.c_fc.grad), (plain.c_proj.grad, layer.c_proj.grad), (x1.grad, x2.grad),
                 (w1.grad, w2.grad)]:
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_micro_steps_add_and_flattened_tokens_are_examples_in_order():
    """Two backwards add their sums and counts; [N, C] tokens in example order with the model's B
    (measure() knows it) measure as [B, T, C]."""
    torch.manual_seed(2)
    layer = PEGradNormExperts(E, C, H).double()
    x, index, weight, probe = routed(2)
    expected, _ = per_example_sums(layer, x, index, weight, probe)
    measured_sums(layer, x, index, weight, probe)
    ((layer(x, index, weight) * probe).sum() / B).backward()
    torch.testing.assert_close(layer.c_proj_sqgradnorm.double(), 2 * expected["c_proj"], rtol=1e-6, atol=0)
    assert layer.example_count.item() == 2 * B

    class Flat(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = Experts(E, C, H).double()

        def forward(self, x, index, weight):
            return self.experts(x.view(-1, C), index.view(-1, index.shape[-1]), weight.view(-1, weight.shape[-1]))

    flat = Flat()
    flat.experts.load_state_dict(layer.state_dict())
    measure(flat)
    assert type(flat.experts) is PEGradNormExperts
    ((flat(x, index, weight).view(B, T, C) * probe).sum() / B).backward()
    torch.testing.assert_close(flat.experts.c_fc_sqgradnorm.double(), expected["c_fc"], rtol=1e-6, atol=0)
    assert flat.experts.example_count.item() == B


def test_bf16_autocast_measures_the_bf16_computation():
    torch.manual_seed(3)
    layer = PEGradNormExperts(E, C, H)
    x, index, weight, probe = routed(2, dtype=torch.float32)
    expected, _ = per_example_sums(layer, x, index, weight, probe)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = measured_sums(layer, x, index, weight, probe)
    assert layer.c_fc.grad.dtype == torch.float32
    for n in got:
        torch.testing.assert_close(got[n], expected[n], rtol=5e-2, atol=1e-9, msg=n)


def test_experts_sharded_in_the_forward_are_refused_and_can_be_left_out():
    """A DTensor weight in the forward (expert or tensor parallelism; FSDP2 hands the forward whole
    weights) is refused in one line that says how to leave the experts out; left out, they run unmeasured."""
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = PEGradNormExperts(E, C, H)

        def forward(self, x, index, weight):
            return self.experts(x, index, weight)

    block = Block()
    x, index, weight, _ = routed(2, dtype=torch.float32)
    block.experts.c_fc.device_mesh = "a mesh"  # what a DTensor has
    with pytest.raises(RuntimeError, match=r"experts.c_fc is a DTensor in the forward .* kinds=\{PEGradNormExperts: None\}"):
        measure(block)(x, index, weight)
    del block.experts.c_fc.device_mesh
    with pytest.warns(UserWarning, match="2 trainable parameters are not measured"):
        measure(block, kinds={PEGradNormExperts: None})
    block(x, index, weight).sum().backward()
    assert block.experts.c_fc.grad is not None and not find_sqgradnorm_buffers(block)


def test_routing_out_of_range_is_refused():
    index = torch.tensor([[0, 4]])
    with pytest.raises(ValueError, match="outside 0..3"):
        route(index, 4, 1)


# --------------------------------------------------------------------------------------------
# The MoE GPT

MOE = dict(block_size=8, vocab_size=32, n_layer=2, n_head=2, n_embd=16, n_expert=4, dropout=0.0)


def moe_gpt(measured, k=2, aux=0.0, bias=True, seed=0):
    torch.manual_seed(seed)
    classes = classes_for_flags(linearclass="gns", embeddingclass="gns", lnclass="shim") if measured else {}
    with set_contextual_config(**classes):
        return GPT(GPTConfig(**MOE, n_expert_active=k, moe_aux_loss_coef=aux, bias=bias))


def example_shares(model, x, y, steps):
    """The loss of each example of one micro-step, from one forward of the batch: its tokens' share of the
    mean cross-entropy and, with the load-balancing loss, of each layer's n_expert sum_e f_e P_e, f from the
    whole batch; divided by the micro-steps. Their sum is the micro-step's loss."""
    logits_of = []
    hooks = [block.mlp.router.register_forward_hook(lambda m, i, out: logits_of.append(out))
             for block in model.transformer.h]
    logits, loss = model(x, y)
    for h in hooks:
        h.remove()
    b, t = x.shape
    ce = F.cross_entropy(logits.view(b * t, -1), y.view(-1), reduction="none").view(b, t)
    shares = ce.sum(1) / (b * t)
    coef = model.config.moe_aux_loss_coef
    for router_logits in logits_of if coef else []:
        probs = router_logits.float().softmax(-1)
        index = probs.topk(model.config.n_expert_active, -1).indices
        f = torch.bincount(index.view(-1), minlength=model.config.n_expert).float() / index.numel()
        shares = shares + coef * model.config.n_expert * (probs.sum(1) @ f) / (b * t)
    torch.testing.assert_close(shares.sum(), loss)
    return shares / steps


def brute_force(model, batches):
    """{parameter name (an expert's as name[e]): sum over examples of ||g_b||^2} in float64."""
    sums = {}
    params = dict(model.named_parameters())
    for x, y in batches:
        shares = example_shares(model, x, y, len(batches))
        for share in shares:
            grads = torch.autograd.grad(share, list(params.values()), retain_graph=True, allow_unused=True)
            for (n, p), g in zip(params.items(), grads):
                if g is None:
                    continue
                g = g.double()
                if n.endswith("experts.c_fc") or n.endswith("experts.c_proj"):
                    for e, sq in enumerate(g.flatten(1).square().sum(1)):
                        sums[f"{n}[{e}]"] = sums.get(f"{n}[{e}]", 0) + sq
                else:
                    sums[n] = sums.get(n, 0) + g.square().sum()
    return sums


def batches(n=2, b=3, seed=4):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 32, (b, 8), generator=g), torch.randint(0, 32, (b, 8), generator=g)) for _ in range(n)]


def measured_by_name(model):
    found = {}
    for n, p, sq, count in find_sqgradnorm_buffers(model):
        if sq.dim() == 0:
            found[n] = sq.item()
        else:
            found.update({f"{n}[{e}]": v for e, v in enumerate(sq.tolist())})
    return found


def check_moe_gpt(k, aux, bias=True, compiled=False):
    plain, model = moe_gpt(False, k, aux, bias), moe_gpt(True, k, aux, bias)
    model.load_state_dict(plain.state_dict())
    data = batches()
    expected = brute_force(plain, data)
    plain.zero_grad()
    run = torch.compile(model) if compiled else model
    for m in (plain, run):
        for x, y in data:
            (m(x, y)[1] / len(data)).backward()
    got = measured_by_name(model)
    assert set(got) == set(expected) - {"lm_head.weight"}  # every parameter measured (the head is wte's)
    for n, value in got.items():
        torch.testing.assert_close(value, expected[n].item(), rtol=2e-5, atol=1e-12, msg=n)
    for (n, p), q in zip(plain.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=n)
    return model


@pytest.mark.parametrize("k,aux,bias", [(1, 0.0, True), (2, 0.0, False), (2, 0.01, True)])
def test_moe_gpt_norms_match_per_example_gradients(k, aux, bias):
    """Every parameter of the MoE GPT, each expert on its own, over two micro-steps; with the
    load-balancing loss the router's are those of each example's share of it (f the batch's)."""
    model = check_moe_gpt(k, aux, bias)
    kinds = layer_kinds(model)
    assert kinds["transformer.h.0.mlp.router.weight"] == "router"
    assert kinds["transformer.h.1.mlp.experts.c_proj[3]"] == "experts"


def test_compiled_moe_gpt_measures_as_eager():
    check_moe_gpt(2, 0.01, compiled=True)


def test_the_exact_estimator_logs_each_expert_and_the_examples_that_reached_it():
    model = moe_gpt(True, k=1)
    estimator = ExactGNS(model)
    x, y = batches(1, b=4)[0]
    model(x, y)[1].backward()
    reached = [model.transformer.h[0].mlp.experts.expert_examples.tolist()]
    row = estimator.measure(0, 4, None)
    assert row["train/gns/transformer.h.0.mlp.experts.c_fc[2]/batch_size"] == 4
    assert [row[f"train/gns/transformer.h.0.mlp.experts[{e}]/reached"] for e in range(4)] == reached[0]
    assert all(0 <= v <= 4 for v in reached[0]) and sum(reached[0]) >= 4  # each example reaches one at least
    assert row["train/gns/transformer.h.0.mlp.experts.c_fc[2]/pegn"] >= 0
    estimator.reset()
    assert model.transformer.h[0].mlp.experts.expert_examples.sum() == 0


def test_moe_options_are_checked_in_one_line():
    for bad, match in [(dict(n_expert=-1), "n_expert=-1"), (dict(n_expert=4, n_expert_active=5), "n_expert_active=5"),
                       (dict(n_expert=4, mlp="swiglu"), "GELU experts"), (dict(moe_aux_loss_coef=-1.0), "moe_aux")]:
        with pytest.raises(ValueError, match=match):
            GPT(GPTConfig(**{**MOE, **bad}))


# --------------------------------------------------------------------------------------------
# A user's own MoE block, its experts a ModuleList of Linears (nanogns/layers/routed.py)

class ExpertMLP(torch.nn.Module):
    def __init__(self, bias):
        super().__init__()
        self.w1, self.w2 = torch.nn.Linear(C, H, bias=bias), torch.nn.Linear(H, C, bias=bias)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))


class ListMoE(torch.nn.Module):
    """Top-k routing written as a loop over a ModuleList of experts, as Mixtral was in transformers 4:
    the router on the flattened rows, each expert on the rows picked for it (skipped when none are)."""

    def __init__(self, k, bias=True, picks="getitem"):
        super().__init__()
        self.gate = torch.nn.Linear(C, E, bias=False)
        self.experts = torch.nn.ModuleList([ExpertMLP(bias) for _ in range(E)])
        self.shared_expert = ExpertMLP(bias)
        self.k, self.picks = k, picks

    def forward(self, hidden):
        b, t, c = hidden.shape
        x = hidden.view(-1, c)
        logits = self.gate(x)
        logits = logits - 30 * F.one_hot(torch.tensor(E - 1), E)  # the last expert: no token reaches it
        weight, index = logits.softmax(-1).topk(self.k, -1)
        out = self.shared_expert(x)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(index == e)
            if rows.numel() == 0:
                continue
            picked = x[None, rows].reshape(-1, c) if self.picks == "getitem" else x.index_select(0, rows)
            out = out.index_add(0, rows, expert(picked) * weight[rows, slot, None])
        return out.view(b, t, c)


class ListMoEModel(torch.nn.Module):
    def __init__(self, k, bias=True, picks="getitem"):
        super().__init__()
        self.inp = torch.nn.Linear(C, C)
        self.moe = ListMoE(k, bias, picks)

    def forward(self, x):
        return self.moe(self.inp(x))


@pytest.mark.parametrize("k,bias,picks", [(1, True, "getitem"), (2, False, "index_select"), (2, True, "getitem")])
def test_experts_written_as_linears_are_measured_by_following_their_rows(k, bias, picks):
    """Every parameter of a block whose experts are a ModuleList of Linears, over two micro-steps,
    against per-example backward passes; an expert no token reaches still counts the batch; .grad as
    the unmeasured model's; kinds experts, router, shared expert."""
    torch.manual_seed(5)
    plain = ListMoEModel(k, bias, picks).double()
    model = ListMoEModel(k, bias, picks).double()
    model.load_state_dict(plain.state_dict())
    measure(model, strict=True)
    g = torch.Generator().manual_seed(6)
    data = [(torch.randn(B, T, C, generator=g, dtype=torch.float64), torch.randn(B, T, C, generator=g, dtype=torch.float64))
            for _ in range(2)]
    expected = {}
    params = dict(plain.named_parameters())
    for x, probe in data:
        for b in range(B):
            share = (plain(x[b:b + 1]) * probe[b:b + 1]).sum() / B / len(data)
            for (n, p), grad in zip(params.items(), torch.autograd.grad(share, list(params.values()), allow_unused=True)):
                expected[n] = expected.get(n, 0.0) + (0.0 if grad is None else grad.square().sum().item())
    for m in (plain, model):
        for x, probe in data:
            ((m(x) * probe).sum() / B / len(data)).backward()
    found = {n: (sq.item(), count.item()) for n, _, sq, count in find_sqgradnorm_buffers(model)}
    assert set(found) == set(params)
    for n, (sq, count) in found.items():
        assert count == 2 * B, n
        torch.testing.assert_close(sq, expected[n], rtol=1e-6, atol=1e-30, msg=n)
    assert found[f"moe.experts.{E - 1}.w1.weight"][0] == 0
    for n, p in model.named_parameters():
        q = params[n].grad
        assert (p.grad is None) == (q is None), n
        if q is not None:
            torch.testing.assert_close(p.grad, q, rtol=1e-6, atol=1e-12)
    kinds = layer_kinds(model)
    assert kinds["moe.experts.1.w2.weight"] == "experts" and kinds["moe.gate.weight"] == "router"
    assert kinds["moe.shared_expert.w1.weight"] == "shared_expert" and kinds["inp.weight"] == "linear"


def test_an_expert_whose_rows_are_not_followed_is_refused():
    """Rows reached by an op the mode does not follow (a sort of the picked rows): an error, not a guess."""
    class Sorted(ListMoE):
        def forward(self, hidden):
            x = hidden.view(-1, C)
            rows = torch.arange(x.shape[0])
            picked = torch.sort(x[rows], dim=0).values  # rows mixed across tokens
            return self.experts[0](picked).view(hidden.shape)

    model = measure(torch.nn.Sequential(Sorted(1)), strict=True)
    with pytest.raises(RuntimeError, match=r"0.experts.0.w1: the example of each of its 15 rows is not known"):
        model(torch.randn(B, T, C))


def test_dense_experts_in_a_list_see_whole_examples_and_are_measured_as_linears():
    """Experts in a ModuleList called on the block's [B, T, C] input itself (a soft mixture): each sees
    whole examples, so each is measured as any Linear."""
    class Soft(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mix = torch.nn.Linear(C, 2)
            self.experts = torch.nn.ModuleList([ExpertMLP(True) for _ in range(2)])

        def forward(self, x):
            w = self.mix(x).softmax(-1)
            return sum(w[..., e:e + 1] * expert(x) for e, expert in enumerate(self.experts))

    torch.manual_seed(8)
    plain = torch.nn.Sequential(Soft()).double()
    model = measure(copy.deepcopy(plain), strict=True)
    x, probe = torch.randn(B, T, C, dtype=torch.float64), torch.randn(B, T, C, dtype=torch.float64)
    ((model(x) * probe).sum() / B).backward()
    params = dict(plain.named_parameters())
    expected = dict.fromkeys(params, 0.0)
    for b in range(B):
        grads = torch.autograd.grad((plain(x[b:b + 1]) * probe[b:b + 1]).sum() / B, list(params.values()))
        for n, g in zip(params, grads):
            expected[n] += g.square().sum().item()
    for n, _, sq, count in find_sqgradnorm_buffers(model):
        assert count.item() == B
        torch.testing.assert_close(sq.item(), expected[n], rtol=1e-6, atol=0, msg=n)
