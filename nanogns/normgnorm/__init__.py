"""
normgnorm: a LayerNorm (and an RMSNorm) whose backward pass also yields the per-example squared
gradient norms of its gain and bias, at almost no extra cost. Gray et al. 2024 ("Normalization
Layer Per-Example Gradients are Sufficient to Predict Gradient Noise Scale in Transformers") show
these norms alone predict the whole model's gradient noise scale.

For x [B, T, D] (any leading shape: the first dim counts examples, the rest are tokens; a 2-D
x [N, D] is N examples of one token), with x̂ = (x - mean) * rstd and y = γ ⊙ x̂ + β:

    dγ_b = Σ_t dy_bt ⊙ x̂_bt,    dβ_b = Σ_t dy_bt,
    weight_sqgradnorm += Σ_b ||dγ_b||²,   bias_sqgradnorm += Σ_b ||dβ_b||²,   example_count += B

accumulated in float32 whatever the input dtype. The gradient the layer sees is that of the
mean loss, so these are Σ_b ||g_b / B||² as nanogns.layers defines them.

RMSNorm (x̂ = x * rstd, rstd = 1 / sqrt(mean(x²) + eps), y = γ ⊙ x̂, no β) is the same without the
centring (Zhang & Sennrich 2019): its dγ_b has the same form, and every implementation runs it through
the LayerNorm code with the mean left out (`rms=True` in forward, `mean` None in backward).

Two functions, `layer_norm` and `rms_norm`, and one autograd Function behind both and behind every
measured normalisation (_NormFn, which the measured layers call directly: the fused ones to
normalise and measure, the separated ones to measure beside torch's own normalisation; the
reference implementation's `PEGLayerNorm`, with its seven arguments, is an adapter onto it, at the
end). The fused way has four implementations in eager mode:
- "triton": Triton kernels (normgnorm/triton_kernels.py), the default on CUDA;
- "cuda": a CUDA C++ extension (normgnorm/csrc/), JIT-built on first use;
- "cpu": torch's forward and a backward in one native pass (normgnorm/cpu_ext.py, C built on
  first use), the default on CPU; what it does not take runs the PyTorch path;
- "torch": pure PyTorch (normgnorm/torch_path.py): elsewhere (mps).
Choose with the `backend` argument. Under torch.compile there is one route on every device,
whatever the backend: the PyTorch path, traced like any PyTorch code, so that the compiler sees
every op and fuses the per-example sums with the model's own kernels. The measured layers then
hand the Function a "sink" (a float32 leaf vector): its backward returns the sums as the sink's
gradient instead of writing them into the buffers, and the layer adds them to its buffers once
autograd has accumulated them (nanogns.layers.norms), so nothing is written inside the compiled backward.
"""
import contextlib
import functools
import math
import os
import sys
from typing import Optional

import torch
from torch import Tensor

from nanogns.refusals import module_refusals

from . import cpu_ext, torch_path
from .torch_path import rms_norm_eps

BACKENDS = ("triton", "cuda", "cpu", "torch")


@functools.cache
def _triton_importable():
    try:
        import triton  # noqa: F401
        return True
    except ImportError:
        return False


def resolve_backend(requested, x):
    """
    The implementation that runs for input x; `requested` is the backend asked for ("" for
    automatic). Under torch.compile the torch path, on every device and whatever was asked for:
    the compiler sees its ops and fuses them with the model's. In eager mode on a GPU the Triton
    kernels (or the CUDA C++ ones, asked for); off GPU the CPU kernel on CPU tensors unless "torch"
    is asked for, the torch path elsewhere (mps); never Triton, which would fail to find a driver,
    except "triton" under Triton's own TRITON_INTERPRET=1, which runs the kernels on CPU tensors.
    """
    if requested not in ("",) + BACKENDS:
        raise ValueError(f"unknown normgnorm backend {requested!r}; choose from {BACKENDS}")
    if torch.compiler.is_compiling():
        return "torch"
    if not x.is_cuda:
        if requested == "triton" and os.environ.get("TRITON_INTERPRET") == "1":
            return "triton"
        return "cpu" if x.device.type == "cpu" and requested != "torch" else "torch"
    if requested in ("", "cpu"):  # "cpu" names the CPU's kernel, not a GPU's
        return "triton" if _triton_importable() else "torch"
    return requested


@functools.cache  # (an import statement per call costs more than the lookup)
def _implementation(backend):
    if backend == "triton":
        from . import triton_kernels
        return triton_kernels
    if backend == "cuda":
        from . import cuda_ext
        return cuda_ext
    if backend == "cpu":
        return cpu_ext
    return torch_path


def _examples_and_rows(x):
    """(number of examples B, number of rows N) of x: first dim = examples, last = features."""
    num_examples = x.shape[0] if x.dim() >= 2 else 1
    return num_examples, x.numel() // x.shape[-1]


def _forward(x, weight, bias, eps, backend, rms=False):
    """y, mean (None for RMSNorm), rstd from the implementation `backend` names (resolve_backend's):
    the kernels see x as rows [N, D] and give [N] statistics; torch's, which take any shape, [..., 1]."""
    if backend in ("torch", "cpu"):  # the paths off GPU, paid per layer and micro-step: no reshapes they do not need
        return torch_path.forward(x, weight, bias, eps, rms=rms)
    if backend == "triton":  # takes x of any shape as its rows, y of x's shape: no reshape or view paid per call
        return _implementation(backend).forward(x.contiguous(), weight.contiguous(),
                                                None if bias is None else bias.contiguous(), eps, rms=rms)
    D = x.shape[-1]
    y2d, mean, rstd = _implementation(backend).forward(x.reshape(-1, D).contiguous(), weight.contiguous(),
                                                       None if bias is None else bias.contiguous(), eps, rms=rms)
    return y2d.view(x.shape), mean, rstd


def _backward_impl(dy, x, weight, mean, rstd, need_dw, need_db, weight_sqgradnorm, bias_sqgradnorm,
                   example_count, backend):
    """dx, dw, db (None where not needed), adding the per-example norms to the buffers; mean None: RMSNorm.
    `backend` is resolve_backend's, as forward ran it."""
    D = x.shape[-1]
    num_examples, N = _examples_and_rows(x)
    if N == 0:
        example_count.add_(num_examples)
        return torch.zeros_like(x), weight.new_zeros(D) if need_dw else None, weight.new_zeros(D) if need_db else None
    if backend in ("torch", "cpu"):  # (not through the cached _implementation, which tracing would warn of)
        return (cpu_ext if backend == "cpu" else torch_path).backward(dy, x, weight, mean, rstd, num_examples, need_dw,
                                                                      need_db, weight_sqgradnorm, bias_sqgradnorm,
                                                                      example_count)
    if backend == "triton":  # (as in _forward)
        return _implementation(backend).backward(dy.contiguous(), x.contiguous(), weight.contiguous(), mean, rstd,
                                                 num_examples, need_dw, need_db, weight_sqgradnorm, bias_sqgradnorm,
                                                 example_count)
    dx2d, dw, db = _implementation(backend).backward(dy.reshape(-1, D).contiguous(), x.reshape(-1, D).contiguous(),
                                                     weight.contiguous(), mean, rstd, num_examples, need_dw, need_db,
                                                     weight_sqgradnorm, bias_sqgradnorm, example_count)
    return dx2d.view(x.shape), dw, db


def _buffer_layout(name, buffer, pair_allowed=True):
    """True for the reference's [sum, count] pair, False for this fork's 0-dim running sum or None;
    anything else is an error (it would be broadcast-added into silently)."""
    if buffer is None:
        return False
    if buffer.dtype == torch.float32 and buffer.shape == ():
        return False
    if pair_allowed and buffer.dtype == torch.float32 and buffer.shape == (2,):
        return True
    layouts = "a float32 0-dim tensor" + (" or the reference's float32 [sum, count] pair" if pair_allowed else "")
    raise ValueError(f"{name} must be {layouts}, not {buffer.dtype} of shape {tuple(buffer.shape)}")


# Each device type as autocast's dispatch key names it
AUTOCAST_KEYS = {"cpu": "CPU", "cuda": "CUDA", "xpu": "XPU", "mps": "MPS", "hpu": "HPU", "mtia": "MTIA",
                 "maia": "MAIA", "xla": "XLA", "ipu": "IPU", "privateuseone": "PrivateUse1"}


def _torch_autocast_runs_in_float32(op, device_type):
    """Whether torch's autocast on device_type runs aten::op in float32 with a float32 output: where
    it has an autocast kernel for the op (layer_norm and rms_norm are only ever on autocast's float32
    list). torch 2.13: layer_norm on CUDA, XPU and MPS, rms_norm on CUDA and XPU, neither on the CPU;
    torch 2.11's CUDA autocast left rms_norm alone."""
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op}", "Autocast" + AUTOCAST_KEYS[device_type])
    except (AttributeError, RuntimeError):  # a torch without this check: its CUDA policy for both
        return device_type != "cpu"


# (device type, rms) -> whether torch's autocast there runs the normalisation in float32: read once,
# a dict lookup per call (traced as a constant under torch.compile)
AUTOCAST_FLOAT32 = {(device_type, rms): _torch_autocast_runs_in_float32("rms_norm" if rms else "layer_norm",
                                                                        device_type)
                    for device_type in AUTOCAST_KEYS for rms in (False, True)}


def autocast_runs_in_float32(device_type, rms):
    """Whether torch's autocast on device_type runs its layer_norm (rms: rms_norm) in float32; ours does
    the same (False for a device type without autocast)."""
    return AUTOCAST_FLOAT32.get((device_type, rms), False)


def _float32_under_autocast(x, weight, bias, rms):
    """
    Under autocast torch's layer_norm and rms_norm run in float32 with a float32 output on some
    devices and leave the input's dtype on others (autocast_runs_in_float32). Returns x, weight,
    bias with their half-precision ones cast up where torch's op would be, and the device type
    whose autocast is on (None if none is). The Function does this itself rather than through
    torch.amp.custom_fwd/custom_bwd, whose autocast contexts on every call cost more host time
    than the kernels take on the GPU.
    """
    if not torch._C._is_any_autocast_enabled():  # the common case, and the cheapest check
        return x, weight, bias, None
    device_type = x.device.type
    if device_type not in AUTOCAST_KEYS or not torch.is_autocast_enabled(device_type):
        return x, weight, bias, None
    if not AUTOCAST_FLOAT32[device_type, rms]:
        return x, weight, bias, device_type
    half = (torch.float16, torch.bfloat16)
    return (x.float() if x.dtype in half else x, weight.float() if weight.dtype in half else weight,
            bias.float() if bias is not None and bias.dtype in half else bias, device_type)


def _autocast_off(ctx):
    """No autocast inside the PyTorch path, whose ops autocast would otherwise run in half
    precision; the kernels run no op that autocast touches."""
    if ctx.autocast and ctx.backend == "torch":
        return torch.autocast(ctx.autocast, enabled=False)
    return contextlib.nullcontext()


def _refuse_sharded(x, weight, rms):
    """A DTensor (a module that torch.distributed.tensor's parallelize_module shards: sequence or
    tensor parallelism) handed to the fused way (layer_norm, rms_norm, PEGLayerNorm) is refused in
    one line: each rank holds part of every example's rows, and the kernels read a tensor's local
    memory, which a DTensor does not hand them. The measured layers hand the Function local tensors. Only a process that
    made DTensors has the module loaded, so the check costs a dict read elsewhere."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    if dtensor is not None and (isinstance(x, dtensor) or isinstance(weight, dtensor)):
        raise TypeError(f"a measured {'RMSNorm' if rms else 'LayerNorm'} was handed a DTensor (a module sharded by "
                        "torch.distributed.tensor, e.g. SequenceParallel), which the fused kernels do not take: "
                        "use the measured layer classes (measure(model)), which normalise a DTensor with torch's "
                        "own and measure it from its local tensors")


class _NormFn(torch.autograd.Function):
    """
    The one autograd Function of both normalisations (rms: RMSNorm, bias and its buffer None), in
    both of the measured layers' ways, eager and compiled: layer_norm, rms_norm, the measured layers
    and the reference's PEGLayerNorm all run it.

    Fused (torch_output None): it normalises x itself, through the implementation `backend` names
    (resolve_backend), and its backward computes dx, dγ, dβ and the per-example norms together.
    Under autocast it runs in float32 with a float32 output where torch's own op does
    (autocast_runs_in_float32). Only parameters that receive a gradient are measured.

    Separated (torch_output given: the separated layers): torch has normalised x with its own
    autograd, so output and gradients are torch's, bit for bit. The Function is the identity on
    torch_output; its backward hands dy on and adds the per-example part alone, from dy, x (as torch
    took it, detached) and the row statistics: `stats`, the (mean, rstd) of torch's native_layer_norm,
    or for RMSNorm (stats None) rstd recomputed as torch's rms_norm computes it. The parameters whose
    buffer is given are measured; `coords` (the weight's, the bias's) are per-coordinate sums
    Σ_b dγ_b², Σ_b dβ_b² added beside the buffers (register_coordinate_buffers). `weight` (detached)
    gives the normalised shape, which may be more than the last dimension.

    sink None: the backward adds the per-example sums to the buffers. A sink, a float32 leaf
    vector that requires grad (the measured layers pass theirs under torch.compile): the backward
    runs the torch path and returns the sums as the sink's gradient, [Σ_b ||dγ_b||², Σ_b ||dβ_b||², B]
    (torch_path.SINK_SLOTS) and then any per-coordinate sums, writing nothing.

    pairs (PEGLayerNorm's): the reference's [sum, count] buffers of the weight and the bias (either
    None); after the backward each gets [what its 0-dim buffer was given, B] added.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, weight_sqgradnorm, bias_sqgradnorm, example_count, sink, eps, backend, rms,
                torch_output=None, stats=None, coords=None, pairs=None, group=None):
        if not torch.compiler.is_compiling():
            _refuse_sharded(x, weight, rms)
        ctx.bufs = (weight_sqgradnorm, bias_sqgradnorm, example_count)
        ctx.sink, ctx.pairs, ctx.separated = sink is not None, pairs, torch_output is not None
        if ctx.separated:
            ctx.save_for_backward(x, *(stats or (None, None)))
            ctx.shape, ctx.eps, ctx.coords = weight.shape, eps, coords or (None, None)
            # sequence parallelism (nanogns/layers/norms.py): x and the statistics are local, torch_output a
            # DTensor whose gradient is measured on its local tensor; group (process group, scale): the
            # per-example vectors summed over it and scaled, before squaring (sequence or context parallelism)
            ctx.group = group
            ctx.dy_placements = getattr(torch_output, "placements", None) if getattr(
                torch_output, "device_mesh", None) is not None else None
            return torch_output.view_as(torch_output)
        # once: the backward runs what the forward ran; under torch.compile, and wherever a sink is
        # given, the torch path, traced with the model's ops
        backend = "torch" if sink is not None else resolve_backend(backend, x)
        x, weight, bias, ctx.autocast = _float32_under_autocast(x, weight, bias, rms)
        ctx.backend, ctx.has_bias = backend, bias is not None
        with _autocast_off(ctx):
            y, mean, rstd = _forward(x, weight, bias, eps, backend, rms)
        ctx.save_for_backward(x, weight, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        if ctx.separated:
            return (None, None, None, None, None, None, _separated_sums(ctx, dy), None, None, None, dy, None, None, None,
                    None)
        x, weight, mean, rstd = ctx.saved_tensors
        need_dw, need_db = ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2]
        with _autocast_off(ctx):
            if ctx.sink:
                dx, dw, db, sink_grad = _sink_backward(dy, x, weight, mean, rstd, need_dw, need_db)
            else:
                dx, dw, db = _backward_impl(dy, x, weight, mean, rstd, need_dw, need_db, *ctx.bufs, ctx.backend)
                sink_grad = None
        if ctx.pairs is not None:  # the reference's layout, beside ours
            num_examples = _examples_and_rows(x)[0]
            for pair, sq, grad in zip(ctx.pairs, ctx.bufs, (dw, db)):
                if pair is not None and grad is not None:
                    pair.add_(torch.stack([sq, torch.full_like(sq, num_examples)]))
        return dx, dw, db, None, None, None, sink_grad, None, None, None, None, None, None, None, None


def _sink_backward(dy, x, weight, mean, rstd, need_dw, need_db):
    """The fused backward's dx, dγ, dβ (None where not needed) and the sums as the sink's gradient."""
    num_examples, N = _examples_and_rows(x)
    if N == 0:
        sink_grad = torch.zeros(3, dtype=torch.float32, device=x.device)
        sink_grad[2] = num_examples
        return (torch.zeros_like(x), weight.new_zeros(weight.shape) if need_dw else None,
                weight.new_zeros(weight.shape) if need_db else None, sink_grad)
    return torch_path.sink_backward(dy, x, weight, mean, rstd, num_examples, need_dw, need_db)


def _separated_sums(ctx, dy):
    """The separated backward: the per-example sums of dγ_b, dβ_b from dy and what the forward kept,
    added to the buffers (and the per-coordinate ones), or, given a sink, returned as its gradient."""
    x, mean, rstd = ctx.saved_tensors
    weight_sq, bias_sq, count = ctx.bufs
    if ctx.dy_placements is not None:  # a DTensor (sequence parallelism): its local tensor, laid out as the output
        if tuple(dy.placements) != tuple(ctx.dy_placements):
            dy = dy.redistribute(placements=ctx.dy_placements)
        dy = dy.to_local()
    N = math.prod(ctx.shape)
    B = x.shape[0] if x.dim() > len(ctx.shape) else 1  # an input of the normalised shape alone: one example
    x3, dy3 = x.reshape(B, -1, N), dy.reshape(B, -1, N)
    if rstd is None:  # RMSNorm: rstd recomputed from x in float32 (float64 for float64), as torch computes it
        acc = torch.promote_types(x.dtype, torch.float32)
        mean_square = torch.linalg.vector_norm(x3, dim=-1, keepdim=True, dtype=acc).square_().div_(N)
        mean3, rstd3 = None, mean_square.add_(rms_norm_eps(ctx.eps, x.dtype)).rsqrt_()
    else:
        mean3, rstd3 = mean.reshape(B, -1, 1), rstd.reshape(B, -1, 1)
    need_dw, need_db = weight_sq is not None, bias_sq is not None
    if ctx.group is not None:  # tokens split over the group: each rank's dγ_b, dβ_b summed before squaring
        return _split_token_sums(ctx, dy3, x3, mean3, rstd3, need_dw, need_db, B)
    if ctx.sink:  # the sums as values, in ops the compiler fuses with torch's backward
        return torch_path.per_example_sums(dy3, x3, mean3, rstd3, need_dw, need_db,
                                           tuple(c is not None for c in ctx.coords))
    # the per-example dγ_b, dβ_b and their squared norms (on CPU in one native pass over x and dy)
    dw_b, db_b = cpu_ext.per_example_grads(dy3, x3, mean3, rstd3, need_dw, need_db, weight_sq, bias_sq)
    for grads_b, coords in zip((dw_b, db_b), ctx.coords):
        if grads_b is not None and coords is not None:
            coords.add_(grads_b.square().sum(0))
    count.add_(B)
    return None


def _split_token_sums(ctx, dy3, x3, mean3, rstd3, need_dw, need_db, B):
    """_separated_sums where each rank of ctx.group holds some of every example's tokens (sequence or
    context parallelism): the rank's per-example dγ_b, dβ_b [B, D] are partial sums over its tokens, so they
    are summed over the group (one all_reduce of them laid end to end) before they are squared, and
    every rank then adds the same whole sums (counted once over the group: nanogns/layers/sharded.py).
    Eager only: the sink (torch.compile) is refused."""
    if ctx.sink:
        raise RuntimeError("a normalisation whose tokens are split over ranks (sequence or context parallelism) is "
                           "measured in eager mode only (its backward sums per-example vectors over the group); "
                           "leave the model uncompiled")
    weight_sq, bias_sq, count = ctx.bufs
    group, scale = ctx.group  # the vectors' sum is scaled: averaged for OLMo-core's context-parallel loss
    dw_b, db_b = torch_path.per_example_affine_grads(dy3, x3, mean3, rstd3, need_dw, need_db)
    parts = [g for g in (dw_b, db_b) if g is not None]
    if parts:
        flat = torch.cat([g.reshape(-1) for g in parts])
        torch.distributed.all_reduce(flat, group=group)
        if scale != 1.0:
            flat.mul_(scale)
        parts = list(flat.view(len(parts), *parts[0].shape).unbind())
    summed = iter(parts)
    dw_b, db_b = (next(summed) if g is not None else None for g in (dw_b, db_b))
    measured = [(sq, g) for sq, g in ((weight_sq, dw_b), (bias_sq, db_b)) if g is not None]
    if measured:
        torch_path.add_squared_norms(*map(list, zip(*measured)))
    for grads_b, coords in zip((dw_b, db_b), ctx.coords):
        if grads_b is not None and coords is not None:
            coords.add_(grads_b.square().sum(0))
    count.add_(B)
    return None


def _check_buffers(entry, **buffers):
    for name, buffer in buffers.items():
        _buffer_layout(f"normgnorm.{entry}'s {name}", buffer, pair_allowed=False)


def layer_norm(x: Tensor, weight: Tensor, bias: Optional[Tensor],
               weight_sqgradnorm: Tensor, bias_sqgradnorm: Optional[Tensor], example_count: Tensor,
               eps: float = 1e-5, backend: Optional[str] = None) -> Tensor:
    """
    F.layer_norm(x, (D,), weight, bias, eps) whose backward also accumulates the per-example
    squared norms of dγ, dβ into the float32 0-dim buffers weight_sqgradnorm, bias_sqgradnorm
    (None when there is no bias) and the number of examples into example_count.
    """
    _check_buffers("layer_norm", weight_sqgradnorm=weight_sqgradnorm, bias_sqgradnorm=bias_sqgradnorm,
                   example_count=example_count)
    if weight.shape != x.shape[-1:] or (bias is not None and bias.shape != weight.shape):
        raise ValueError(f"nanogns.normgnorm.layer_norm normalizes over the last dimension only: weight {tuple(weight.shape)} "
                         f"must be ({x.shape[-1] if x.dim() else ''},) for input {tuple(x.shape)}")
    if weight_sqgradnorm is None or example_count is None or (bias is not None and bias_sqgradnorm is None):
        fresh = lambda: x.new_zeros((), dtype=torch.float32)  # noqa: E731  (a buffer not kept: not measured)
        weight_sqgradnorm = fresh() if weight_sqgradnorm is None else weight_sqgradnorm
        bias_sqgradnorm = fresh() if bias is not None and bias_sqgradnorm is None else bias_sqgradnorm
        example_count = fresh() if example_count is None else example_count
    return _NormFn.apply(x, weight, bias, weight_sqgradnorm, bias_sqgradnorm, example_count, None, eps, backend or "",
                         False)


def rms_norm(x: Tensor, weight: Tensor, weight_sqgradnorm: Tensor, example_count: Tensor,
             eps: Optional[float] = None, backend: Optional[str] = None) -> Tensor:
    """
    F.rms_norm(x, (D,), weight, eps) whose backward also accumulates Σ_b ||dγ_b||² into the float32
    0-dim buffer weight_sqgradnorm and the number of examples into example_count. eps None is
    torch's default, the machine epsilon of the computation type (float32 for half inputs).
    Under autocast its output dtype is torch's rms_norm's on that device (autocast_runs_in_float32).
    """
    _check_buffers("rms_norm", weight_sqgradnorm=weight_sqgradnorm, example_count=example_count)
    if x.dim() == 0 or weight.shape != x.shape[-1:]:
        raise ValueError(f"nanogns.normgnorm.rms_norm normalizes over the last dimension only: weight {tuple(weight.shape)} "
                         f"must be ({x.shape[-1] if x.dim() else ''},) for input {tuple(x.shape)}")
    return _NormFn.apply(x, weight, None, weight_sqgradnorm, None, example_count, None, rms_norm_eps(eps, x.dtype),
                         backend or "", True)


# ---------------------------------------------------------------------------------------------
# The reference implementation's names (CerebrasResearch/nanoGNS, exact/normgnorm/__init__.py).
# Kept: PEGLayerNorm, with its seven arguments and its [sum, count] buffers, an adapter onto
# layer_norm's Function. The rest fails at once, saying what to use instead.

class PEGLayerNorm:
    """
    The reference implementation's LayerNorm Function, kept so that code written for it runs
    unchanged; our own code calls layer_norm. An adapter onto _NormFn, the one Function of the
    normalisations: it checks the reference's arguments and hands them on. The backward also adds
    Σ_b ||dγ_b||², Σ_b ||dβ_b||² to the float32 buffers and B to example_count (when given):

        y = PEGLayerNorm.apply(x, weight, bias, weight_sqgradnorm, bias_sqgradnorm,
                               normalized_shape, eps[, example_count[, backend]])

    Its buffers, 2-element [sum, count] pairs (torch.zeros(2)), get [Σ_b ||dγ_b||², B] and
    [Σ_b ||dβ_b||², B] added, as the reference adds them; this fork's are 0-dim sums. Either may be
    None (not measured), and only parameters that receive a gradient are measured.
    """

    @staticmethod
    def apply(x, weight, bias, weight_sqgradnorm, bias_sqgradnorm, normalized_shape, eps=1e-5, example_count=None,
              backend=None):
        D = x.shape[-1] if x.dim() else None
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        if shape != (D,) or weight.shape != (D,):
            raise ValueError(f"PEGLayerNorm normalizes over the last dimension only: normalized_shape "
                             f"{shape} and weight {tuple(weight.shape)} must both be ({D},) for input {tuple(x.shape)}")
        pairs = (_buffer_layout("PEGLayerNorm's weight_sqgradnorm", weight_sqgradnorm),
                 _buffer_layout("PEGLayerNorm's bias_sqgradnorm", bias_sqgradnorm))
        _buffer_layout("PEGLayerNorm's example_count", example_count, pair_allowed=False)
        # the Function adds to 0-dim sums: a pair, or a missing buffer, gets a fresh one
        fresh = lambda: x.new_zeros((), dtype=torch.float32)  # noqa: E731
        sums = [buf if buf is not None and not pair else fresh()
                for buf, pair in zip((weight_sqgradnorm, bias_sqgradnorm), pairs)]
        count = example_count if example_count is not None else fresh()
        pair_bufs = None
        if any(pairs):  # the Function adds [sum, B] to them after its backward
            pair_bufs = tuple(buf if pair else None for buf, pair in zip((weight_sqgradnorm, bias_sqgradnorm), pairs))
        return _NormFn.apply(x, weight, bias, *sums, count, None, eps, backend or "", False,
                             None, None, None, pair_bufs)


# the reference's names this module does not keep: refused, saying what to use
__getattr__ = module_refusals("normgnorm")
