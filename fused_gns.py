"""
PEGradNormFusedLayerNorm: a drop-in for nn.LayerNorm (same parameters, same state_dict keys,
eps 1e-5) whose backward also accumulates the per-example squared gradient norms of its gain
and bias into float32 buffers, with the fused kernel of normgnorm/ (Triton or CUDA on GPU,
pure PyTorch elsewhere). PEGradNormFusedRMSNorm: the same for nn.RMSNorm (its gain only).
Buffers follow buffered.py's convention: `weight_sqgradnorm`, `bias_sqgradnorm` (only with
bias) and `example_count`.

    from fused_gns import PEGradNormFusedLayerNorm, PEGradNormFusedRMSNorm
    with set_contextual_config(LayerNorm=PEGradNormFusedLayerNorm, RMSNorm=PEGradNormFusedRMSNorm):
        model = GPT(config)
"""
import torch.nn as nn
import torch.nn.functional as F

import normgnorm
from buffered import MEASURED_CLASSES, LayerNorm, MeasuredLayer, register_sqgradnorm_buffers
from reference_names import refuse_module_names


class _FusedNorm(MeasuredLayer):
    """
    What the fused normalisations share: the torch class's arguments and `backend` (None:
    NORMGNORM_BACKEND, else Triton on CUDA, PyTorch elsewhere). The kernel normalises over the
    last dimension only; elementwise_affine=False leaves nothing to measure and runs torch's own.
    """
    separated = None  # buffered.py's class for what the kernel does not take

    def __init__(self, *args, backend=None, **kwargs):
        super().__init__(*args, **kwargs)
        if len(self.normalized_shape) != 1:
            raise ValueError(f"{type(self).__name__} normalises over the last dimension only, not "
                             f"{self.normalized_shape}; use buffered.{self.separated}")
        self.backend = backend
        register_sqgradnorm_buffers(self)


class PEGradNormFusedLayerNorm(_FusedNorm, LayerNorm):
    """Takes torch's nn.LayerNorm arguments or the reference's (ndim, bias) (see buffered.LayerNorm)."""
    separated = "PEGradNormSeparatedLayerNorm"

    def forward(self, x):
        self._check_applied_once()
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
        self._check_applied_once()
        if self.weight is None:
            return F.rms_norm(x, self.normalized_shape, None, self.eps)
        return normgnorm.rms_norm(x, self.weight, self.weight_sqgradnorm, self.example_count, self.eps,
                                  self.backend)


# the registry's "fused" normalisations (buffered.MEASURED_CLASSES): --lnclass=fused, measure(norm="fused")
MEASURED_CLASSES["layernorm"]["fused"] = PEGradNormFusedLayerNorm
MEASURED_CLASSES["rmsnorm"]["fused"] = PEGradNormFusedRMSNorm

# ---------------------------------------------------------------------------------------------
# The reference implementation's names (CerebrasResearch/nanoGNS, exact/fused_gns.py). Kept:
# PEGradNormFusedLayerNorm(ndim, bias) and LayerNorm (buffered.LayerNorm, which it imported from
# buffered.py). The rest fails at once, saying what to use instead.

__getattr__ = refuse_module_names(__name__, {
    "ModuleWithBuffers": "use buffered.MeasuredLayer, the measured layers' shared base; "
                         "register_sqgradnorm_buffers(module) gives a module the buffers, "
                         "find_sqgradnorm_buffers(model) finds them",
    "LNShimTest": "use pytest tests/test_fused_gns.py, this fork's tests of the same layer",
})
