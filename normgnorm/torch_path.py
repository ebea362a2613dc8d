"""
Pure-PyTorch LayerNorm and RMSNorm forward/backward with per-example dγ (and LayerNorm's dβ)
norms: the path used off GPU (CPU, mps) and the reference the kernels are checked against.
Statistics and gradients are computed in float32 whatever the input dtype (float64 stays float64).

Rows are the flattened leading dims of x: x2d [N, D] with N = num_examples * T, example b
owning rows b*T ... b*T + T - 1. LayerNorm's output and dx are torch's own native kernels,
RMSNorm's output too (its dx is written out below: torch has no CPU kernel for it); the
per-example reduction adds one [N, D] temporary (the kernels avoid it). RMSNorm is LayerNorm
without the centring and the bias: everywhere here `mean` None means RMSNorm.
"""
import torch


# On CPU the examples are taken a few at a time, so that the [chunk, T, D] temporary stays in
# cache (elements per chunk; 30% faster at a [64, 256, 384] input, the same at small ones).
CPU_CHUNK_NUMEL = 1 << 19


def per_example_affine_grads(dy3, x3, mean3, rstd3, need_dw, need_db):
    """
    The per-example gradients of a LayerNorm's gain and bias (Gray et al. 2024),
        dγ_b = Σ_t dy_bt ⊙ (x_bt - mean_bt) rstd_bt,    dβ_b = Σ_t dy_bt,
    as [B, D] tensors in float32 (float64 for float64 inputs), None where not needed, from
    dy3, x3 [B, T, D] and the row statistics mean3, rstd3 [B, T, 1]; mean3 None for RMSNorm's
    dγ_b = Σ_t dy_bt ⊙ x_bt rstd_bt (no centring). One centring pass, the product with dy in
    place, then the rstd-weighted sum over t as a batched matrix-vector product: fewer passes
    over [B, T, D] than forming x̂ first, and as precise (x is centred before the product, as
    torch's own backward does).
    """
    acc = torch.promote_types(dy3.dtype, torch.promote_types(x3.dtype, torch.float32))
    dw_b = db_b = None
    if need_dw:
        B, T, D = x3.shape
        chunk = max(1, CPU_CHUNK_NUMEL // max(1, T * D)) if x3.device.type == "cpu" else B
        parts = []
        for s in range(0, B, chunk):
            xs, dys = x3[s:s + chunk].to(acc), dy3[s:s + chunk]
            # RMSNorm: out of place, as .to() may have returned x itself
            centred_dy = xs * dys if mean3 is None else (xs - mean3[s:s + chunk].to(acc)).mul_(dys)
            parts.append(torch.bmm(rstd3[s:s + chunk].to(acc).mT, centred_dy).squeeze(1))
        dw_b = torch.cat(parts) if len(parts) > 1 else parts[0]
    if need_db:
        db_b = dy3.sum(1, dtype=acc)
    return dw_b, db_b


def rms_norm_eps(eps, dtype):
    """The eps of torch's rms_norm: eps, or if None the machine epsilon of the type it computes
    in (float32 for float16, bfloat16 and float32 inputs, float64 for float64)."""
    return torch.finfo(torch.promote_types(dtype, torch.float32)).eps if eps is None else eps


def forward(x2d, weight, bias, eps, rms=False):
    """
    LayerNorm y = (x - mean) * rstd * weight + bias, or with rms RMSNorm y = x * rstd * weight
    (no bias); returns y (x's dtype), float32 mean [N] (None for RMSNorm) and rstd [N].
    """
    dtype, D = x2d.dtype, x2d.shape[1]
    if dtype in (torch.float16, torch.bfloat16):  # compute in float32, as the kernels do
        x2d, weight = x2d.float(), weight.float()
        bias = None if bias is None else bias.float()
    if rms:  # torch's own RMSNorm, which also gives its rstd
        y, rstd = torch.ops.aten._fused_rms_norm(x2d, (D,), weight, eps)
        return y.to(dtype), None, rstd.view(-1).float()
    y, mean, rstd = torch.native_layer_norm(x2d, (D,), weight, bias, eps)
    return y.to(dtype), mean.view(-1).float(), rstd.view(-1).float()


def backward(dy2d, x2d, weight, mean, rstd, num_examples, need_dw, need_db, weight_sq, bias_sq, count):
    """
    dx, and the parameter gradients dw, db (None where not needed; mean None: RMSNorm, which
    has no db). Adds to the float32 buffers: weight_sq += sum_b ||dγ_b||², bias_sq +=
    sum_b ||dβ_b||², count += num_examples.
    """
    N, D = x2d.shape
    xc, dyc, wc = x2d, dy2d, weight
    if x2d.dtype in (torch.float16, torch.bfloat16):
        xc, dyc, wc = x2d.float(), dy2d.float(), weight.float()
    rstd2 = rstd.view(N, 1).to(xc.dtype)
    if mean is None:  # RMSNorm: dx = rstd (w⊙dy - x̂ mean(x̂ ⊙ w⊙dy)), LayerNorm's without the centring term
        xhat, wdy = xc * rstd2, dyc * wc
        dx = (wdy - xhat * (xhat * wdy).mean(1, keepdim=True)).mul_(rstd2)
        mean3 = None
    else:
        mean2 = mean.view(N, 1).to(xc.dtype)
        dx = torch.ops.aten.native_layer_norm_backward(dyc, xc, (D,), mean2, rstd2, wc, None,
                                                       [True, False, False])[0]
        mean3 = mean2.view(num_examples, -1, 1)
    dw_b, db_b = per_example_affine_grads(dyc.view(num_examples, -1, D), xc.view(num_examples, -1, D),
                                          mean3, rstd2.view(num_examples, -1, 1), need_dw, need_db)
    dw = db = None
    if need_dw:
        weight_sq.add_(dw_b.square().sum())
        dw = dw_b.sum(0).to(weight.dtype)
    if need_db:
        bias_sq.add_(db_b.square().sum())
        db = db_b.sum(0).to(weight.dtype)
    count.add_(num_examples)
    return dx.to(x2d.dtype), dw, db
