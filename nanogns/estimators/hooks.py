"""
Per-example gradient norms of plain nn.Linear layers from forward/backward hooks, with no change to
the model (Gray, Samar & Hestness 2023, "Efficient and Approximate Per-Example Gradient Norms for
Gradient Noise Scale", WANT@NeurIPS), logged beside the exact norms of nanogns/layers to compare.
Both kinds accumulate in float32 over the micro-steps until zero_hook_results():

- 'exact' (add_exact_hooks): from the layer's input x and output gradient dy, per example
  ||sum_t dy_bt x_bt^T||^2 and ||sum_t dy_bt||^2, by nanogns.layers.linear_sqnorms (the shim layer's
  maths and chunking, ghost or materialised from the shapes: a hook keeps no choice to time). The
  big batch is ||p.grad||.
- 'sogns' (add_sogns_hooks): the Scaled Output GNS, each example's input replaced by its RMS
  sigma_b = ||x_b|| / sqrt(T K) at every position: the surrogate W~_b = sigma_b (sum_t dy_bt) 1_K^T,
  ||W~_b||^2 = (||x_b||^2 / T) ||sum_t dy_bt||^2, exact for T = 1. As in the paper's code, the
  weight's big batch is the surrogate's ||sum_b W~_b|| (a GNS of one set of gradients), biases exact.

The layers see g_b / B (the step's loss is a mean over its B examples) times a GradScaler's s.
Parameters shared with another module (the tied wte/lm_head weight) or parametrized are left
out: a module hook sees only its own share of their gradient. Under torch.compile the numbers
are unchanged but dynamo runs the forward eagerly: use compile=False.
"""
from collections import namedtuple

import torch
import torch.nn as nn

from nanogns.layers import linear_sqnorms
from nanogns.estimators.base import Estimator, current_scale, distributed_world_size, read_now
from nanogns.maths import PREFIXES, parameter_columns

# (name, parameter, sum of per-example squared norms as the layer saw them [float32 0-dim
#  tensor], example count [int], SOGNS surrogate big-batch gradient [L-vector] or None where
#  the big batch is p.grad)
HookResult = namedtuple('HookResult', 'name param sqnorm_sum example_count surrogate_grad')
KIND_PREFIXES = {'exact': PREFIXES['hooks_exact'], 'sogns': PREFIXES['hooks_sogns']}


def _as_batch_time_feature(t):
    """[B, ..., F] -> [B, T, F] with every middle dimension folded into T (2-D -> T = 1)."""
    if t.dim() == 1:
        t = t.unsqueeze(0)
    return t.reshape(t.shape[0], -1, t.shape[-1])


def _state(module, kind, params):
    """A fresh record of one kind of hook's running sums on one module (filled on backward)."""
    states = module.__dict__.setdefault('gns_hook_state', {})
    if kind in states:
        raise ValueError(f"{type(module).__name__} already has {kind} hooks")
    states[kind] = dict(params=tuple(params), sqnorm={}, count=0, surrogate=None)
    return states[kind]


def _add(acc, name, value):
    """acc[name] += value, creating the float32 accumulator on value's device."""
    if name in acc:
        acc[name] += value
    else:
        acc[name] = value.detach().float().clone()


def _own_params(module, params):
    if params is None:
        params = [n for n in ('weight', 'bias') if module._parameters.get(n) is not None
                  and module._parameters[n].requires_grad]
    return params


def exact_linear_sqnorms(x, dy, with_weight=True, with_bias=True):
    """
    Sums over the batch of the exact per-example squared gradient norms of a Linear
    (weight, bias), float32 0-dim tensors (None where not asked). x [B,...,K], dy [B,...,L].
    nanogns.layers.linear_sqnorms, the shim Linear's own maths.
    """
    return linear_sqnorms(x, dy, with_weight, with_bias)


def add_exact_hooks(module, params=None):
    """
    Measure the exact per-example squared gradient norms of `module` (an nn.Linear) on every
    backward. params: which of its parameters ('weight', 'bias'); default all trainable ones.
    Returns the hook handles.
    """
    assert isinstance(module, nn.Linear), f"exact hooks need an nn.Linear, got {type(module).__name__}"
    state = _state(module, 'exact', _own_params(module, params))

    def on_output_grad(x, dy):
        weight, bias = exact_linear_sqnorms(x, dy, 'weight' in state['params'], 'bias' in state['params'])
        if weight is not None:
            _add(state['sqnorm'], 'weight', weight)
        if bias is not None:
            _add(state['sqnorm'], 'bias', bias)
        state['count'] += _as_batch_time_feature(dy).shape[0]  # a host int: no device traffic

    def forward_hook(module, inputs, output):
        # only training forwards that will be differentiated; the closure keeps x for the backward
        if torch.is_grad_enabled() and output.requires_grad:
            x = inputs[0].detach()
            output.register_hook(lambda dy: on_output_grad(x, dy))

    return [module.register_forward_hook(forward_hook)]


def add_sogns_hooks(module, params=None):
    """
    Measure the SOGNS approximation of the per-example squared gradient norms of `module`
    (an nn.Linear; formula in the module docstring). Returns the hook handles.
    """
    assert isinstance(module, nn.Linear), f"SOGNS hooks need an nn.Linear, got {type(module).__name__}"
    state = _state(module, 'sogns', _own_params(module, params))

    @torch.no_grad()
    def on_output_grad(x_sqnorm_per_position, dy):
        dy = _as_batch_time_feature(dy)
        out_grad = dy.float().sum(1)  # [B, L]: sum_t dy_bt, the per-example bias gradient
        if 'weight' in state['params']:
            # ||W~_b||^2 = (||x_b||^2 / T) ||sum_t dy_bt||^2 and W~_b's L-vector sqrt(K) sigma_b sum_t dy_bt
            _add(state['sqnorm'], 'weight', (x_sqnorm_per_position * out_grad.square().sum(1)).sum())
            surrogate = x_sqnorm_per_position.sqrt() @ out_grad  # sqrt(K) sigma_b = sqrt(||x_b||^2 / T)
            state['surrogate'] = surrogate if state['surrogate'] is None else state['surrogate'] + surrogate
        if 'bias' in state['params']:
            _add(state['sqnorm'], 'bias', out_grad.square().sum())
        state['count'] += dy.shape[0]

    def forward_hook(module, inputs, output):
        if torch.is_grad_enabled() and output.requires_grad:
            with torch.no_grad():
                x = _as_batch_time_feature(inputs[0])
                # ||x_b||^2 / T = K sigma_b^2, reduced in float32 without a float32 copy of x
                x_sqnorm = torch.linalg.vector_norm(x, dim=(1, 2), dtype=torch.float32).square()
                x_sqnorm_per_position = x_sqnorm / x.shape[1]
            output.register_hook(lambda dy: on_output_grad(x_sqnorm_per_position, dy))

    return [module.register_forward_hook(forward_hook)]


def add_hooks_to_model(model, add_hooks):
    """
    Apply add_hooks (add_exact_hooks or add_sogns_hooks) to every nn.Linear of `model`
    (subclasses included, nanogns/layers' per-example-norm Linears too, for a like-for-like
    comparison with their exact norms), measuring only parameters that are the module's own: not shared with another module (tied
    weights) and not parametrized. Returns all hook handles (handle.remove() undoes them).
    """
    owners = {}
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                owners[id(p)] = owners.get(id(p), 0) + 1
    handles = []
    for module in model.modules():
        if not isinstance(module, nn.Linear):
            continue
        params = [n for n in ('weight', 'bias') if module._parameters.get(n) is not None
                  and module._parameters[n].requires_grad and owners[id(module._parameters[n])] == 1]
        if params:
            handles += add_hooks(module, params)
    return handles


ADD_HOOKS = {'exact': add_exact_hooks, 'sogns': add_sogns_hooks}


def _kind_of(add_hooks_or_kind):
    kind = {add: kind for kind, add in ADD_HOOKS.items()}.get(add_hooks_or_kind, add_hooks_or_kind)
    if kind not in ADD_HOOKS:
        raise ValueError(f"unknown hook kind {add_hooks_or_kind!r}; use 'exact' or 'sogns'")
    return kind


def gather_hook_results(model, kind='exact'):
    """
    One HookResult per measured parameter (named as in model.named_modules()), in module order:
    the running sum of per-example squared norms as the layer saw them (times s^2 under a
    GradScaler), the example count since the last zeroing (an int), and for a SOGNS weight the
    surrogate big-batch gradient (times s). Tensors stay on the device; nothing is synchronised.
    A layer whose hook has not fired yet reports zeros.
    """
    kind = _kind_of(kind)
    results = []
    for mname, module in model.named_modules():
        state = module.__dict__.get('gns_hook_state', {}).get(kind)
        if state is None:
            continue
        for pname in state['params']:
            p = module._parameters[pname]
            zero = torch.zeros((), dtype=torch.float32, device=p.device)
            surrogate = None
            if kind == 'sogns' and pname == 'weight':
                surrogate = state['surrogate'] if state['surrogate'] is not None else \
                    torch.zeros(module.out_features, dtype=torch.float32, device=p.device)
            name = f"{mname}.{pname}" if mname else pname
            results.append(HookResult(name, p, state['sqnorm'].get(pname, zero), state['count'], surrogate))
    return results


@torch.no_grad()
def zero_hook_results(model):
    """Reset every hook's running sums (after each optimizer step)."""
    for module in model.modules():
        for state in module.__dict__.get('gns_hook_state', {}).values():
            state['sqnorm'].clear()
            state['count'] = 0
            state['surrogate'] = None


@torch.no_grad()
def hook_measurements(model, kind='exact', prefix=None, loss_scale=1.0, grad_scale=1.0):
    """
    The step's measurements in the tracker's CSV schema, as a dict of floats:
      {prefix}/{name}/norm        big-batch gradient norm |G_B|: ||p.grad|| (exact hooks, biases)
                                  or the SOGNS surrogate's ||sum_b W~_b|| (SOGNS weights)
      {prefix}/{name}/pegn        sqrt(|G_1|^2), |G_1|^2 = (1/B) sum_b ||g_b||^2 = B sum_b ||g_b/B||^2
      {prefix}/{name}/batch_size  B, the examples of the optimizer step over all processes
    prefix defaults to 'train/hooks_gns' (exact) or 'train/sogns'. Call after the last backward of
    the step, before clipping. loss_scale: the GradScaler scale s of this step's backward (a float,
    or the scaler's device tensor; 1.0 without fp16); grad_scale: the scale p.grad still carries,
    1.0 after scaler.unscale_, s before it. Under DDP call it on every rank (one all-reduce of the
    sums): with B_rank examples per rank and B = W B_rank,
    |G_1|^2 = (B_rank^2 / B) sum_ranks sum_b ||g_b/B_rank||^2. One host transfer.
    Layers that saw no example this step are left out.
    """
    values, context = hook_sums(model, kind, prefix, loss_scale, grad_scale)
    return finish_hook_sums(read_now(values), context)


@torch.no_grad()
def hook_sums(model, kind='exact', prefix=None, loss_scale=1.0, grad_scale=1.0):
    """hook_measurements() up to its read: (values, context), values the norms and counts on the
    device (None when no layer is hooked) and finish_hook_sums(values.tolist(), context) its dict."""
    kind = _kind_of(kind)
    prefix = prefix if prefix is not None else KIND_PREFIXES[kind]
    results = gather_hook_results(model, kind)
    if not results:
        return None, None
    device = results[0].param.device
    sqnorm_sums = torch.stack([r.sqnorm_sum.to(device) for r in results])
    counts = torch.tensor([float(r.example_count) for r in results], device=device)
    surrogates = [r.surrogate_grad.to(device) for r in results if r.surrogate_grad is not None]
    flat = torch.cat([sqnorm_sums, counts, *surrogates])
    world_size = distributed_world_size()
    if world_size > 1:
        torch.distributed.all_reduce(flat)
    n = len(results)
    sqnorm_sums, total_counts = flat[:n], flat[n:2 * n]
    surrogates = flat[2 * n:].split([s.numel() for s in surrogates]) if surrogates else []
    rank_counts = total_counts / world_size  # ranks see equal batches
    pe_sqnorm = sqnorm_sums * rank_counts.square() / total_counts.clamp(min=1) / loss_scale ** 2
    norms, surrogate_iter = [], iter(surrogates)
    for r in results:
        if r.surrogate_grad is not None:
            # DDP averages gradients over ranks; the surrogate follows p.grad: mean of the ranks'
            norms.append(torch.linalg.vector_norm(next(surrogate_iter) / world_size) / loss_scale)
        elif r.param.grad is not None:
            norms.append(torch.linalg.vector_norm(r.param.grad.float()) / grad_scale)
        else:
            norms.append(torch.zeros((), dtype=torch.float32, device=device))
    values = torch.cat([torch.stack(norms).to(device), pe_sqnorm.sqrt(), total_counts])
    return values, ([r.name for r in results], prefix)


def finish_hook_sums(host, context):
    """hook_sums()'s values, read (host), as hook_measurements()' columns."""
    if context is None:
        return {}
    names, prefix = context
    n = len(names)
    out = {}
    for name, norm, pegn, count in zip(names, host[:n], host[n:2 * n], host[2 * n:]):
        if count > 0:
            out.update(parameter_columns(prefix, name, norm, pegn, int(count)))
    return out


class HooksEstimator(Estimator):
    """The Linear hooks ('exact' or 'sogns') on every own parameter of `model`'s Linears, behind
    the estimators' interface (nanogns.estimators.base)."""
    deferred = False  # its sums are read when collected, each step

    def __init__(self, model, kind):
        self.kind = _kind_of(kind)
        self.name = KIND_PREFIXES[self.kind]
        self.model = model
        self.handles = add_hooks_to_model(model, ADD_HOOKS[self.kind])

    def sums(self, step, examples, scaler, skipped=None):
        scale = current_scale(scaler)  # p.grad is not unscaled yet: it carries the scale too
        return hook_sums(self.model, self.kind, loss_scale=scale, grad_scale=scale)

    def finish(self, host, context):
        return finish_hook_sums(host, context)

    def reset(self):
        zero_hook_results(self.model)
