"""
Test helpers, first the one brute-force oracle every per-example-norm test uses: each example's
gradient of its own loss by torch.func.vmap of torch.func.grad over the examples, and the float64
sums of their squared norms as a layer sees them in backward, g_b / B times the loss scale
(McCandlish et al. 2018, App. A). Then the tests' tiny GPT, and small models that
follow nanogns/layers' buffer convention, with the buffers filled from the oracle as a
per-example-norm layer would fill them.
"""
import itertools
import warnings

import pytest
import torch
import torch.nn as nn
from torch.func import functional_call, grad, vmap

from nanogns.layers import (PEGradNormEmbedding, PEGradNormSeparatedLayerNorm, PEGradNormShimLinear,
                      register_sqgradnorm_buffers)
from nanogns.layers.config import set_contextual_config
from model import GPT, GPTConfig

# ---------------------------------------------------------------- the oracle

def per_example_grads(module, loss, *batch):
    """
    {name: [n, *p.shape]}: each example's gradient of loss(forward, *example), where forward(*inputs)
    runs the module at the parameters being differentiated and every tensor of the example keeps a
    leading dimension of 1. vmap over the first dimension of every tensor in batch. Frozen parameters
    are held fixed and left out; a tied weight is there once, under its first name.
    """
    params = {n: p.detach() for n, p in module.named_parameters() if p.requires_grad}

    def example_loss(params, *example):
        forward = lambda *inputs: functional_call(module, params, inputs)  # noqa: E731
        return loss(forward, *(t.unsqueeze(0) for t in example))

    with warnings.catch_warnings():  # attention's backward has no batching rule: vmap loops, slower but exact
        warnings.filterwarnings("ignore", "There is a performance drop")
        return vmap(grad(example_loss), in_dims=(None,) + (0,) * len(batch))(params, *batch)


def example_sqnorms(grads):
    """{name: [n]}: ||g_b||^2 of each example's gradient, in float64."""
    return {n: g.double().flatten(1).square().sum(1) for n, g in grads.items()}


def sqgradnorm_sums(module, loss, batches, scale=1.0, mean=True):
    """
    {name: sum_b ||scale * g_b / B||^2} in float64 over every example of every micro-batch in batches
    (B in all): what a per-example-norm layer's buffer holds after nanoGPT's micro-steps on the mean
    loss times a loss scale. mean=False: the loss is the sum of the examples' losses (no 1 / B).
    """
    B = sum(batch[0].shape[0] for batch in batches) if mean else 1
    sums = {}
    for batch in batches:
        for n, sq in example_sqnorms(per_example_grads(module, loss, *batch)).items():
            sums[n] = sums.get(n, 0) + sq.sum() * (scale / B) ** 2
    return sums


def brute_force_norms(module, loss, *batch):
    """{name: (|G_B|, |G_1|)}: the norm of the batch's mean gradient, the RMS per-example norm."""
    grads = per_example_grads(module, loss, *batch)
    sq = example_sqnorms(grads)
    return {n: (g.double().mean(0).norm().item(), sq[n].mean().sqrt().item()) for n, g in grads.items()}


def output_grad_loss(forward, x, dy):
    """<forward(x), dy>: the loss whose gradient at the module's output is dy."""
    return (forward(x) * dy).sum()


def gpt_loss(forward, idx, targets):
    """nanoGPT's loss of GPT(idx, targets): the mean cross-entropy over the tokens."""
    return forward(idx, targets)[1]


# ---------------------------------------------------------------- the tests' tiny GPT

MEASURED = dict(Linear=PEGradNormShimLinear, Embedding=PEGradNormEmbedding, LayerNorm=PEGradNormSeparatedLayerNorm)
TINY_GPT = dict(block_size=8, vocab_size=32, n_layer=1, n_head=2, n_embd=16)


def tiny_gpt(seed=0, **layers):
    """One block, 16 features, 8 tokens of a 32-token vocabulary; layers: layer_config's classes."""
    torch.manual_seed(seed)
    with set_contextual_config(**layers):
        return GPT(GPTConfig(**TINY_GPT))


# GPTConfig's Llama-style options, every combination of them as keyword arguments (and a test id)
LLAMA = dict(norm='rmsnorm', mlp='swiglu', pos_emb='rope', tie_embeddings=False)
ARCHITECTURES = [dict(zip(LLAMA, values)) for values in itertools.product(
    ('layernorm', 'rmsnorm'), ('gelu', 'swiglu'), ('learned', 'rope'), (True, False))]


def arch_id(arch):
    return '-'.join(str(v) for v in arch.values())


def gpt_batches(n, b, seed=5):
    """n micro-batches of b examples for tiny_gpt: (ids, targets) pairs."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 32, (b, 8), generator=g), torch.randint(0, 32, (b, 8), generator=g))
            for _ in range(n)]


def tiny_hf(name, seed=0):
    """Hugging Face's GPT2LMHeadModel ("gpt2") or LlamaForCausalLM ("llama"), random weights, dropout 0:
    2 layers, 32 wide, a 97-token vocabulary (transformers is a test dependency, imported here)."""
    import transformers
    torch.manual_seed(seed)
    if name == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=16,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(config).eval()
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, vocab_size=97, max_position_embeddings=16)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: one intra-op thread is faster and immune to a loaded machine (autouse where imported)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(autouse=True)
def shapes_rule(monkeypatch):
    """The measured Linears choose ghost or materialise by the shapes rule, not by timing both at their
    first step (per_example_mode "auto"): two runs compared to 1e-5 must not take different methods
    because one ran on a busier machine (both exact, they round apart by about 1e-5 where the ghost
    norm's token pairs cancel). Autouse where imported."""
    import nanogns.layers.linear as linear_module
    monkeypatch.setattr(linear_module._MeasuredLinear, "per_example_mode", "shapes")


def with_rmsnorms(model, cls=nn.RMSNorm):
    """The model's LayerNorms replaced, under the same names, by cls (an RMSNorm class) of the same
    width: GPT (or ToyGPT) with RMSNorm, while model.py builds LayerNorms only."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.LayerNorm):
                setattr(module, name, cls(child.normalized_shape))
    return model


# ---------------------------------------------------------------- toy models with buffers

def measure(module):
    """Give every submodule that owns parameters the per-example-norm buffers."""
    for m in module.modules():
        if any(True for _ in m.parameters(recurse=False)):
            register_sqgradnorm_buffers(m)
    return module


class ToyBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.mlp = nn.ModuleDict(dict(c_fc=nn.Linear(d, 2 * d), c_proj=nn.Linear(2 * d, d)))

    def forward(self, x):
        return x + self.mlp.c_proj(torch.tanh(self.mlp.c_fc(self.ln_1(x))))


class ToyGPT(nn.Module):
    """GPT-shaped parameter names (transformer.wte, transformer.h.N.ln_1, ...) on a tiny regression."""

    def __init__(self, d=6, n_layer=2, vocab=11):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, d),
            h=nn.ModuleList([ToyBlock(d) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(d),
        ))
        self.head = nn.Linear(d, 1, bias=False)

    def forward(self, ids):
        x = self.transformer.wte(ids).mean(1)
        for block in self.transformer.h:
            x = block(x)
        return self.head(self.transformer.ln_f(x)).squeeze(-1)


def mse(pred, y):
    return 0.5 * (pred - y).pow(2).mean()


def regression_loss(forward, x, y):
    return mse(forward(x), y)


@torch.no_grad()
def fill_buffers(model, x, y, B, scale=1.0, loss=regression_loss, per_example=per_example_grads):
    """Add this micro-batch's sum_b ||scale * g_b / B||^2 and its size to the buffers."""
    sq = example_sqnorms(per_example(model, loss, x, y))
    for mname, m in model.named_modules():
        if "example_count" not in m._buffers:
            continue
        for pname, _ in m.named_parameters(recurse=False):
            m._buffers[f"{pname}_sqgradnorm"] += sq[f"{mname}.{pname}" if mname else pname].sum() * (scale / B) ** 2
        m._buffers["example_count"] += x.shape[0]


def train_step(model, micro_batches, scaler=None, loss=regression_loss, per_example=per_example_grads):
    """
    nanoGPT's micro-step loop: each micro-batch loss is a mean divided by the number of micro-steps
    (so the gradient is that of L = (1/B) sum_b l_b), backward through the scaler if any, buffers
    filled as the layers would (per_example: a faster exact per-example gradient function, if the
    model has one in closed form). Returns B.
    """
    B = sum(x.shape[0] for x, _ in micro_batches)
    scale = scaler.get_scale() if scaler is not None else 1.0
    for x, y in micro_batches:
        batch_loss = loss(model, x, y) / len(micro_batches)
        (scaler.scale(batch_loss) if scaler is not None else batch_loss).backward()
        fill_buffers(model, x, y, B, scale, loss, per_example)
    return B


def counting_hook(hooks):
    """An accelerate ModelHook (hooks: accelerate.hooks) counting the forwards it runs before, in .calls."""
    class Counting(hooks.ModelHook):
        def __init__(self):
            self.calls = 0

        def pre_forward(self, module, *args, **kwargs):
            self.calls += 1
            return args, kwargs
    return Counting()
