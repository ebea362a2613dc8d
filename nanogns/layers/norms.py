"""
The measured normalisations: LayerNorm and RMSNorm, separated (--lnclass=shim: torch's own forward
and gradients, the affine part's per-example norms measured beside them) and fused (--lnclass=fused:
the normgnorm kernel computes y, dx, dgamma, dbeta and the norms in one forward and one backward),
and LayerNorm, the unmeasured nn.LayerNorm that also takes nanoGPT's LayerNorm(ndim, bias).

torch.compile: like every measured layer, the normalisations hand their sums out of the compiled
backward as the gradient of a sink, added to the buffers after it (nanogns.layers.buffers.MeasuredLayer).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

import nanogns.normgnorm as normgnorm
from nanogns.layers import sharded
from nanogns.layers.buffers import MeasuredLayer, _examples, coordinate_buffers, register_sqgradnorm_buffers
from nanogns.normgnorm.torch_path import rms_norm_eps
from nanogns.refusals import refuse_attributes


class _MeasuredNorm(MeasuredLayer):
    """
    What the measured normalisations share: their sink (MeasuredLayer's) also carries the
    per-coordinate sums of any `{name}_sqgrad_coords` buffers, after the scalar ones.
    """

    def sink_layout(self):
        coords = [(f"{name}_sqgrad_coords", self._buffers[f"{name}_sqgrad_coords"].numel())
                  for name in ("weight", "bias") if self._buffers.get(f"{name}_sqgrad_coords") is not None]
        return super().sink_layout() + coords


# ---------------------------------------------------------------------------------------------
# LayerNorm

# torch's nn.LayerNorm parameters in order, with their defaults
LAYERNORM_DEFAULTS = dict(normalized_shape=None, eps=1e-5, elementwise_affine=True, bias=True, device=None, dtype=None)


def layernorm_arguments(name, args, kwargs):
    """
    The arguments of a LayerNorm call as a dict of nn.LayerNorm's parameters, from either torch's
    order (normalized_shape, eps=1e-5, elementwise_affine=True, bias=True, device=None, dtype=None)
    or nanoGPT's and the reference implementation's LayerNorm(ndim, bias): a bool second positional
    argument is bias (torch would take it for eps = 1.0 or 0.0).
    """
    order = list(LAYERNORM_DEFAULTS)
    if len(args) >= 2 and isinstance(args[1], bool):
        order = ["normalized_shape", "bias"]
    if len(args) > len(order):
        raise TypeError(f"{name} takes at most {len(order)} positional arguments ({', '.join(order)}), "
                        f"got {len(args)}: {args!r}")
    given = dict(zip(order, args))
    for key, value in kwargs.items():
        if key not in LAYERNORM_DEFAULTS:
            raise TypeError(f"{name} got an unexpected keyword argument {key!r}; "
                            f"it takes {', '.join(LAYERNORM_DEFAULTS)}")
        if key in given:
            raise TypeError(f"{name} got {key} twice: {given[key]!r} by position and {value!r} by keyword")
        given[key] = value
    if "normalized_shape" not in given:
        raise TypeError(f"{name} needs normalized_shape (the feature size ndim)")
    if isinstance(given.get("eps"), bool):
        raise TypeError(f"{name} got eps={given['eps']!r}: eps is a float; for bias write bias={given['eps']!r}")
    return {**LAYERNORM_DEFAULTS, **given}


class LayerNorm(nn.LayerNorm):
    """
    nn.LayerNorm that also takes nanoGPT's and the reference implementation's LayerNorm(ndim, bias)
    (a plain LayerNorm with an optional bias, eps 1e-5), as well as torch's own arguments.
    The measured LayerNorms (below) build on it.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(**layernorm_arguments(type(self).__name__, args, kwargs))


@refuse_attributes
class PEGradNormSeparatedLayerNorm(_MeasuredNorm, LayerNorm):
    """
    nn.LayerNorm whose affine part y = gamma * xhat + beta is measured separately from the
    normalisation xhat: backward adds the per-example squared norms of dgamma_b = sum_t dy * xhat
    and dbeta_b = sum_t dy (the cheap ones: Gray et al. 2024 find these alone predict the whole
    model's gradient noise scale). Forward and every gradient are torch's own (bit-identical):
    normgnorm's Function, in its separated way, measures beside them from what torch keeps (x and
    the row statistics), so memory is as nn.LayerNorm's.
    Same parameters and state_dict keys as nn.LayerNorm, bias=False included. Takes torch's
    arguments or the reference's (ndim, bias), as LayerNorm above.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        register_sqgradnorm_buffers(self)

    def forward(self, x):
        self._check_call(_examples(x, len(self.normalized_shape)))
        w_trains = self.weight is not None and self.weight.requires_grad
        b_trains = self.bias is not None and self.bias.requires_grad
        if not torch.is_grad_enabled() or not (w_trains or b_trains):
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        # torch's layer_norm with its row statistics: native_layer_norm, which F.layer_norm runs (its
        # autograd too), with the float32 casts of F.layer_norm's autocast rule where autocast has one
        xc, weight, bias, _ = normgnorm._float32_under_autocast(x, self.weight, self.bias, False)
        y, mean, rstd = torch.native_layer_norm(xc, self.normalized_shape, weight, bias, self.eps)
        xl, wl, stats, group = _local_norm_inputs(self, xc.detach(), self.weight.detach(),
                                                  (mean.detach(), rstd.detach()))
        bufs = self._buffers
        return normgnorm._NormFn.apply(xl, wl, None,
                                       bufs.get("weight_sqgradnorm") if w_trains else None,
                                       bufs.get("bias_sqgradnorm") if b_trains else None,
                                       bufs["example_count"], self._compiled_sink(), self.eps, "", False,
                                       y, stats,
                                       (bufs.get("weight_sqgrad_coords"), bufs.get("bias_sqgrad_coords")), None, group)

    # The reference implementation's separated LayerNorm held the gain and bias in a submodule
    # .affine (after a .layernorm without them, refused: refusals.ATTRIBUTES); here they are its own.
    affine = property(lambda self: self, doc="The layer itself: its weight and bias are the affine part's.")


def _local_norm_inputs(layer, x, weight, stats):
    """A separated normalisation's x, weight and row statistics as its Function measures from them, and
    (the process group over which its per-example vectors are summed before squaring, the factor the sum
    is scaled by), or None where they are not. Plain tensors go as they are, with the context-parallel
    group where split_tokens gave one (each rank holds some of every example's tokens, as below; the input
    a plain tensor). Under torch's SequenceParallel (DTensors on the TP mesh, the parameters
    replicated, each rank holding some of every example's tokens) the local tensors, and the TP group:
    each rank's dgamma_b, dbeta_b are partial sums over its tokens, whose squares do not add; the summed
    vectors are the same on every rank, so its buffers count once over the group (nanogns/layers/sharded.py)."""
    token_group = layer.__dict__.get("_token_group")  # context parallelism (sharded.split_tokens)
    if not sharded.is_dtensor(x):
        return x, weight, stats, token_group
    where = layer._measured_name or type(layer).__name__
    if token_group is not None:
        raise RuntimeError(f"{where}: a DTensor input (sequence parallelism) to a normalisation whose tokens are "
                           "also split over context-parallel ranks (split_tokens): not measured; leave it unmeasured")
    placements = x.placements
    if len(placements) != 1:
        raise RuntimeError(f"{where}: a DTensor on a {len(placements)}-dimensional mesh in the forward; the "
                           "measured normalisations take one sequence-parallel mesh dimension")
    pl, tokens = placements[0], x.dim() - len(layer.normalized_shape)  # dims 1 .. tokens - 1 hold the tokens
    split = pl.is_shard() and 0 < pl.dim % x.dim() < tokens
    if not (split or pl.is_replicate()) or sharded.is_dtensor(weight) and not all(
            p.is_replicate() for p in weight.placements):
        raise RuntimeError(f"{where}: input {pl}, weight {getattr(weight, 'placements', None)} over the mesh: a "
                           "measured normalisation takes its tokens split (SequenceParallel) or whole, its "
                           "parameters replicated; leave it unmeasured (measure(model, norm=None))")
    sharded.localise_buffers(layer)
    sharded.note_sharded(layer, x.device_mesh.get_group(), {name: "once" for name in layer._buffers
                                                if name == "example_count" or name.endswith("_sqgradnorm")})
    local = lambda t: t.to_local() if sharded.is_dtensor(t) else t  # noqa: E731
    stats = None if stats is None else tuple(local(t) for t in stats)
    return local(x), local(weight), stats, (x.device_mesh.get_group(), 1.0) if split else None


# ---------------------------------------------------------------------------------------------
# RMSNorm

class PEGradNormSeparatedRMSNorm(_MeasuredNorm, nn.RMSNorm):
    """
    nn.RMSNorm (the same arguments, parameter and state_dict keys; eps None is torch's machine
    epsilon) whose backward also adds the per-example squared norms of its gain's gradient,
    dgamma_b = sum_t dy * xhat: LayerNorm's rule without the centring. Output and every gradient
    are torch's own rms_norm's (bit-identical); the norms are measured beside it (normgnorm's
    Function, in its separated way) from dy and the input, which torch saves too, at the cost of
    one more read of x in backward.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        register_sqgradnorm_buffers(self)

    def forward(self, x):
        self._check_call(_examples(x, len(self.normalized_shape)))
        y = F.rms_norm(x, self.normalized_shape, self.weight, self.eps)
        weight = self._parameters.get("weight")  # None without affine, or parametrized: not measured
        if not torch.is_grad_enabled() or weight is None or not weight.requires_grad:
            return y
        xl, wl, _, group = _local_norm_inputs(self, x.detach(), weight.detach(), None)
        bufs = self._buffers
        return normgnorm._NormFn.apply(xl, wl, None, bufs.get("weight_sqgradnorm"), None,
                                       bufs["example_count"], self._compiled_sink(), self.eps, "", True, y, None,
                                       (bufs.get("weight_sqgrad_coords"), None), None, group)


# ---------------------------------------------------------------------------------------------
# The fused normalisations (--lnclass=fused): the normgnorm kernel (Triton or CUDA on GPU, PyTorch
# elsewhere) computes y and, in its backward, dx, dgamma, dbeta and the per-example norms together.
# fused_gns.py, the reference implementation's home for them, imports them from here.

class _FusedNorm(_MeasuredNorm):
    """
    What the fused normalisations share: the torch class's arguments and `backend`, the eager
    implementation (None: Triton on CUDA, the CPU kernel on CPU; normgnorm.resolve_backend). Under
    torch.compile every backend runs the one compiled route, the PyTorch path fused with the model.
    The kernel normalises over the last dimension only; elementwise_affine=False leaves nothing to
    measure and runs torch's own. A DTensor input (torch's SequenceParallel) is normalised by torch
    and measured as the separated class measures it: the kernels read local memory. So are tokens split over
    context-parallel ranks (split_tokens).
    """
    separated = None  # the separated class, for what the kernel does not take

    def __init__(self, *args, backend=None, **kwargs):
        super().__init__(*args, **kwargs)
        if len(self.normalized_shape) != 1:
            raise ValueError(f"{type(self).__name__} normalises over the last dimension only, not "
                             f"{self.normalized_shape}; use nanogns.layers.{self.separated}")
        self.backend = backend
        register_sqgradnorm_buffers(self)


class PEGradNormFusedLayerNorm(_FusedNorm, LayerNorm):
    """Takes torch's nn.LayerNorm arguments or the reference's (ndim, bias) (see LayerNorm above)."""
    separated = "PEGradNormSeparatedLayerNorm"

    def forward(self, x):
        if sharded.is_dtensor(x) or "_token_group" in self.__dict__:  # tokens split over ranks: measured as
            return PEGradNormSeparatedLayerNorm.forward(self, x)                # separated (the kernels read local memory)
        self._check_call(_examples(x, len(self.normalized_shape)))
        if torch.compiler.is_compiling() and not self._measures():  # nothing to measure: torch's own
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        params, bufs = self._parameters, self._buffers  # dict reads: a module attribute is two __getattr__
        weight = params.get("weight")
        if weight is not None and "bias" in params and x.shape[-1:] == weight.shape:
            # own parameters: the Function itself, without layer_norm()'s checks of buffers that this
            # layer registered (eager and compiled: the one path)
            return normgnorm._NormFn.apply(x, weight, params["bias"], bufs["weight_sqgradnorm"],
                                           bufs.get("bias_sqgradnorm"), bufs["example_count"], self._compiled_sink(),
                                           self.eps, self.backend or "", False)
        if self.weight is None:
            return F.layer_norm(x, self.normalized_shape, None, None, self.eps)
        return normgnorm.layer_norm(x, self.weight, self.bias,
                                    self.weight_sqgradnorm, self._buffers.get("bias_sqgradnorm"),
                                    self.example_count, self.eps, self.backend)


class PEGradNormFusedRMSNorm(_FusedNorm, nn.RMSNorm):
    """Takes torch's nn.RMSNorm arguments; eps None is torch's default (machine epsilon of the
    computation type). Measures Σ_b ||dγ_b||² of its gain, dγ_b = Σ_t dy_bt ⊙ x̂_bt."""
    separated = "PEGradNormSeparatedRMSNorm"

    def forward(self, x):
        if sharded.is_dtensor(x) or "_token_group" in self.__dict__:  # tokens split over ranks: measured as
            return PEGradNormSeparatedRMSNorm.forward(self, x)                # separated (the kernels read local memory)
        self._check_call(_examples(x, len(self.normalized_shape)))
        if torch.compiler.is_compiling() and not self._measures():  # nothing to measure: torch's own
            return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)
        weight = self._parameters.get("weight")
        if weight is not None and x.dim() and x.shape[-1:] == weight.shape:
            # own gain: the Function itself, without rms_norm()'s checks of this layer's own buffers
            bufs = self._buffers
            return normgnorm._NormFn.apply(x, weight, None, bufs["weight_sqgradnorm"], None, bufs["example_count"],
                                           self._compiled_sink(), rms_norm_eps(self.eps, x.dtype), self.backend or "",
                                           True)
        if self.weight is None:
            return F.rms_norm(x, self.normalized_shape, None, self.eps)
        return normgnorm.rms_norm(x, self.weight, self.weight_sqgradnorm, self.example_count, self.eps,
                                  self.backend)


def register_coordinate_buffers(model, params):
    """
    Give each separated LayerNorm and RMSNorm parameter whose id is in `params` a float32 buffer
    `{name}_sqgrad_coords` of its size, to which its backward then adds the per-coordinate sums
    S_d = sum_b (g_bd / B)^2 (nanogns/estimators/adam.py applies a diagonal preconditioner to them). They are the
    Adam estimator's own: not zeroed, all-reduced or read with the scalar sums. Returns
    coordinate_buffers(model).
    """
    for module in model.modules():
        if isinstance(module, (PEGradNormSeparatedLayerNorm, PEGradNormSeparatedRMSNorm)):
            for name, p in module.named_parameters(recurse=False):
                if id(p) in params and p.requires_grad and f"{name}_sqgrad_coords" not in module._buffers:
                    module.register_buffer(f"{name}_sqgrad_coords", p.new_zeros(p.numel(), dtype=torch.float32),
                                           persistent=False)
    return coordinate_buffers(model)
