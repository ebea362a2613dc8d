"""
The whole GPT with every combination of per-example-norm layer classes: every measured
parameter present (the tied wte/lm_head weight included when both sides measure), each norm
equal to brute force (vmap over examples of the plain GPT's per-example loss), with two
micro-steps of gradient accumulation, bias on and off, eager and compiled; and the same for
each combination of the Llama-style options (RMSNorm, SwiGLU, rope, untied embeddings).
"""
import functools
import itertools
import os
import sys

import pytest
import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanogns.layers import (PEGradNormEmbedding, PEGradNormSeparatedRMSNorm, PEGradNormShimEmbedding,  # noqa: E402
                      PEGradNormShimLinear, find_sqgradnorm_buffers, set_per_example_mode,
                      zero_sqgradnorm_buffers)
from nanogns.layers.config import FLAG_CLASSES, classes_for_flags, set_contextual_config  # noqa: E402
from gns_fixtures import ARCHITECTURES, LLAMA, TINY_GPT, arch_id, gpt_loss, sqgradnorm_sums  # noqa: E402
from gns_fixtures import one_thread  # noqa: E402,F401  (autouse: tiny tensors, one thread)
from model import GPT, GPTConfig  # noqa: E402

TORCH_CLASSES = (nn.Linear, nn.Embedding, nn.LayerNorm, nn.RMSNorm)  # not measured
B, T, STEPS = 4, 16, 2

pytestmark = [pytest.mark.filterwarnings("ignore:tied weight")]


def config(bias, options=()):
    """The GPT of these tests; options: GPTConfig fields as (key, value) pairs (hashable, for reference's cache)."""
    return GPTConfig(**{**dict(n_layer=2, n_head=2, n_embd=32, block_size=T, vocab_size=65, dropout=0.0, bias=bias),
                        **dict(options)})


def build_with(classes, bias, options=()):
    with set_contextual_config(**classes):
        return GPT(config(bias, options))


def build(linear, embedding, layernorm, bias, options=()):
    """A GPT with the classes of train.py's --linearclass, --embeddingclass, --lnclass values."""
    return build_with(classes_for_flags(linearclass=linear, embeddingclass=embedding, lnclass=layernorm), bias, options)


@functools.lru_cache(maxsize=None)
def reference(bias, dtype=torch.float32, options=()):
    """(plain GPT state, micro-batches, brute-force norms, plain .grad) for one bias setting and options."""
    torch.manual_seed(0)
    cfg = config(bias, options)
    plain = GPT(cfg).to(dtype)
    shape = (B, cfg.block_size)
    batches = [(torch.randint(0, cfg.vocab_size, shape), torch.randint(0, cfg.vocab_size, shape)) for _ in range(STEPS)]
    expected = sqgradnorm_sums(plain, gpt_loss, batches)  # the shared brute-force oracle
    train(plain, batches)
    grads = {n: p.grad.clone() for n, p in plain.named_parameters()}
    return plain.state_dict(), batches, expected, grads


def train(model, batches):
    """nanoGPT's micro-steps: each mean loss divided by the number of micro-steps."""
    for x, y in batches:
        _, loss = model(x, y)
        (loss / len(batches)).backward()


def measured_names(names, classes, cfg):
    """The trainable parameters whose layers measure (every class but torch's), in named_parameters order,
    for a GPT of GPTConfig cfg built with `classes` (a kind not among them is torch's)."""
    norm = "RMSNorm" if cfg.norm == "rmsnorm" else "LayerNorm"
    measures = {kind: classes.get(kind, nn.Linear) not in TORCH_CLASSES for kind in ("Linear", "Embedding", norm)}
    measures["norm"] = measures[norm]

    def measured(n):
        if n == "transformer.wte.weight":  # tied to lm_head: needs both sides; untied, the embedding's alone
            return measures["Embedding"] and (measures["Linear"] or not cfg.tie_embeddings)
        if n.startswith("transformer.wpe"):
            return measures["Embedding"]
        if ".ln_" in n:
            return measures["norm"]
        return measures["Linear"]
    return [n for n in names if measured(n)]


def check_against_brute_force(model, expected, names, rtol=1e-5):
    found = find_sqgradnorm_buffers(model)
    assert [n for n, *_ in found] == names
    for n, p, buf, count in found:
        assert buf.dtype == torch.float32 and count.item() == B * STEPS
        torch.testing.assert_close(buf.item(), expected[n].item(), rtol=rtol, atol=1e-12, msg=n)


def check_gpt_against_brute_force(classes, bias, options=()):
    """
    A GPT built with `classes` (set_contextual_config's keyword arguments: any classes) and GPTConfig
    `options` ((key, value) pairs) after two micro-steps: every parameter its layers measure is found,
    each norm equal to brute force, and .grad is the plain GPT's (bit for bit when every class keeps
    torch's own backward).
    """
    state, batches, expected, plain_grads = reference(bias, options=options)
    model = build_with(classes, bias, options)
    model.load_state_dict(state)
    train(model, batches)
    check_against_brute_force(model, expected, measured_names(list(state_names(model)), classes, model.config))
    # torch's backward, the norms beside it
    shims = (PEGradNormShimLinear, PEGradNormShimEmbedding, PEGradNormSeparatedRMSNorm)
    exact = all(cls in TORCH_CLASSES or issubclass(cls, shims) for cls in classes.values())
    for n, p in model.named_parameters():
        if exact:
            assert torch.equal(p.grad, plain_grads[n]), n
        else:
            torch.testing.assert_close(p.grad, plain_grads[n], rtol=1e-5, atol=1e-6, msg=n)
    return model


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("linear,embedding,layernorm", list(itertools.product(*FLAG_CLASSES.values())))
def test_gpt_norms_match_brute_force(linear, embedding, layernorm, bias):
    """Every combination of train.py's layer flag values, from layer_config's table."""
    check_gpt_against_brute_force(
        classes_for_flags(linearclass=linear, embeddingclass=embedding, lnclass=layernorm), bias)


# --------------------------------------------------------------------------------------------
# Llama-style options, on the tests' tiny GPT (one block, 16 features, 8 tokens): there are many

def llama_options(arch):
    return tuple({**TINY_GPT, **arch}.items())


@pytest.mark.parametrize("lnclass", list(FLAG_CLASSES["lnclass"]))
@pytest.mark.parametrize("linear,embedding", list(itertools.product(["gns", "shim"], repeat=2)))
@pytest.mark.parametrize("arch", ARCHITECTURES, ids=arch_id)
def test_llama_style_gpt_norms_match_brute_force(arch, linear, embedding, lnclass):
    """
    Every combination of norm, mlp, pos_emb and tie_embeddings with the measured Linear and Embedding
    classes and each --lnclass value, whose table gives the class of whichever normalisation the
    model uses (torch's RMSNorm, not measured, where it has none for RMSNorm). Untied, wte and lm_head
    are two parameters, each measured by its own layer, with no cross term.
    """
    model = check_gpt_against_brute_force(
        classes_for_flags(linearclass=linear, embeddingclass=embedding, lnclass=lnclass), False, llama_options(arch))
    reported = [n for n, *_ in find_sqgradnorm_buffers(model)]
    assert ("lm_head.weight" in reported) != arch["tie_embeddings"]  # tied, it is wte's, measured there


@pytest.mark.parametrize("arch", ARCHITECTURES, ids=arch_id)
def test_llama_style_gpt_with_biases(arch):
    """bias=True: in the Linears (SwiGLU's three too) and LayerNorms; RMSNorm has none."""
    lnclass = list(FLAG_CLASSES["lnclass"])[-1]
    check_gpt_against_brute_force(
        classes_for_flags(linearclass="gns", embeddingclass="shim", lnclass=lnclass), True, llama_options(arch))


def test_compile_a_llama_style_gpt():
    """rope's angles, SwiGLU, RMSNorm and the untied head trace in one graph, and the norms stay exact
    (the tied head's link under compile: test_compile_tracing_every_tie_pairing)."""
    options = llama_options(LLAMA)
    state, batches, expected, _ = reference(False, options=options)
    classes = classes_for_flags(linearclass="gns", embeddingclass="shim", lnclass="shim")
    model = build_with(classes, False, options)
    compiled_matches_eager(model, state, batches, "aot_eager")
    check_against_brute_force(model, expected, measured_names(list(state_names(model)), classes, model.config))


def state_names(model):
    return (n for n, _ in model.named_parameters())


def test_eval_generate_and_dropped_forwards_leave_nothing_behind():
    state, batches, expected, _ = reference(True)
    model = build("gns", "shim", "shim", True)
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        model(*batches[0])  # estimate_loss
        model.generate(batches[0][0][:, :4], 3)  # lm_head on the last position only
    model.train()
    model(*batches[1])  # a forward whose backward never runs
    assert all(b.item() == 0 for _, _, b, _ in find_sqgradnorm_buffers(model))
    assert not model.lm_head._tie
    train(model, batches)
    check_against_brute_force(model, expected, list(state_names(model)))
    zero_sqgradnorm_buffers(model)
    train(model, batches)  # the next optimizer step (same weights) measures the same again
    check_against_brute_force(model, expected, list(state_names(model)))


def test_dtype_casts_keep_float32_buffers_and_the_tie():
    state, batches, expected, _ = reference(True, torch.float64)
    model = build("shim", "gns", "shim", True)
    model.to(torch.bfloat16)
    assert all(b.dtype == torch.float32 for _, _, b, _ in find_sqgradnorm_buffers(model))
    model.to(torch.float64)
    model.load_state_dict(state)
    train(model, batches)
    check_against_brute_force(model, expected, list(state_names(model)))


def test_frozen_parameters_are_not_reported():
    state, batches, _, _ = reference(True)
    model = build("gns", "gns", "shim", True)
    model.load_state_dict(state)
    model.transformer.wpe.weight.requires_grad_(False)
    model.transformer.h[0].ln_1.bias.requires_grad_(False)
    model.transformer.h[1].mlp.c_fc.weight.requires_grad_(False)
    train(model, batches)
    names = [n for n, *_ in find_sqgradnorm_buffers(model)]
    assert names == [n for n, p in model.named_parameters() if p.requires_grad]


# --------------------------------------------------------------------------------------------
# torch.compile

def compiled_matches_eager(model, state, batches, backend):
    model.load_state_dict(state)
    train(model, batches)
    eager = {n: (b.item(), p.grad.clone()) for n, p, b, _ in find_sqgradnorm_buffers(model)}
    model.zero_grad(set_to_none=True)
    zero_sqgradnorm_buffers(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    train(compiled, batches)
    found = find_sqgradnorm_buffers(model)
    assert [n for n, *_ in found] == list(eager)
    for n, p, b, count in found:
        assert count.item() == B * STEPS
        torch.testing.assert_close(b.item(), eager[n][0], rtol=1e-5, atol=1e-12, msg=n)
        torch.testing.assert_close(p.grad, eager[n][1], rtol=1e-4, atol=1e-6, msg=n)
    return compiled


@pytest.mark.parametrize("linear,embedding", list(itertools.product(["gns", "shim"], ["gns", "shim"])))
def test_compile_tracing_every_tie_pairing(linear, embedding):
    """The whole graph traces (fullgraph) and AOTAutograd keeps the buffer updates."""
    state, batches, _, _ = reference(True)
    compiled_matches_eager(build(linear, embedding, "shim", True), state, batches, "aot_eager")


def test_compile_with_changing_batch_shapes():
    """A recompile with dynamic shapes (a smaller last batch, shorter sequences) stays exact."""
    state, batches, _, _ = reference(True)
    model = build("gns", "gns", "shim", True)
    compiled = compiled_matches_eager(model, state, batches, "aot_eager")
    for b, t in [(3, T - 4)]:
        x, y = batches[0][0][:b, :t].contiguous(), batches[0][1][:b, :t].contiguous()
        sums = []
        for m in (compiled, model):
            zero_sqgradnorm_buffers(model)
            model.zero_grad(set_to_none=True)
            m(x, y)[1].backward()
            sums.append([buf.item() for _, _, buf, _ in find_sqgradnorm_buffers(model)])
            assert all(c.item() == b for *_, c in find_sqgradnorm_buffers(model))
        torch.testing.assert_close(sums[0], sums[1], rtol=1e-5, atol=1e-12)


@pytest.mark.parametrize("options", [(), (("tie_embeddings", False), ("bias", False))], ids=["tied", "untied"])
def test_compile_with_materialised_per_example_gradients(options):
    """Traced, materialised W_b give their squares and their sum in one pass (the tied head gathers
    from its W_b the old way): as eager, and exact."""
    state, batches, expected, _ = reference(True, options=options)
    model = build("gns", "gns", "shim", True, options)
    set_per_example_mode(model, "materialise")
    compiled_matches_eager(model, state, batches, "aot_eager")
    check_against_brute_force(model, expected, list(state_names(model)))


@pytest.mark.slow
def test_compile_inductor_with_every_class():
    """One tiny GPT holding all five classes, compiled by inductor: norms and .grad as eager,
    and equal to brute force."""
    state, batches, expected, _ = reference(True)
    model = build("gns", "shim", "shim", True)  # tie: shim embedding <-> fused head
    for block in model.transformer.h:
        for name in ("c_fc", "c_proj"):
            old = getattr(block.mlp, name)
            setattr(block.mlp, name, PEGradNormShimLinear(old.in_features, old.out_features))
    model.transformer.wpe = PEGradNormEmbedding(T, 32)
    compiled = compiled_matches_eager(model, state, batches, "inductor")
    check_against_brute_force(model, expected, list(state_names(model)))
    zero_sqgradnorm_buffers(model)
    with torch.no_grad():
        compiled(*batches[0])
    train(compiled, batches)
    check_against_brute_force(model, expected, list(state_names(model)))


@pytest.mark.parametrize("flags", [dict(lnclass="fused"), dict(linearclass="gns", embeddingclass="gns", lnclass="shim"),
                                   dict(linearclass="gns", embeddingclass="gns", lnclass="fused")],
                         ids=["ln-fused", "every-layer", "every-layer-fused"])
def test_a_compiled_training_step_is_not_recompiled_after_the_first(flags):
    """torch.compile traces the measured GPT once: later steps (accumulation, the estimator reading and
    zeroing the buffers, the optimizer step) change nothing its guards watch. Dynamo's own backend, no
    code generation: a recompile is decided by the guards alone."""
    import torch._dynamo
    import nanogns.estimators.exact as gnstracking
    torch._dynamo.reset()
    torch.manual_seed(0)
    with set_contextual_config(**classes_for_flags(**flags)):
        model = GPT(GPTConfig(**TINY_GPT))
    estimators = gnstracking.estimators_for(model)
    compiled = torch.compile(model, backend="aot_eager")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    for step in range(3):
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            for _ in range(2):
                ids = torch.randint(0, TINY_GPT["vocab_size"], (4, TINY_GPT["block_size"]), generator=generator)
                (compiled(ids, ids)[1] / 2).backward()
        row = gnstracking.measure_all(estimators, step, 8, None)
        assert row and all(v == 8 for k, v in row.items() if k.endswith("/batch_size"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        gnstracking.reset_all(estimators)
    torch._dynamo.reset()
