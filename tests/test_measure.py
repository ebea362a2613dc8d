"""
buffered.measure: exact per-example norms put into a model built elsewhere. Every measured
parameter is checked against brute force (one backward per example of a plain copy of the
model), with two micro-steps of gradient accumulation, for a nanoGPT-style model written here
(its own LayerNorm(ndim, bias) class, wte tied to lm_head by assignment, wpe(arange(t))) and,
where transformers is installed, Hugging Face's GPT2LMHeadModel and LlamaForCausalLM.
"""
import copy
import functools
import gc
import itertools
import math
import importlib.util
import os
import subprocess
import sys
import warnings

import numpy as np

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import nanogns.layers as buffered  # noqa: E402
import nanogns.layers.buffers as buffers_module  # noqa: E402  (its warn-once memory)
from nanogns.layers import MEASURED_CLASSES, find_sqgradnorm_buffers, layer_kinds, measure  # noqa: E402
from nanogns.logread import load_log  # noqa: E402
from gns_fixtures import counting_hook, tiny_hf  # noqa: E402
from gns_fixtures import one_thread  # noqa: E402,F401  (autouse: tiny tensors, one thread)
from loop_fixtures import installed_package, run_script  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("gns_analysis", os.path.join(REPO, "gns-analysis.py"))
gns_analysis = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gns_analysis)

LINEAR = [None, "gns", "shim"]
EMBEDDING = [None, "gns", "shim"]
NORM = [None, "shim", "fused"]
B, T, V, STEPS = 3, 6, 23, 2


# ---------------------------------------------------------------- a nanoGPT written the way nanoGPT is

class NanoLayerNorm(nn.Module):
    """nanoGPT's LayerNorm(ndim, bias): torch's has no bias=False before 2.1."""

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class NanoBlock(nn.Module):
    def __init__(self, D, H, bias):
        super().__init__()
        self.ln_1, self.ln_2, self.H = NanoLayerNorm(D, bias), NanoLayerNorm(D, bias), H
        self.c_attn, self.c_proj = nn.Linear(D, 3 * D, bias=bias), nn.Linear(D, D, bias=bias)
        self.c_fc, self.mlp_proj = nn.Linear(D, 4 * D, bias=bias), nn.Linear(4 * D, D, bias=bias)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.H, d // self.H).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class NanoGPT(nn.Module):
    def __init__(self, bias, D=16, H=2, n_layer=2):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(V, D), wpe=nn.Embedding(T, D),
                                              h=nn.ModuleList([NanoBlock(D, H, bias) for _ in range(n_layer)]),
                                              ln_f=NanoLayerNorm(D, bias)))
        self.lm_head = nn.Linear(D, V, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # nanoGPT's tie

    def forward(self, idx, targets):
        pos = torch.arange(0, idx.shape[1], dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)  # positions [T], shared by the batch
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return F.cross_entropy(logits.view(-1, V), targets.view(-1))


def nano_loss(model, x, y):
    return model(x, y)


# ---------------------------------------------------------------- the oracle: one backward per example

def brute_force(model, batches, loss):
    """{name: sum_b ||g_b / B||^2} in float64 over every example of every micro-batch (B in all), and
    the summed .grad of nanoGPT's micro-steps (each micro-batch's mean loss / number of micro-steps)."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    total = sum(x.shape[0] for x, _ in batches)
    sums = dict.fromkeys(params, 0.0)
    for x, y in batches:
        for b in range(x.shape[0]):
            model.zero_grad(set_to_none=True)
            loss(model, x[b:b + 1], y[b:b + 1]).backward()
            for n, p in params.items():
                if p.grad is not None:
                    sums[n] += p.grad.double().square().sum().item() / total ** 2
    model.zero_grad(set_to_none=True)
    train(model, batches, loss)
    grads = {n: p.grad.clone() for n, p in params.items()}
    model.zero_grad(set_to_none=True)
    return sums, grads


def train(model, batches, loss):
    for x, y in batches:
        (loss(model, x, y) / len(batches)).backward()


def measured_sums(model):
    """{name: the buffer's running sum} of every measured parameter, and the example counts seen."""
    entries = find_sqgradnorm_buffers(model)
    return {n: sq.item() for n, _, sq, _ in entries}, {count.item() for _, _, _, count in entries}


def random_batches(steps=STEPS, vocab=V, shape=(B, T)):
    return [(torch.randint(0, vocab, shape), torch.randint(0, vocab, shape)) for _ in range(steps)]


@functools.lru_cache(maxsize=None)
def nano_reference(bias):
    torch.manual_seed(0)
    plain = NanoGPT(bias)
    batches = random_batches()
    return plain, batches, *brute_force(plain, batches, nano_loss)


def expected_names(model, kind_of, flags):
    """The parameters that should be measured: those of a measured kind; a tied weight only when the
    embedding and the head both measure."""
    values = dict(linear=flags[0], embedding=flags[1], layernorm=flags[2], rmsnorm=flags[2])
    kinds = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            kinds.setdefault(id(p), []).append(kind_of(module))
    names = set()
    for name, p in model.named_parameters():
        ks = kinds[id(p)]
        if all(k is not None and values[k] is not None for k in ks) and (len(ks) == 1 or set(ks) == {"linear", "embedding"}):
            names.add(name)
    return names


def check_measured(model, plain, batches, loss, expected, grads, flags, rtol=1e-5, kind_of=None):
    """Train `model` (measured) on batches; its buffers against brute force, its .grad against plain's."""
    train(model, batches, loss)
    got, counts = measured_sums(model)
    want = expected_names(plain, kind_of, flags)
    assert set(got) == want
    assert counts <= {float(len(batches) * batches[0][0].shape[0])}
    for name in want:
        torch.testing.assert_close(got[name], expected[name], rtol=rtol, atol=1e-12, msg=name)
    for name, p in model.named_parameters():
        if all(f in (None, "shim") for f in flags):  # shim and torch's own: bit-identical .grad
            assert torch.equal(p.grad, grads[name]), name
        else:
            torch.testing.assert_close(p.grad, grads[name], rtol=1e-5, atol=1e-6, msg=name)


def nano_kind(module):
    return {nn.Linear: "linear", nn.Embedding: "embedding", NanoLayerNorm: "layernorm"}.get(type(module))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("linear,embedding,norm", list(itertools.product(LINEAR, EMBEDDING, NORM)))
def test_nanogpt_every_flag_matches_brute_force(linear, embedding, norm, bias):
    plain, batches, expected, grads = nano_reference(bias)
    model = copy.deepcopy(plain)
    params = {n: p for n, p in model.named_parameters()}
    keys = list(model.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the coverage warning, where a kind is left unmeasured
        assert measure(model, linear=linear, embedding=embedding, norm=norm, kinds={NanoLayerNorm: "layernorm"}) is model
    # the very same Parameter objects under the same names, the tie kept, the same state_dict keys
    assert all(p is params[n] for n, p in model.named_parameters()) and list(model.state_dict()) == keys
    assert model.transformer.wte.weight is model.lm_head.weight
    with torch.no_grad():
        x, y = batches[0]
        assert torch.equal(model(x, y), plain(x, y))
    check_measured(model, plain, batches, nano_loss, expected, grads, (linear, embedding, norm), kind_of=nano_kind)


def test_measured_kinds_are_recorded():
    model = measure(copy.deepcopy(nano_reference(True)[0]), kinds={NanoLayerNorm: "layernorm"})
    kinds = layer_kinds(model)
    assert kinds["transformer.wte.weight"] == "embedding" and kinds["transformer.wpe.weight"] == "embedding"
    assert kinds["transformer.h.0.ln_1.bias"] == "layernorm" and kinds["transformer.h.1.c_fc.weight"] == "linear"
    assert len(kinds) == len(list(model.parameters()))


def test_everything_measured_gives_no_warning_and_passes_strict():
    model = copy.deepcopy(nano_reference(False)[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        measure(model, kinds={NanoLayerNorm: "layernorm"}, strict=True)


# ---------------------------------------------------------------- coverage, flags, sharing

class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(4))
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) * self.gain


def test_coverage_warning_lists_unmeasured_parameters_with_their_classes():
    model = nn.Sequential(Scaled(), NanoLayerNorm(4, True))
    with pytest.warns(UserWarning, match=r"measure: 3 trainable parameters are not measured: 0.gain \(Scaled\); "
                                         r"1.weight \(NanoLayerNorm\); 1.bias \(NanoLayerNorm\)") as record:
        measure(model)
    assert len([w for w in record if "not measured" in str(w.message)]) == 1  # one warning
    with pytest.raises(ValueError, match=r"3 trainable parameters are not measured: 0.gain \(Scaled\)"):
        measure(nn.Sequential(Scaled(), NanoLayerNorm(4, True)), strict=True)
    with pytest.raises(ValueError, match=r"0.gain \(Scaled\)") as e:  # kinds= takes the layer norm in
        measure(nn.Sequential(Scaled(), NanoLayerNorm(4, True)), kinds={NanoLayerNorm: "layernorm"}, strict=True)
    assert "NanoLayerNorm" not in str(e.value)
    frozen = nn.Sequential(Scaled())
    frozen[0].gain.requires_grad_(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        measure(frozen, strict=True)  # a frozen parameter is not a gap


@pytest.mark.parametrize("kwargs,match", [(dict(linear="fused"), "linear='fused'"), (dict(norm="gns"), "norm='gns'"),
                                          (dict(embedding="nn"), "embedding='nn'"),
                                          (dict(kinds={NanoLayerNorm: "groupnorm"}), "kinds maps classes")])
def test_bad_arguments_are_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        measure(nn.Sequential(nn.Linear(2, 2)), **kwargs)


def test_a_single_layer_is_refused():
    with pytest.raises(ValueError, match="not a single layer"):
        measure(nn.Linear(2, 2))


class SharedLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 3)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


@pytest.mark.parametrize("linear", ["gns", "shim"])
def test_weight_shared_by_two_linears_is_left_out_with_a_warning(linear):
    model = SharedLinears()
    buffers_module._warned.clear()
    with pytest.warns(UserWarning, match=r"a.weight \(Linear: |a.weight \(PEGradNorm.*shared with another layer"):
        measure(model, linear=linear)
    model(torch.randn(3, 4)).sum().backward()
    names = [n for n, _, _, _ in find_sqgradnorm_buffers(model)]
    assert "a.weight" not in names and "b.weight" not in names
    assert set(names) == {"a.bias", "b.bias", "c.weight", "c.bias"}


@pytest.mark.parametrize("cls", [buffered.PEGradNormLinear, buffered.PEGradNormShimLinear])
def test_layer_config_built_sharing_is_not_first_buffer_wins(cls):
    # built with the measured classes directly (as layer_config does): both layers hold buffers
    model = nn.Sequential(cls(4, 4), nn.Tanh(), cls(4, 4))
    model[2].weight = model[0].weight
    model(torch.randn(3, 4)).sum().backward()
    buffers_module._warned.clear()
    with pytest.warns(UserWarning, match=r"0.weight is shared by 2 layers .*it is not reported"):
        names = [n for n, _, _, _ in find_sqgradnorm_buffers(model)]
    assert names == ["0.bias", "2.bias"]


class Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x)))


@pytest.mark.parametrize("linear", ["gns", "shim"])
def test_layer_applied_twice_is_an_error_naming_it(linear):
    model = measure(Twice(), linear=linear)
    with pytest.raises(RuntimeError, match=r"lin.weight, lin.bias: the measured PEGradNorm\w*Linear lin was applied twice"):
        model(torch.randn(3, 4))
    with torch.no_grad():
        model(torch.randn(3, 4))  # nothing measured, nothing refused



class UsedOutside(nn.Module):
    """An MLP whose last Linear's weight is also used outside that layer, as `use` says: beside the
    layer's own call (the fault found: its norm came out 27% low), before it (on its input's side),
    or as a penalty in the forward; None: only through the layer."""

    def __init__(self, use=None):
        super().__init__()
        self.use = use
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 16))

    def forward(self, x):
        h = self.mlp[:3](x)
        w = self.mlp[3].weight
        if self.use == "before":
            h = h + F.linear(h, w)
        y = self.mlp[3](h)
        if self.use == "beside":
            y = y + F.linear(h, w)
        loss = y.pow(2).mean()
        return loss + w.square().sum() if self.use == "penalty" else loss


@pytest.mark.parametrize("linear", ["gns", "shim"])
@pytest.mark.parametrize("use", ["beside", "before", "penalty"])
def test_weight_used_outside_its_layer_is_an_error_naming_it(linear, use):
    model = measure(UsedOutside(use), linear=linear)
    for _ in range(2):  # refused at every forward, not once
        with pytest.raises(RuntimeError, match=r"^mlp.3.weight is used outside its measured layer mlp.3 in the forward"):
            model(torch.randn(3, 5, 8))
    with torch.no_grad():
        model(torch.randn(3, 5, 8))  # nothing measured, nothing refused


def test_head_computed_from_a_measured_embeddings_weight_is_an_error_naming_it():
    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.ln = nn.Embedding(V, 8), nn.LayerNorm(8)

        def forward(self, ids):
            return self.ln(self.wte(ids)) @ self.wte.weight.T  # the head is the embedding's weight, not a layer

    model = measure(Head())
    with pytest.raises(RuntimeError, match=r"^wte.weight is used outside its measured layer wte"):
        model(torch.randint(0, V, (B, T)))


@pytest.mark.parametrize("linear, embedding, norm", [("gns", "gns", "shim"), ("shim", "shim", "fused")])
def test_parameters_used_only_by_their_layers_pass_the_check_once(linear, embedding, norm):
    # a tied embedding and head, the positions shared by the batch, bfloat16 autocast's casts of every
    # weight, a layer output used twice: uses inside the layers, so measured exactly (brute force);
    # the check's hooks are gone after the first forward
    plain, batches, expected, _ = nano_reference(True)
    model = measure(copy.deepcopy(plain), linear=linear, embedding=embedding, norm=norm,
                    kinds={NanoLayerNorm: "layernorm"})
    with torch.autocast("cpu", dtype=torch.bfloat16):
        nano_loss(model, *batches[0])
    assert model._gns_forward_state["uses_checked"]
    assert all(not m._forward_hooks for m in model.modules() if isinstance(m, buffered.MeasuredLayer))
    buffered.zero_sqgradnorm_buffers(model)
    model.zero_grad()
    train(model, batches, nano_loss)
    got, counts = measured_sums(model)
    assert counts == {float(2 * B)}
    for name in got:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=0, msg=name)


def test_module_held_twice_is_left_unmeasured():
    lin = nn.Linear(4, 4)
    model = nn.Sequential(lin, nn.Tanh(), lin, nn.Linear(4, 2))
    with pytest.warns(UserWarning, match=r"0.weight \(Linear: held under more than one name\)"):
        measure(model)
    assert type(model[0]) is nn.Linear and model[0] is model[2]
    assert isinstance(model[3], buffered.PEGradNormLinear)


class Positions(nn.Module):
    """Positions passed as [1, T] (Hugging Face's position_ids) or [T] (nanoGPT's arange)."""

    def __init__(self, flat):
        super().__init__()
        self.tok, self.pos, self.head, self.flat = nn.Embedding(V, 4), nn.Embedding(T, 4), nn.Linear(4, V), flat

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1])
        x = self.tok(idx) + self.pos(pos if self.flat else pos[None])
        return F.cross_entropy(self.head(torch.tanh(x)).view(-1, V), targets.view(-1))


@pytest.mark.parametrize("flat", [True, False])
@pytest.mark.parametrize("embedding", ["gns", "shim"])
def test_positions_shared_by_the_batch_are_measured_per_example(flat, embedding):
    torch.manual_seed(3)
    plain = Positions(flat)
    batches = random_batches()
    expected, grads = brute_force(plain, batches, nano_loss)
    model = measure(copy.deepcopy(plain), embedding=embedding)
    train(model, batches, nano_loss)
    got, counts = measured_sums(model)
    assert counts == {float(2 * B)} and "pos.weight" in got
    for name in got:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=0, msg=name)
    with torch.no_grad():  # outside training the lookup is torch's own, shapes and all
        assert model.pos(torch.arange(T)).shape == (T, 4)


# ---------------------------------------------------------------- tokens, not examples

class TokenMix(nn.Module):
    """A layer called on the batch flattened to tokens, as Hugging Face's MoE blocks call theirs."""

    def __init__(self, what):
        super().__init__()
        self.what = what
        self.layer = nn.Linear(4, 4) if what == "linear" else nn.LayerNorm(4)

    def forward(self, x):
        return x + self.layer(x.view(-1, 4)).view(x.shape)


class Flattened(nn.Module):
    def __init__(self, what):
        super().__init__()
        self.tok, self.mix, self.head, self.what = nn.Embedding(V, 4), TokenMix(what), nn.Linear(4, V), what

    def forward(self, idx, targets):
        x = self.tok(idx.view(-1)).view(*idx.shape, 4) if self.what == "embedding" else self.tok(idx)
        return F.cross_entropy(self.head(self.mix(x)).view(-1, V), targets.view(-1))


@pytest.mark.parametrize("what,name", [("linear", "mix.layer"), ("layernorm", "mix.layer"), ("embedding", "tok")])
def test_layer_on_flattened_tokens_is_an_error_naming_it(what, name):
    torch.manual_seed(4)
    plain = Flattened(what)
    batches = random_batches()
    model = measure(copy.deepcopy(plain))
    with pytest.raises(RuntimeError, match=rf"^{name}: sees {B * T} rows, the batch has {B} examples: per-token "
                                           r"input, not measured; leave its block out with measure\(model, kinds="):
        nano_loss(model, *batches[0])
    with torch.no_grad():
        nano_loss(model, *batches[0])  # nothing measured, nothing refused
    if what == "embedding":
        return
    # its block named with kinds={Block: None}: left out with the reason, the rest measured exactly
    expected, _ = brute_force(plain, batches, nano_loss)
    model = copy.deepcopy(plain)
    with pytest.warns(UserWarning, match=r"mix.layer.weight \(\w+: in mix \(TokenMix\), left out by "
                                         r"kinds=\{TokenMix: None\}\)"):
        measure(model, kinds={TokenMix: None})
    train(model, batches, nano_loss)
    got, counts = measured_sums(model)
    assert counts == {float(2 * B)} and set(got) == {"tok.weight", "head.weight", "head.bias"}
    for n in got:
        torch.testing.assert_close(got[n], expected[n], rtol=1e-5, atol=0, msg=n)


class TinyMoE(nn.Module):
    """
    A mixture-of-experts block as Hugging Face writes them, on the flattened tokens: token id 0 goes
    to expert 0, every other to expert 1 (id-routed, so one example alone is routed as in the batch),
    and a shared expert sees every token; with a router, a Linear on the flattened tokens scales
    each expert's output.
    """

    def __init__(self, router):
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.shared_expert = nn.Linear(4, 4)
        self.router = nn.Linear(4, 2) if router else None

    def forward(self, x, idx):
        flat, rows = x.reshape(-1, 4), idx.reshape(-1) == 0
        gate = torch.ones(flat.shape[0], 2) if self.router is None else torch.sigmoid(self.router(flat))
        out = self.shared_expert(flat)
        out = out.index_add(0, rows.nonzero()[:, 0], self.experts[0](flat[rows]) * gate[rows, :1])
        out = out.index_add(0, (~rows).nonzero()[:, 0], self.experts[1](flat[~rows]) * gate[~rows, 1:])
        return x + out.view(x.shape)


class MoEModel(nn.Module):
    def __init__(self, router=False):
        super().__init__()
        self.tok, self.ln, self.block, self.head = nn.Embedding(V, 4), nn.LayerNorm(4), TinyMoE(router), nn.Linear(4, V)

    def forward(self, idx, targets):
        x = self.block(self.ln(self.tok(idx)), idx)
        return F.cross_entropy(self.head(x).view(-1, V), targets.view(-1))


def moe_batches():
    """Micro-batches in which exactly B tokens have id 0 (two in one example, none in another), so that
    expert 0 gets as many rows as the batch has examples, though they are not one per example."""
    batches = [(torch.randint(1, V, (B, T)), torch.randint(0, V, (B, T))) for _ in range(STEPS)]
    for x, _ in batches:
        x[0, 0] = x[0, 3] = x[1, 2] = 0
    return batches


def test_routed_and_shared_experts_are_measured_by_following_their_rows():
    torch.manual_seed(5)
    plain, batches = MoEModel(), moe_batches()
    expected, _ = brute_force(plain, batches, nano_loss)
    # measured as a layer (built measured, no forward state), expert 0 counts B examples a micro-step
    # and passes every count check, but its rows are tokens: its number is not the per-example one
    built = copy.deepcopy(plain)
    built.block.experts[0] = buffered.PEGradNormLinear(4, 4)
    built.block.experts[0].load_state_dict(plain.block.experts[0].state_dict())
    train(built, batches, nano_loss)
    assert built.block.experts[0].example_count.item() == 2 * B
    wrong = built.block.experts[0].weight_sqgradnorm.item()
    assert wrong != pytest.approx(expected["block.experts.0.weight"], rel=1e-2)
    # measure() follows each row's token through the block (nanogns/layers/routed.py): every parameter exact
    model = copy.deepcopy(built)
    model.zero_grad(set_to_none=True)
    measure(model, strict=True)
    buffered.zero_sqgradnorm_buffers(model)
    train(model, batches, nano_loss)
    got, counts = measured_sums(model)
    assert counts == {float(2 * B)} and set(got) == set(expected)
    for n in got:
        torch.testing.assert_close(got[n], expected[n], rtol=1e-5, atol=0, msg=n)
    kinds = buffered.layer_kinds(model)
    assert kinds["block.experts.0.weight"] == "experts" and kinds["block.shared_expert.weight"] == "shared_expert"


def test_router_on_flattened_tokens_is_measured_and_its_block_can_be_left_out():
    torch.manual_seed(6)
    plain, batches = MoEModel(router=True), moe_batches()
    expected, _ = brute_force(plain, batches, nano_loss)
    model = measure(copy.deepcopy(plain), strict=True)
    train(model, batches, nano_loss)
    got, _ = measured_sums(model)
    assert set(got) == set(expected) and buffered.layer_kinds(model)["block.router.weight"] == "router"
    for n in got:
        torch.testing.assert_close(got[n], expected[n], rtol=1e-5, atol=0, msg=n)
    with pytest.warns(UserWarning, match=r"block.router.weight \(Linear: in block \(TinyMoE\), left out by kinds="):
        model = measure(copy.deepcopy(plain), kinds={TinyMoE: None})
    train(model, batches, nano_loss)
    got, _ = measured_sums(model)
    assert set(got) == {"tok.weight", "ln.weight", "ln.bias", "head.weight", "head.bias"}
    for n in got:
        torch.testing.assert_close(got[n], expected[n], rtol=1e-5, atol=0, msg=n)


# ---------------------------------------------------------------- what other code attached to a layer

def test_hooks_attributes_and_buffers_go_with_the_module():
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3))
    lin = model[0]
    calls = []
    lin.register_forward_pre_hook(lambda m, args: calls.append(("pre", m)))
    lin.register_forward_hook(lambda m, args, kwargs, out: calls.append(("post", m)), with_kwargs=True)
    lin.register_full_backward_hook(lambda m, grad_in, grad_out: calls.append(("backward", m)))
    lin.register_state_dict_post_hook(lambda m, sd, prefix, local: calls.append(("state_dict", m)))
    loading = lin.register_load_state_dict_pre_hook(lambda m, *args: calls.append(("load", m)))
    lin.register_buffer("scale", torch.ones(1))
    lin.tag = "kept"
    keys = list(model.state_dict())
    calls.clear()
    measure(model, strict=True)
    new = model[0]
    assert isinstance(new, buffered.PEGradNormLinear) and new.tag == "kept" and list(model.state_dict()) == keys
    calls.clear()
    model(torch.randn(B, 4, requires_grad=True)).sum().backward()
    model.load_state_dict(model.state_dict())
    assert calls == [("pre", new), ("post", new), ("backward", new), ("state_dict", new), ("load", new)]
    assert new.example_count.item() == B
    del lin
    gc.collect()  # the module replaced is gone: the hooks that held it weakly are the new one's
    calls.clear()
    model.load_state_dict(model.state_dict())
    assert calls == [("state_dict", new), ("load", new)]
    calls.clear()
    loading.remove()  # the handles taken before measure() still remove their hooks
    model.load_state_dict(model.state_dict())
    assert calls == [("state_dict", new)]


def test_module_whose_forward_is_replaced_on_the_instance_is_left_out_naming_it():
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3))
    model[0].forward = lambda x: x
    with pytest.warns(UserWarning, match=r"0.weight \(Linear: its forward is replaced on the instance "
                                         r"\(.*<lambda>\), which would bypass the measured class\)"):
        measure(model)
    assert type(model[0]) is nn.Linear and isinstance(model[2], buffered.PEGradNormLinear)
    with pytest.raises(ValueError, match=r"0.weight \(Linear: its forward is replaced"):
        measure(model, strict=True)


def test_accelerate_forward_wrapper_calls_the_measured_forward():
    hooks = pytest.importorskip("accelerate.hooks")

    torch.manual_seed(8)
    plain = Positions(flat=False)
    batches = random_batches()
    expected, _ = brute_force(plain, batches, nano_loss)
    model = copy.deepcopy(plain)
    counting = counting_hook(hooks)
    hooks.add_hook_to_module(model.head, counting)
    measure(model, strict=True)
    assert isinstance(model.head, buffered.PEGradNormLinear) and model.head._hf_hook is counting
    train(model, batches, nano_loss)
    got, counts = measured_sums(model)
    assert counting.calls == len(batches) and counts == {float(2 * B)} and "head.weight" in got
    for n in got:
        torch.testing.assert_close(got[n], expected[n], rtol=1e-5, atol=0, msg=n)
    hooks.remove_hook_from_module(model.head)  # back to the measured class's own forward
    assert "_old_forward" not in vars(model.head)
    nano_loss(model, *batches[0]).backward()
    assert counting.calls == len(batches) and model.head.example_count.item() == 3 * B


# ---------------------------------------------------------------- Hugging Face models

transformers = pytest.importorskip("transformers")


def hf_loss(model, x, y):
    return model(input_ids=x, labels=x).loss


def hf_model(name):
    return tiny_hf(name)


def hf_kind(module):
    name = type(module).__name__
    return {"Conv1D": "linear", "Linear": "linear", "Embedding": "embedding", "LayerNorm": "layernorm",
            "LlamaRMSNorm": "rmsnorm"}.get(name)


@functools.lru_cache(maxsize=None)
def hf_reference(name, autocast=False):
    plain = hf_model(name)
    torch.manual_seed(1)
    batches = random_batches(vocab=97, shape=(B, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        return plain, batches, *brute_force(plain, batches, hf_loss)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize("linear,embedding,norm", list(itertools.product(LINEAR, EMBEDDING, NORM)))
def test_hugging_face_every_flag_matches_brute_force(name, linear, embedding, norm):
    plain, batches, expected, grads = hf_reference(name)
    model = copy.deepcopy(plain)
    keys = list(model.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        measure(model, linear=linear, embedding=embedding, norm=norm)
    assert list(model.state_dict()) == keys
    with torch.no_grad():
        torch.testing.assert_close(hf_loss(model, *batches[0]), hf_loss(plain, *batches[0]), rtol=1e-6, atol=0)
    check_measured(model, plain, batches, hf_loss, expected, grads, (linear, embedding, norm), rtol=2e-5,
                   kind_of=hf_kind)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hugging_face_fully_measured(name):
    model = hf_model(name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        measure(model, strict=True)
    kinds = layer_kinds(model)
    assert len(kinds) == len(list(model.parameters()))
    norm = "layernorm" if name == "gpt2" else "rmsnorm"
    assert {k for n, k in kinds.items() if "ln" in n or "norm" in n} == {norm}


def tiny_qwen2_moe():
    """Hugging Face's Qwen2MoeForCausalLM, random weights: a dense block, then a sparse one (4 routed
    experts, 2 a token, a shared expert and its gate on the flattened tokens)."""
    torch.manual_seed(2)
    config = transformers.Qwen2MoeConfig(hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                                         shared_expert_intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                                         num_key_value_heads=1, vocab_size=97, max_position_embeddings=16,
                                         num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2)
    return transformers.Qwen2MoeForCausalLM(config).eval()


def test_hugging_face_moe_block_is_measured_or_left_out_by_kinds():
    """The block is measured (tests/test_hf_moe.py checks its numbers); kinds={Block: None} leaves it out,
    naming each of its parameters, and measures the rest exactly."""
    plain = tiny_qwen2_moe()
    torch.manual_seed(1)
    batches = random_batches(vocab=97, shape=(B, 8))
    expected, _ = brute_force(plain, batches, hf_loss)
    measure(copy.deepcopy(plain), strict=True)
    block_class = type(plain.model.layers[1].mlp)
    model = copy.deepcopy(plain)
    block = [n for n, p in model.named_parameters() if n.startswith("model.layers.1.mlp.")]
    with pytest.warns(UserWarning, match=rf"measure: {len(block)} trainable parameters are not measured") as record:
        measure(model, kinds={block_class: None})
    message = str(record[0].message)
    assert all(n in message for n in block)
    assert "shared_expert_gate.weight (Linear: in model.layers.1.mlp (Qwen2MoeSparseMoeBlock), left out by kinds=" in message
    assert type(model.model.layers[1].mlp.shared_expert_gate) is nn.Linear
    assert isinstance(model.model.layers[0].mlp.up_proj, buffered.PEGradNormLinear)  # the dense block's MLP
    assert model.model.norm.variance_epsilon == plain.model.norm.variance_epsilon  # Hugging Face's attribute kept
    train(model, batches, hf_loss)
    got, counts = measured_sums(model)
    assert counts == {float(2 * B)} and set(got) == {n for n, _ in model.named_parameters()} - set(block)
    for n in got:
        torch.testing.assert_close(got[n], expected[n], rtol=2e-5, atol=1e-12, msg=n)


# bfloat16 autocast on CPU: the layers' norms (computed from bfloat16 activations and output
# gradients, accumulated in float32) against brute force under the same autocast: within 2%
# (bfloat16 keeps 8 bits; the per-example sums of squares differ in rounding order)
AUTOCAST_RTOL = 2e-2


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize("linear,embedding,norm", [("gns", "gns", "fused"), ("shim", "shim", "shim")])
def test_hugging_face_under_bfloat16_autocast(name, linear, embedding, norm):
    plain, batches, expected, grads = hf_reference(name, autocast=True)
    model = measure(copy.deepcopy(plain), linear=linear, embedding=embedding, norm=norm)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        train(model, batches, hf_loss)
    got, counts = measured_sums(model)
    assert len(got) == len(expected) and counts == {float(2 * B)}
    worst = max(abs(got[n] / expected[n] - 1) for n in got)
    assert worst < AUTOCAST_RTOL, worst
    total = sum(got.values()) / sum(expected.values()) - 1
    assert abs(total) < 1e-2, total


# ---------------------------------------------------------------- downstream, unchanged

def readme_example():
    """The code block under "Measuring the GNS of any model" in docs/library.md (the README links it)."""
    with open(os.path.join(REPO, "docs", "library.md")) as f:
        text = f.read()
    section = text[text.index("## Measuring the GNS of any model"):]
    return section[section.index("```python\n") + len("```python\n"):section.index("\n```\n")]


@pytest.mark.slow
def test_readme_example_runs_as_written(tmp_path, tmp_path_factory):
    """As a user's script outside the checkout, with the package installed (tests/loop_fixtures.py)."""
    run = run_script(readme_example(), tmp_path, installed_package(tmp_path_factory))
    assert run.returncode == 0, run.stderr
    lines = [line for line in run.stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 20
    gns = [float(line.rsplit("gns ", 1)[1]) for line in lines]
    assert all(math.isfinite(g) for g in gns[1:])
    analysis = subprocess.run([sys.executable, os.path.join(REPO, "gns-analysis.py"), "out-hf-gpt2", "--no-plots"],
                              cwd=tmp_path, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                              text=True, timeout=120)
    assert analysis.returncode == 0, analysis.stderr
    assert "20 steps with GNS measurements under 'train/gns', 28 parameters (LayerNorm 10, Linear 16, Embedding 2)" \
        in analysis.stdout
    assert "LayerNorm vs total GNS" in analysis.stdout


def test_measured_llama_through_the_estimators_log_and_analysis(tmp_path):
    """estimators_for / measure_all / reset_all, gradient accumulation, log.csv and the analysis on a
    measured Llama: its RMSNorms (model.layers.N.input_layernorm: no GPT name) are the RMSNorm group."""
    import nanogns.estimators.exact as gnstracking
    from nanogns.runlog import LogWrapper
    plain, batches, expected, _ = hf_reference("llama")
    model = measure(copy.deepcopy(plain))
    estimators = gnstracking.estimators_for(model)
    logger = LogWrapper(out_dir=str(tmp_path))
    logger.record_kinds(layer_kinds(model))
    for step in range(3):
        train(model, batches, hf_loss)
        row = gnstracking.measure_all(estimators, step, 2 * B, scaler=None)
        if step == 0:  # the first step is the brute-force one: |G_1|^2 = B sum_b ||g_b / B||^2
            for name, want in expected.items():
                got = row[f"train/gns/{name}/pegn"] ** 2
                assert got == pytest.approx(2 * B * want, rel=2e-5), name
        model.zero_grad(set_to_none=True)
        gnstracking.reset_all(estimators)
        logger.log(row)
        logger.step()
    logger.close()
    results, info = gns_analysis.analyze(load_log(str(tmp_path))[0], 0.5, kinds=layer_kinds(model))
    assert [g for g in info["groups"] if g != "total"] == ["RMSNorm", "Linear", "Embedding"]
    assert len(info["groups"]["RMSNorm"]) == 5 and "model.layers.1.post_attention_layernorm.weight" in \
        info["groups"]["RMSNorm"]
    assert np.isfinite(results["RMSNorm/gns"]).all() and info["norm_group"] == "RMSNorm"


@pytest.mark.slow
def test_measured_llama_compiles_with_no_new_graph_break():
    """torch._dynamo.explain: the measured Llama is one graph with no break, as the plain one is (0
    breaks, measured once here); compiled (AOTAutograd, buffers mutated in backward), its norms
    are brute force's."""
    import torch._dynamo
    plain, batches, expected, _ = hf_reference("llama")
    model = measure(copy.deepcopy(plain))
    x = batches[0][0]
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(input_ids=x, labels=x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    train(compiled, batches, hf_loss)
    got, count = measured_sums(model)
    assert count == {float(2 * B)} and set(got) == set(expected)
    for name in got:
        torch.testing.assert_close(got[name], expected[name], rtol=2e-5, atol=1e-12, msg=name)
    torch._dynamo.reset()


def test_a_copy_of_a_measured_model_keeps_its_own_forward_state():
    plain, batches, expected, _ = nano_reference(True)
    model = copy.deepcopy(measure(copy.deepcopy(plain), kinds={NanoLayerNorm: "layernorm"}))
    assert model.transformer.wpe._forward_state is model._gns_forward_state
    train(model, batches, nano_loss)
    got, counts = measured_sums(model)
    assert counts == {float(2 * B)}  # the positions [T] expanded to the copy's own batch
    torch.testing.assert_close(got["transformer.wpe.weight"], expected["transformer.wpe.weight"], rtol=1e-5, atol=0)


def test_layer_config_built_layer_applied_twice_is_an_error_naming_it():
    # built with the measured class directly, as layer_config does (no measure(), no forward state):
    # the tracker's count check names the parameter and the likely cause
    from nanogns.estimators.exact import MeasurementTracker

    class TwiceBuilt(Twice):
        def __init__(self):
            nn.Module.__init__(self)
            self.lin = buffered.PEGradNormLinear(4, 4)

    model = TwiceBuilt()
    tracker = MeasurementTracker.from_model(model)
    model(torch.randn(3, 4)).sum().backward()
    with pytest.raises(ValueError, match=r"lin.weight: the buffers counted 6 examples but batch_size=3; was its layer "
                                         r"applied 2 times in one forward"):
        tracker.step(batch_size=3)


def test_what_the_fused_kernel_cannot_take_is_left_unmeasured_with_the_reason():
    model = nn.Sequential(nn.Linear(6, 6), nn.Unflatten(1, (2, 3)), nn.LayerNorm((2, 3)))
    with pytest.warns(UserWarning, match=r"2.weight \(LayerNorm: PEGradNormFusedLayerNorm normalises over the last "
                                         r"dimension only"):
        measure(model, norm="fused")
    assert type(model[2]) is nn.LayerNorm and isinstance(model[0], buffered.PEGradNormLinear)
    measure(model, norm="shim", strict=True)  # the separated one takes it
    assert isinstance(model[2], buffered.PEGradNormSeparatedLayerNorm)


@pytest.mark.parametrize("options", [(), (("norm", "rmsnorm"), ("pos_emb", "rope"), ("tie_embeddings", False))])
def test_our_gpt_measured_equals_our_gpt_built_measured(options):
    """measure() on a plain GPT of model.py gives what layer_config's classes give the same GPT."""
    from nanogns.layers.config import classes_for_flags, set_contextual_config
    from model import GPT, GPTConfig
    config = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=T, vocab_size=V, dropout=0.0, bias=True, **dict(options))
    torch.manual_seed(0)
    built_with = classes_for_flags(linearclass="gns", embeddingclass="shim", lnclass="fused")
    with set_contextual_config(**built_with):
        built = GPT(config)
    plain = GPT(config)
    plain.load_state_dict(built.state_dict())
    model = measure(plain, linear="gns", embedding="shim", norm="fused", strict=True)
    assert [type(m) for m in model.modules()] == [type(m) for m in built.modules()]
    batches = random_batches()
    for m in (built, model):
        train(m, batches, lambda m, x, y: m(x, y)[1])
    got, want = measured_sums(model), measured_sums(built)
    assert got[1] == want[1] == {float(2 * B)} and got[0].keys() == want[0].keys()
    for name in want[0]:
        assert got[0][name] == pytest.approx(want[0][name], rel=1e-6), name
