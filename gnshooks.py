"""
Per-example gradient norms of plain nn.Linear layers from forward/backward hooks, with no change
to the model: the estimators of Gray, Samar & Hestness, "Efficient and Approximate Per-Example
Gradient Norms for Gradient Noise Scale" (WANT@NeurIPS 2023), kept so that a run can log them
beside the exact per-example norms of buffered.py / gnstracking.py and compare.

Two kinds of hooks, both accumulating in float32 over every gradient-accumulation micro-step
until zero_hook_results() (call it after each optimizer step):

- 'exact' (add_exact_hooks): the forward hook keeps the layer input x [B,T,K], a hook on the
  output's gradient gets dy [B,T,L], and per example b
      weight: ||W_b||^2 = ||sum_t dy_bt x_bt^T||^2 = sum_{t,t'} <x_bt, x_bt'> <dy_bt, dy_bt'>
      bias:   ||sum_t dy_bt||^2
  computed in the ghost form (B*T*T memory) or by materialising W_b (B*K*L memory), whichever
  takes fewer flops, in batch chunks that bound the extra memory. 2-D inputs are T = 1, where
  the weight term is ||x_b||^2 ||dy_b||^2. The big batch is the real gradient ||p.grad||.
  Memory: the hook holds a reference to x until the backward of the layer (the layer's own
  backward saves x anyway; under autocast the reference keeps the uncast x alive as well).

- 'sogns' (add_sogns_hooks): the Scaled Output Gradient Noise Scale. Each example's input
  activations are replaced by their root mean square under the paper's assumption that
  activations are Gaussian with one variance per example,
      sigma_b^2 = ||x_b||^2 / (T*K)       (mean square over the example's T*K input entries),
  i.e. x_bt is replaced by the constant vector sigma_b * 1_K at every position t. Then
      <x_bt, x_bt'>  ->  K sigma_b^2 = ||x_b||^2 / T       for every pair (t, t'),
  the expectation of <x_bt, x_bt'> when one Gaussian vector x_b ~ N(0, sigma_b^2 I_K) is shared
  by all positions, and the per-example weight gradient becomes the rank-one surrogate
      W~_b = sigma_b (sum_t dy_bt) 1_K^T,    ||W~_b||^2 = (||x_b||^2 / T) * ||sum_t dy_bt||^2,
  which needs only the output gradient reduced over time (what the bias gradient needs anyway)
  and one scalar per example from the forward pass: O(B*T*(K+L)) work, B floats kept.
  For T = 1 it equals the exact ||x_b||^2 ||dy_b||^2. We choose this (correlated-positions)
  form over the independent-positions alternative <x_bt, x_bt'> -> delta_tt' ||x_b||^2 / T
  because it is the one the paper's released code computes (so the numbers compare with the
  earlier work) and because it defines a surrogate gradient W~_b, so the big-batch norm can be
  taken of the same surrogate, sum_b W~_b, making the result the true noise scale of the
  surrogate gradients; mixing the surrogate's per-example norms with the real ||p.grad|| would
  not be a noise scale of anything. So for SOGNS the weight's big-batch norm is
  ||sum_b W~_b|| = sqrt(K) ||sum_b sigma_b sum_t dy_bt|| (an L-vector kept per layer), while
  biases are exact on both sides, as in the paper's code.

What the layer sees: the training loss is the mean over the B examples of the optimizer step
(each micro-step's mean loss is divided by grad_accum_steps), so the per-example gradient a layer
sees is g_b / B and the running sums hold sum_b ||g_b / B||^2 over the B_rank examples of this
process; under a float16 GradScaler with scale s the output gradients carry s, so the sums hold
s^2 times that (and the SOGNS surrogate s times): pass loss_scale=s to hook_measurements(), or
divide yourself when using gather_hook_results().

A parameter shared with another module (GPT's tied wte/lm_head weight) is left out: a hook on the
Linear sees only its own share of the gradient, and the per-example norm of the sum is out of
reach of module hooks (buffered.py measures it exactly). Weights under a parametrization
(spectral norm) are left out too: the hook sees the gradient of the computed weight, not of the
parameter. Layers that measure themselves (buffered.py's Linear subclasses) are hooked too, so one
run can compare the approximation with the exact norms on the same parameters. The backward side is a tensor hook on the layer's output (registered by the forward
hook), not register_full_backward_hook, which would wrap every output in an extra autograd node.
Under torch.compile the numbers are unchanged, but dynamo cannot trace the hooks' side effects
and runs the model's forward eagerly: use these hooks with compile=False.
"""
from collections import namedtuple

import torch
import torch.nn as nn

# extra float32 elements a backward hook may allocate at once; larger batches are chunked
CHUNK_ELEMENTS = 1 << 26

# (name, parameter, sum of per-example squared norms as the layer saw them [float32 0-dim
#  tensor], example count [int], SOGNS surrogate big-batch gradient [L-vector] or None where
#  the big batch is p.grad)
HookResult = namedtuple('HookResult', 'name param sqnorm_sum example_count surrogate_grad')


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


@torch.no_grad()
def exact_linear_sqnorms(x, dy, with_weight=True, with_bias=True):
    """
    Sums over the batch of the exact per-example squared gradient norms of a Linear
    (weight, bias), float32 0-dim tensors (None where not asked). x [B,...,K], dy [B,...,L].
    """
    x, dy = _as_batch_time_feature(x), _as_batch_time_feature(dy)
    B, T, K = x.shape
    L = dy.shape[-1]
    weight = torch.zeros((), dtype=torch.float32, device=dy.device) if with_weight else None
    bias = torch.zeros((), dtype=torch.float32, device=dy.device) if with_bias else None
    ghost = T * (K + L) <= K * L  # flops: ghost ~ B T^2 (K+L), materialised ~ B T K L
    per_example = T * T if ghost else K * L
    chunk = max(1, CHUNK_ELEMENTS // max(per_example + T * (K + L), 1))
    for i in range(0, B, chunk):
        xc, dyc = x[i:i + chunk].float(), dy[i:i + chunk].float()
        if with_weight:
            if T == 1:
                weight += (xc.square().sum((1, 2)) * dyc.square().sum((1, 2))).sum()
            elif ghost:
                weight += (torch.bmm(xc, xc.transpose(1, 2)) * torch.bmm(dyc, dyc.transpose(1, 2))).sum()
            else:
                weight += torch.bmm(dyc.transpose(1, 2), xc).square().sum()
        if with_bias:
            bias += dyc.sum(1).square().sum()
    return weight, bias


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
    (subclasses included, buffered.py's per-example-norm Linears too, for a like-for-like
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


def _kind_of(add_hooks_or_kind):
    kind = {add_exact_hooks: 'exact', add_sogns_hooks: 'sogns'}.get(add_hooks_or_kind, add_hooks_or_kind)
    if kind not in ('exact', 'sogns'):
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


def _world_size():
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


@torch.no_grad()
def hook_measurements(model, kind='exact', prefix=None, loss_scale=1.0):
    """
    The step's measurements in the tracker's CSV schema, as a dict of floats:
      {prefix}/{name}/norm        big-batch gradient norm |G_B|: ||p.grad|| (exact hooks, biases)
                                  or the SOGNS surrogate's ||sum_b W~_b|| (SOGNS weights)
      {prefix}/{name}/pegn        sqrt(|G_1|^2), |G_1|^2 = (1/B) sum_b ||g_b||^2 = B sum_b ||g_b/B||^2
      {prefix}/{name}/batch_size  B, the examples of the optimizer step over all processes
    prefix defaults to 'train/hooks_gns' (exact) or 'train/sogns'. Call after the last backward of
    the step and after scaler.unscale_ (p.grad unscaled), before clipping; loss_scale is the
    GradScaler scale of this step's backward (scaler.get_scale(), 1.0 without fp16). Under DDP
    call it on every rank (one all-reduce of the sums): with B_rank examples per rank and
    B = W B_rank, |G_1|^2 = (B_rank^2 / B) sum_ranks sum_b ||g_b/B_rank||^2. One host transfer.
    Layers that saw no example this step are left out.
    """
    kind = _kind_of(kind)
    prefix = prefix if prefix is not None else {'exact': 'train/hooks_gns', 'sogns': 'train/sogns'}[kind]
    results = gather_hook_results(model, kind)
    if not results:
        return {}
    device = results[0].param.device
    sqnorm_sums = torch.stack([r.sqnorm_sum.to(device) for r in results])
    counts = torch.tensor([float(r.example_count) for r in results], device=device)
    surrogates = [r.surrogate_grad.to(device) for r in results if r.surrogate_grad is not None]
    flat = torch.cat([sqnorm_sums, counts, *surrogates])
    world_size = _world_size()
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
            norms.append(torch.linalg.vector_norm(r.param.grad.float()))
        else:
            norms.append(torch.zeros((), dtype=torch.float32, device=device))
    values = torch.stack([torch.stack(norms).to(device), pe_sqnorm.sqrt(), total_counts]).tolist()
    out = {}
    for r, norm, pegn, count in zip(results, *values):
        if count > 0:
            out[f"{prefix}/{r.name}/norm"] = norm
            out[f"{prefix}/{r.name}/pegn"] = pegn
            out[f"{prefix}/{r.name}/batch_size"] = int(count)
    return out
