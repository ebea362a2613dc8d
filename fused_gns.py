"""
The fused normalisations under the reference implementation's module name (CerebrasResearch/nanoGNS,
exact/fused_gns.py): PEGradNormFusedLayerNorm, a drop-in for nn.LayerNorm (same parameters, same
state_dict keys, eps 1e-5, or the reference's (ndim, bias)) whose backward also accumulates the
per-example squared gradient norms of its gain and bias with the fused kernel of nanogns/normgnorm/
(under torch.compile, its PyTorch path, which the compiler fuses with the model), and
PEGradNormFusedRMSNorm, the same for nn.RMSNorm. Both live in nanogns/layers/norms.py beside the
other measured layers (the registry builds them for --lnclass=fused and measure(norm="fused"));
this module keeps the reference's import path:

    from fused_gns import PEGradNormFusedLayerNorm, PEGradNormFusedRMSNorm
    with set_contextual_config(LayerNorm=PEGradNormFusedLayerNorm, RMSNorm=PEGradNormFusedRMSNorm):
        model = GPT(config)
"""
from nanogns.layers import LayerNorm, PEGradNormFusedLayerNorm, PEGradNormFusedRMSNorm  # noqa: F401
from nanogns.refusals import module_refusals

# The reference implementation's names. Kept: PEGradNormFusedLayerNorm(ndim, bias) and LayerNorm
# (buffered.LayerNorm, which it imported from buffered.py). The rest fails at once, saying what to
# use instead (nanogns/refusals.py).
__getattr__ = module_refusals("fused_gns")
