"""
Per-example gradient norm layers: drop-in Linear, Embedding, LayerNorm and RMSNorm classes whose
backward pass also accumulates, for every trainable parameter p, the running sum over examples b
of ||g_b / B||^2 (the per-example gradient as the layer sees it), in float32; and measure(), which
puts them into any model. `import buffered` (the reference implementation's name) is this package.

    buffers.py    the buffers' convention, registering, finding, zeroing and all-reducing them;
                  MeasuredLayer, every measured layer's base; sum_of_squares
    linear.py     PEGradNormLinear (--linearclass=gns: one backward computes the gradients and the
                  norms), PEGradNormShimLinear (=shim: torch's own backward, the norms beside it),
                  the ghost or materialised weight norm and the per-card routes table (routes/)
    embedding.py  PEGradNormEmbedding (--embeddingclass=gns), PEGradNormShimEmbedding (=shim), and
                  tie_weights: a tied token embedding and output head measured exactly
    norms.py      PEGradNormSeparatedLayerNorm / PEGradNormSeparatedRMSNorm (--lnclass=shim: torch's
                  own normalisation and gradients), PEGradNormFusedLayerNorm / PEGradNormFusedRMSNorm
                  (=fused: the normgnorm kernel), LayerNorm (unmeasured; takes nanoGPT's (ndim, bias))
    registry.py   MEASURED_CLASSES (kind and flag value -> class, whence layer_config's flags),
                  SOURCE_KINDS, TOKEN_BLOCKS, and measure(model, linear="gns", embedding="gns",
                  norm="shim", kinds=None, strict=False, batch_dim=0)
    config.py     layer_config: the flags' classes, chosen for nanoGPT's model.py
    linear_kernel.py  the Triton GEMM of materialised Linear norms

Every layer must be applied once per forward (a layer used twice would need the cross terms
between its uses: in a model measure() converted, an error); the one exception handled is the tied
token embedding / output head, linked by tie_weights() (or measure()).
"""
# What other code reads from here (`import buffered; buffered.X`), each from its module
from nanogns.layers.buffers import (CPU_DOT_PIECE, MeasuredLayer, _warned, all_sqgradnorm_buffers,  # noqa: F401
                                    allreduce_buffers, allreduce_sqgradnorm_buffers, coordinate_buffers,
                                    find_sqgradnorm_buffers, register_sqgradnorm_buffers, sum_of_squares,
                                    zero_sqgradnorm_buffers)
from nanogns.layers.embedding import PEGradNormEmbedding, PEGradNormShimEmbedding, link_tied, tie_weights  # noqa: F401
from nanogns.layers.linear import (CUBLAS_ROUTE, DTYPE_NAMES, FUSED_GHOST_RATIO, HAS_TRITON, NORM_METHODS,  # noqa: F401
                                   PER_EXAMPLE_MODES, ROUTE_COLUMNS, ROUTE_TOLERANCE, ROUTES_DIR, TIMING_REPEATS,
                                   LinearRouteTableError, PEGradNormLinear, PEGradNormShimLinear, _MeasuredLinear,
                                   _one_read_squares_and_sum, _timed_choice, _use_ghost, _weight_sqnorm_ghost,
                                   _weight_sqnorm_materialised, agree_linear_norm_methods, card_family,
                                   choose_linear_norm_methods, linear_norm_methods, linear_sqnorms,
                                   materialised_route, measured_linears, read_route_table, route_table_path,
                                   set_linear_norm_methods, set_per_example_mode, table_method)
from nanogns.layers.norms import (LAYERNORM_DEFAULTS, LayerNorm, PEGradNormFusedLayerNorm,  # noqa: F401
                                  PEGradNormFusedRMSNorm, PEGradNormSeparatedLayerNorm, PEGradNormSeparatedRMSNorm,
                                  layernorm_arguments, register_coordinate_buffers)
from nanogns.layers.registry import (KIND_NAMES, MEASURED_CLASSES, NORM_KINDS, SOURCE_KINDS,  # noqa: F401
                                     TOKEN_BLOCKS, TRANSPOSED_WEIGHT, kind_of_measured, layer_kinds, measure,
                                     measured_batch_dim, source_kind)
from nanogns.refusals import refuse_module_names


# ---------------------------------------------------------------------------------------------
# The reference implementation's names (CerebrasResearch/nanoGNS, exact/buffered.py). Kept with
# the same meaning: the five layer classes with its constructor arguments, LayerNorm(ndim, bias),
# zero_sqgradnorm_buffers(model), and on the layers weight_pegsqnorm() / bias_pegsqnorm() and the
# separated LayerNorm's .affine (re-exported above). The rest fails at once, saying what to use instead.

_SHIM_LINEAR = "use PEGradNormShimLinear, whose backward adds the norms to weight_sqgradnorm / bias_sqgradnorm"
_FUSED_LINEAR = "use PEGradNormLinear, whose backward computes the weight gradient and the norms together"
_SHIM_EMBEDDING = "use PEGradNormShimEmbedding, whose backward adds the norms to weight_sqgradnorm"
_FUSED_EMBEDDING = "use PEGradNormEmbedding, whose backward builds the weight gradient and the norms together"
_SEPARATED = ("use PEGradNormSeparatedLayerNorm(ndim, bias): its own weight and bias are the affine part "
              "(.affine is the layer itself), measured into weight_sqgradnorm / bias_sqgradnorm")
_SELF_TEST = "use pytest tests/test_layers.py, this fork's tests of the same layers"

# named as the reference's users wrote them: buffered.<name>
__getattr__ = refuse_module_names("buffered", {
    "exists": "write `x is not None`",
    "safe_sum": "use x.sum(dim, keepdim, dtype=torch.float32).to(x.dtype)",
    "safe_sqnorm": "use x.float().square().sum(dim, keepdim).to(x.dtype)",
    "stack_with_ones": "use torch.stack([x, torch.ones_like(x)], dim); this fork keeps the running sum and "
                       "the example count in two buffers, {name}_sqgradnorm and example_count",
    "ModuleWithBuffers": "use buffered.MeasuredLayer, the measured layers' shared base; "
                         "register_sqgradnorm_buffers(module) gives a module the buffers, "
                         "find_sqgradnorm_buffers(model) finds them",
    "pe_linear_grad_norm": _SHIM_LINEAR,
    "PEGLinearGradNormNoop": _SHIM_LINEAR,
    "wgrad_plus_pe_grad_norm_highmem": _FUSED_LINEAR + " (per_example_mode='materialise' forms W_b)",
    "at_index": "write `x[i] if i < len(x) else False`",
    "PEGradNormLinearFunction": _FUSED_LINEAR,
    "embedding_dense_backward": "use torch.ops.aten.embedding_dense_backward for the summed gradient; for "
                                "per-example norms " + _FUSED_EMBEDDING,
    "embedding_pe_grad_norm": _SHIM_EMBEDDING,
    "PEGEmbeddingGradNormNoop": _SHIM_EMBEDDING,
    "embedding_peg_plus_grads": _FUSED_EMBEDDING,
    "PEGEmbeddingGradNorm": _FUSED_EMBEDDING,
    "ElementWiseAffine": _SEPARATED,
    "PEGradNormEANoop": _SEPARATED,
    "PEGradNormShimElementWiseAffine": _SEPARATED,
    "ShimLinearTest": _SELF_TEST,
    "ShimEmbeddingTest": _SELF_TEST,
    "LNShimTest": _SELF_TEST,
})
