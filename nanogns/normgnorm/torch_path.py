"""
Pure-PyTorch LayerNorm and RMSNorm forward/backward with per-example dγ (and LayerNorm's dβ)
norms: the path used off GPU (CPU, mps), the one under torch.compile on every device, and the
reference the kernels are checked against. Statistics and gradients are computed in float32
whatever the input dtype (float64 stays float64).

Rows are the flattened leading dims of x: x2d [N, D] with N = num_examples * T, example b
owning rows b*T ... b*T + T - 1. LayerNorm's output and dx are torch's own native kernels,
RMSNorm's output too (its dx is written out below: torch has no CPU kernel for it); the
per-example reduction adds one [N, D] temporary (the kernels avoid it). RMSNorm is LayerNorm
without the centring and the bias: everywhere here `mean` None means RMSNorm.
"""
import threading

import torch


# On CPU the examples are taken a few at a time, so that the [chunk, T, D] temporary stays in
# cache (elements per chunk; 30% faster at a [64, 256, 384] input, the same at small ones).
CPU_CHUNK_NUMEL = 1 << 19


def per_example_affine_grads(dy3, x3, mean3, rstd3, need_dw, need_db, reuse_scratch=False):
    """
    The per-example gradients of a LayerNorm's gain and bias (Gray et al. 2024),
        dγ_b = Σ_t dy_bt ⊙ (x_bt - mean_bt) rstd_bt,    dβ_b = Σ_t dy_bt,
    as [B, D] tensors in float32 (float64 for float64 inputs), None where not needed, from
    dy3, x3 [B, T, D] and the row statistics mean3, rstd3 [B, T, 1]; mean3 None for RMSNorm's
    dγ_b = Σ_t dy_bt ⊙ x_bt rstd_bt (no centring). One centring pass, the product with dy in
    place, then the rstd-weighted sum over t as a batched matrix-vector product: fewer passes
    over [B, T, D] than forming x̂ first, and as precise (x is centred before the product, as
    torch's own backward does). Every call is paid per layer and micro-step, so nothing is
    sliced or cast that need not be. reuse_scratch: on CPU in eager mode, the temporary of a
    chunk of examples is the thread's scratch tensor, kept between calls: a fresh one costs more
    in page faults than the arithmetic on it (GPU allocators cache; traced, the compiler plans).
    """
    acc = torch.promote_types(dy3.dtype, torch.promote_types(x3.dtype, torch.float32))
    dw_b = db_b = None
    if need_dw:
        B, T, D = x3.shape
        cpu = x3.device.type == "cpu"
        chunk = min(B, max(1, CPU_CHUNK_NUMEL // max(1, T * D))) if cpu else B
        scratch = None
        # (not while autograd records, as a backward with create_graph=True does: out= is not differentiable)
        if reuse_scratch and cpu and not torch.is_grad_enabled() and not torch.compiler.is_compiling():
            scratch = _scratch((chunk, T, D), acc, x3.device)
        if chunk == B:
            dw_b = _dgamma_b(dy3, x3, mean3, rstd3, acc, scratch)
        else:
            dw_b = torch.cat([_dgamma_b(dy3[s:s + chunk], x3[s:s + chunk], None if mean3 is None else mean3[s:s + chunk],
                                        rstd3[s:s + chunk], acc, None if scratch is None else scratch[:min(chunk, B - s)])
                              for s in range(0, B, chunk)])
    if need_db:
        db_b = dy3.sum(1, dtype=acc)
    return dw_b, db_b


# The scratch tensor of each thread (autograd runs a device's backward on one thread): one at a
# time, of the last shape asked for, which the normalisation layers of a model mostly share.
_scratch_of_thread = threading.local()


def _scratch(shape, dtype, device):
    """An uninitialised tensor, the same one at every call with these arguments (until another
    is asked for); its contents are the caller's until the caller returns."""
    kept = getattr(_scratch_of_thread, "tensor", None)
    if kept is None or kept.shape != shape or kept.dtype != dtype or kept.device != device:
        kept = _scratch_of_thread.tensor = torch.empty(shape, dtype=dtype, device=device)
    return kept


def _dgamma_b(dy3, x3, mean3, rstd3, acc, scratch=None):
    x3 = x3 if x3.dtype == acc else x3.to(acc)
    # into the scratch, or (None) a fresh tensor: never in place on x3, which may be the layer's input itself
    centred_dy = torch.mul(x3, dy3, out=scratch) if mean3 is None else torch.sub(x3, mean3, out=scratch).mul_(dy3)
    rstd3 = rstd3 if rstd3.dtype == acc else rstd3.to(acc)
    return torch.bmm(rstd3.mT, centred_dy).view(x3.shape[0], x3.shape[2])


def add_squared_norms(buffers, per_example_grads):
    """buffer += Σ_b ||g_b||² for each float32 0-dim buffer and [B, D] per-example gradient, two
    calls for all of them (a LayerNorm's gain and bias): the squared norm of the whole tensor."""
    norms = torch._foreach_norm(per_example_grads)
    torch._foreach_addcmul_(buffers, norms, norms)


def rms_norm_eps(eps, dtype):
    """The eps of torch's rms_norm: eps, or if None the machine epsilon of the type it computes
    in (float32 for float16, bfloat16 and float32 inputs, float64 for float64)."""
    return torch.finfo(torch.promote_types(dtype, torch.float32)).eps if eps is None else eps


def forward(x, weight, bias, eps, rms=False):
    """
    LayerNorm y = (x - mean) * rstd * weight + bias, or with rms RMSNorm y = x * rstd * weight
    (no bias), over the last dimension of x [..., D]; returns y (x's dtype) and the float32 row
    statistics mean (None for RMSNorm) and rstd, shaped [..., 1] as torch's kernels give them.
    """
    dtype, D = x.dtype, x.shape[-1]
    if dtype in (torch.float16, torch.bfloat16):  # compute in float32, as the kernels do
        x, weight = x.float(), weight.float()
        bias = None if bias is None else bias.float()
    if rms:  # torch's own RMSNorm, which also gives its rstd
        y, rstd = torch.ops.aten._fused_rms_norm(x, (D,), weight, eps)
        return _as(y, dtype), None, _as(rstd, torch.float32)
    y, mean, rstd = torch.native_layer_norm(x, (D,), weight, bias, eps)
    return _as(y, dtype), _as(mean, torch.float32), _as(rstd, torch.float32)


def _as(t, dtype):
    return t if t.dtype == dtype else t.to(dtype)


def _computed(dy, x, weight, mean, rstd, num_examples):
    """The backward's operands in the type it computes in (float32 for half inputs): dy, x, weight
    as they are shaped, and [B, T, D] views of dy and x with [B, T, 1] ones of the row statistics
    (mean None: RMSNorm), which a [B, T, D] input already is."""
    xc, dyc, wc = x, dy, weight
    if x.dtype in (torch.float16, torch.bfloat16):
        xc, dyc, wc = x.float(), dy.float(), weight.float()
    stats = xc.shape[:-1] + (1,)
    rstd = _as(rstd if rstd.dim() == xc.dim() else rstd.view(stats), xc.dtype)
    if mean is not None:
        mean = _as(mean if mean.dim() == xc.dim() else mean.view(stats), xc.dtype)
    x3, dy3, rstd3, mean3 = xc, dyc, rstd, mean
    if xc.dim() != 3 or xc.shape[0] != num_examples:
        x3, dy3, rstd3 = (t.reshape(num_examples, -1, t.shape[-1]) for t in (xc, dyc, rstd))
        mean3 = None if mean is None else mean.reshape(num_examples, -1, 1)
    return dyc, xc, wc, mean, rstd, (dy3, x3, mean3, rstd3)


def _input_grad(dyc, xc, wc, mean, rstd):
    """dx of LayerNorm (mean None: RMSNorm) in the computing type, from the row statistics."""
    if mean is None:  # RMSNorm: dx = rstd (w⊙dy - x̂ mean(x̂ ⊙ w⊙dy)), LayerNorm's without the centring term
        xhat, wdy = xc * rstd, dyc * wc
        return (wdy - xhat * (xhat * wdy).mean(-1, keepdim=True)).mul_(rstd)
    D = xc.shape[-1]
    return torch.ops.aten.native_layer_norm_backward(dyc, xc, (D,), mean, rstd, wc, None, [True, False, False])[0]


def backward(dy, x, weight, mean, rstd, num_examples, need_dw, need_db, weight_sq, bias_sq, count):
    """
    dx, and the parameter gradients dw, db (None where not needed; mean None: RMSNorm, which
    has no db), for x, dy [..., D] of num_examples examples (the first dimension, or of x2d
    [N, D] the runs of N / num_examples rows) and the row statistics of forward, [N] or [..., 1].
    dw and db are the sums of the per-example dγ_b, dβ_b: torch's own reduction is not run. Adds
    to the float32 buffers: weight_sq += sum_b ||dγ_b||², bias_sq += sum_b ||dβ_b||², count += num_examples.
    """
    dyc, xc, wc, mean, rstd, rows = _computed(dy, x, weight, mean, rstd, num_examples)
    dw_b, db_b = per_example_affine_grads(*rows, need_dw, need_db, reuse_scratch=True)
    dx = _input_grad(dyc, xc, wc, mean, rstd)
    measured = [(sq, g) for sq, g in ((weight_sq, dw_b), (bias_sq, db_b)) if g is not None]
    if measured:
        add_squared_norms(*map(list, zip(*measured)))
    dw = _as(dw_b.sum(0), weight.dtype) if need_dw else None
    db = _as(db_b.sum(0), weight.dtype) if need_db else None
    count.add_(num_examples)
    return _as(dx, x.dtype), dw, db


# ---------------------------------------------------------------------------------------------
# The compiled route: the sums leave the backward as values, the gradient of a float32 "sink"
# vector laid out as SINK_SLOTS and then any per-coordinate sums, and are added to the buffers
# after it (nanogns.layers.norms). Written in elementwise ops and sums, which the compiler fuses with the
# model's own kernels: no batched matmul, no scratch, no buffer written.

SINK_SLOTS = ("weight_sqgradnorm", "bias_sqgradnorm", "example_count")


def per_example_sums(dy3, x3, mean3, rstd3, need_dw, need_db, coords=(False, False)):
    """
    The sink's gradient from dy3, x3 [B, T, D] and the row statistics mean3 (None: RMSNorm),
    rstd3 [B, T, 1]: float32 [Σ_b ||dγ_b||², Σ_b ||dβ_b||², B], with dγ_b = Σ_t dy_bt ⊙ x̂_bt and
    dβ_b = Σ_t dy_bt (0 where not needed), followed by the per-coordinate sums Σ_b dγ_b², Σ_b dβ_b²
    where coords (weight, bias) asks for them. Compiled, one kernel reduces over each example's
    tokens and one gives the three sums.
    """
    acc = torch.promote_types(dy3.dtype, torch.promote_types(x3.dtype, torch.float32))
    B, D = x3.shape[0], x3.shape[-1]
    dy3 = _as(dy3, acc)
    dw_sq = db_sq = x3.new_zeros((B, D), dtype=acc)  # [B, D]: dγ_b², dβ_b²
    if need_dw:
        x3 = _as(x3, acc)
        dw_sq = (dy3 * ((x3 if mean3 is None else x3 - mean3) * _as(rstd3, acc))).sum(1).square()
    if need_db:
        db_sq = dy3.sum(1).square()
    # slot k of a [3, B, D] tensor: dγ_b², dβ_b², and one per example (in its first column), whose
    # sums over (b, d) are the sink's three: elementwise selects that the compiler fuses into one reduction
    slot = torch.arange(3, device=x3.device).view(3, 1, 1)
    first_column = torch.arange(D, device=x3.device) == 0
    parts = torch.where(slot == 0, dw_sq, torch.where(slot == 1, db_sq, first_column.to(acc)))
    sink_grad = parts.sum((1, 2)).float()
    tail = [squares.sum(0).float() for squares, wanted in zip((dw_sq, db_sq), coords) if wanted]
    return torch.cat([sink_grad, *tail]) if tail else sink_grad


def sink_backward(dy, x, weight, mean, rstd, num_examples, need_dw, need_db):
    """
    backward's dx, dw, db (None where not needed), without the buffers: the sums it adds to them
    come back as the sink's gradient (per_example_sums), the last of the four results. LayerNorm's
    dx, dw, db are torch's own backward, which the compiler fuses as it does nn.LayerNorm's;
    RMSNorm's are written out (torch's _fused_rms_norm_backward has no CPU kernel).
    """
    dyc, xc, wc, mean, rstd, rows = _computed(dy, x, weight, mean, rstd, num_examples)
    D = xc.shape[-1]
    if mean is None:
        dx, db = _input_grad(dyc, xc, wc, None, rstd), None
        dw = (dyc * (xc * rstd)).reshape(-1, D).sum(0) if need_dw else None
    else:
        # (a bias tensor, only there to be asked for db: its values are not read)
        dx, dw, db = torch.ops.aten.native_layer_norm_backward(dyc, xc, (D,), mean, rstd, wc,
                                                               torch.zeros_like(wc) if need_db else None,
                                                               [True, need_dw, need_db])
    sink_grad = per_example_sums(*rows, need_dw, need_db)
    dw = _as(dw, weight.dtype) if need_dw else None
    db = _as(db, weight.dtype) if need_db else None
    return _as(dx, x.dtype), dw, db, sink_grad
