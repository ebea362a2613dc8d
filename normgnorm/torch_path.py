"""
Pure-PyTorch LayerNorm forward/backward with per-example dγ, dβ norms: the path used off
GPU (CPU, mps) and the reference the kernels are checked against. Everything is computed in
float32 whatever the input dtype.

Rows are the flattened leading dims of x: x2d [N, D] with N = num_examples * T, example b
owning rows b*T ... b*T + T - 1. The backward materialises float32 [N, D] temporaries (it is
the simple path; the kernels avoid them).
"""
import torch


def forward(x2d, weight, bias, eps):
    """y = (x - mean) * rstd * weight + bias; returns y (x's dtype) and float32 mean, rstd [N]."""
    xf = x2d.float()
    var, mean = torch.var_mean(xf, dim=1, unbiased=False)
    rstd = torch.rsqrt(var + eps)
    y = (xf - mean[:, None]) * rstd[:, None] * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x2d.dtype), mean, rstd


def backward(dy2d, x2d, weight, mean, rstd, num_examples, need_dw, need_db, weight_sq, bias_sq, count):
    """
    dx, and the parameter gradients dw, db (None where not needed). Adds to the float32 buffers:
    weight_sq += sum_b ||dγ_b||², bias_sq += sum_b ||dβ_b||², count += num_examples, with
    dγ_b = sum_t dy_bt * x̂_bt and dβ_b = sum_t dy_bt (DESIGN.md §2, LayerNorm).
    """
    D = x2d.shape[1]
    xhat = (x2d.float() - mean[:, None]) * rstd[:, None]
    dyf = dy2d.float()
    wdy = dyf * weight.float()
    # d/dx of (x - mean) * rstd, applied to wdy (the usual LayerNorm input gradient)
    dx = (wdy - wdy.mean(1, keepdim=True) - xhat * (wdy * xhat).mean(1, keepdim=True)) * rstd[:, None]
    dw = db = None
    if need_dw:
        dw_per_example = (dyf * xhat).view(num_examples, -1, D).sum(1)
        weight_sq.add_(dw_per_example.square().sum())
        dw = dw_per_example.sum(0).to(weight.dtype)
    if need_db:
        db_per_example = dyf.view(num_examples, -1, D).sum(1)
        bias_sq.add_(db_per_example.square().sum())
        db = db_per_example.sum(0).to(weight.dtype)
    count.add_(num_examples)
    return dx.to(x2d.dtype), dw, db
