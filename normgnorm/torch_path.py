"""
Pure-PyTorch LayerNorm forward/backward with per-example dγ, dβ norms: the path used off
GPU (CPU, mps) and the reference the kernels are checked against. Statistics and gradients
are computed in float32 whatever the input dtype (float64 stays float64).

Rows are the flattened leading dims of x: x2d [N, D] with N = num_examples * T, example b
owning rows b*T ... b*T + T - 1. Output and dx are torch's own native LayerNorm kernels; the
per-example reduction adds one [N, D] temporary (the kernels avoid it).
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
    dy3, x3 [B, T, D] and the row statistics mean3, rstd3 [B, T, 1]. One centring pass, the
    product with dy in place, then the rstd-weighted sum over t as a batched matrix-vector
    product: fewer passes over [B, T, D] than forming x̂ first, and as precise (x is centred
    before the product, as torch's own backward does).
    """
    acc = torch.promote_types(dy3.dtype, torch.promote_types(x3.dtype, torch.float32))
    dw_b = db_b = None
    if need_dw:
        B, T, D = x3.shape
        chunk = max(1, CPU_CHUNK_NUMEL // max(1, T * D)) if x3.device.type == "cpu" else B
        parts = []
        for s in range(0, B, chunk):
            centred_dy = (x3[s:s + chunk].to(acc) - mean3[s:s + chunk].to(acc)).mul_(dy3[s:s + chunk])
            parts.append(torch.bmm(rstd3[s:s + chunk].to(acc).mT, centred_dy).squeeze(1))
        dw_b = torch.cat(parts) if len(parts) > 1 else parts[0]
    if need_db:
        db_b = dy3.sum(1, dtype=acc)
    return dw_b, db_b


def forward(x2d, weight, bias, eps):
    """y = (x - mean) * rstd * weight + bias; returns y (x's dtype) and float32 mean, rstd [N]."""
    dtype = x2d.dtype
    if dtype in (torch.float16, torch.bfloat16):  # compute in float32, as the kernels do
        x2d, weight = x2d.float(), weight.float()
        bias = None if bias is None else bias.float()
    y, mean, rstd = torch.native_layer_norm(x2d, (x2d.shape[1],), weight, bias, eps)
    return y.to(dtype), mean.view(-1).float(), rstd.view(-1).float()


def backward(dy2d, x2d, weight, mean, rstd, num_examples, need_dw, need_db, weight_sq, bias_sq, count):
    """
    dx, and the parameter gradients dw, db (None where not needed). Adds to the float32 buffers:
    weight_sq += sum_b ||dγ_b||², bias_sq += sum_b ||dβ_b||², count += num_examples.
    """
    N, D = x2d.shape
    xc, dyc, wc = x2d, dy2d, weight
    if x2d.dtype in (torch.float16, torch.bfloat16):
        xc, dyc, wc = x2d.float(), dy2d.float(), weight.float()
    mean2, rstd2 = mean.view(N, 1).to(xc.dtype), rstd.view(N, 1).to(xc.dtype)
    dx = torch.ops.aten.native_layer_norm_backward(dyc, xc, (D,), mean2, rstd2, wc, None,
                                                   [True, False, False])[0]
    dw_b, db_b = per_example_affine_grads(dyc.view(num_examples, -1, D), xc.view(num_examples, -1, D),
                                          mean2.view(num_examples, -1, 1), rstd2.view(num_examples, -1, 1),
                                          need_dw, need_db)
    dw = db = None
    if need_dw:
        weight_sq.add_(dw_b.square().sum())
        dw = dw_b.sum(0).to(weight.dtype)
    if need_db:
        bias_sq.add_(db_b.square().sum())
        db = db_b.sum(0).to(weight.dtype)
    count.add_(num_examples)
    return dx.to(x2d.dtype), dw, db
