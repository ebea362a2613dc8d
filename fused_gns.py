"""
The fused normalisations under the reference implementation's module name (CerebrasResearch/nanoGNS,
exact/fused_gns.py): PEGradNormFusedLayerNorm, a drop-in for nn.LayerNorm (same parameters, same
state_dict keys, eps 1e-5, or the reference's (ndim, bias)) whose backward also accumulates the
per-example squared gradient norms of its gain and bias with the fused kernel of normgnorm/ (under
torch.compile, normgnorm's PyTorch path, which the compiler fuses with the model), and
PEGradNormFusedRMSNorm, the same for nn.RMSNorm. Both live in buffered.py beside the other
measured layers (its registry builds them for --lnclass=fused and measure(norm="fused")); this
module keeps the reference's import path:

    from fused_gns import PEGradNormFusedLayerNorm, PEGradNormFusedRMSNorm
    with set_contextual_config(LayerNorm=PEGradNormFusedLayerNorm, RMSNorm=PEGradNormFusedRMSNorm):
        model = GPT(config)
"""
from nanogns.layers import LayerNorm, PEGradNormFusedLayerNorm, PEGradNormFusedRMSNorm  # noqa: F401
from nanogns.refusals import refuse_module_names

# ---------------------------------------------------------------------------------------------
# The reference implementation's names. Kept: PEGradNormFusedLayerNorm(ndim, bias) and LayerNorm
# (buffered.LayerNorm, which it imported from buffered.py). The rest fails at once, saying what to
# use instead.

__getattr__ = refuse_module_names(__name__, {
    "ModuleWithBuffers": "use buffered.MeasuredLayer, the measured layers' shared base; "
                         "register_sqgradnorm_buffers(module) gives a module the buffers, "
                         "find_sqgradnorm_buffers(model) finds them",
    "LNShimTest": "use pytest tests/test_fused_gns.py, this fork's tests of the same layer",
})
