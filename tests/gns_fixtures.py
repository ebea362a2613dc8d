"""
Test helpers: small models that follow buffered.py's buffer convention, with the buffers filled
from brute-force per-example gradients (torch.func.vmap of torch.func.grad), exactly as a
per-example-norm layer would fill them during backward: sum_b ||s * g_b / B||^2 per parameter and
the example count, accumulated over micro-steps.
"""
import torch
import torch.nn as nn
from torch.func import functional_call, grad, vmap

from buffered import register_sqgradnorm_buffers


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


def per_example_grads(model, x, y, loss_fn=mse):
    """{name: [n, *shape]} gradients of each example's own loss."""
    params = {n: p.detach() for n, p in model.named_parameters()}

    def one(params, xb, yb):
        return loss_fn(functional_call(model, params, (xb.unsqueeze(0),)), yb.unsqueeze(0))

    return vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)


@torch.no_grad()
def fill_buffers(model, x, y, B, scale=1.0, loss_fn=mse, per_example=per_example_grads):
    """Add this micro-batch's sum_b ||scale * g_b / B||^2 and its size to the buffers."""
    grads = per_example(model, x, y, loss_fn)
    for mname, m in model.named_modules():
        if "example_count" not in m._buffers:
            continue
        for pname, _ in m.named_parameters(recurse=False):
            g = grads[f"{mname}.{pname}" if mname else pname]
            m._buffers[f"{pname}_sqgradnorm"] += (g.flatten(1) * (scale / B)).pow(2).sum()
        m._buffers["example_count"] += x.shape[0]


def train_step(model, micro_batches, scaler=None, loss_fn=mse, per_example=per_example_grads):
    """
    nanoGPT's micro-step loop: each micro-batch loss is a mean divided by the number of micro-steps
    (so the gradient is that of L = (1/B) sum_b l_b), backward through the scaler if any, buffers
    filled as the layers would (per_example: a faster exact per-example gradient function, if the
    model has one in closed form). Returns B.
    """
    B = sum(x.shape[0] for x, _ in micro_batches)
    scale = scaler.get_scale() if scaler is not None else 1.0
    for x, y in micro_batches:
        loss = loss_fn(model(x), y) / len(micro_batches)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        fill_buffers(model, x, y, B, scale, loss_fn, per_example)
    return B


def brute_force_norms(model, x, y, loss_fn=mse):
    """{name: (|G_B|, |G_1|)} over the whole batch, straight from the per-example gradients."""
    grads = per_example_grads(model, x, y, loss_fn)
    return {n: (g.mean(0).norm().item(), g.flatten(1).pow(2).sum(1).mean().sqrt().item())
            for n, g in grads.items()}
