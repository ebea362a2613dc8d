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
    registry.py   MEASURED_CLASSES (kind and flag value -> class, whence config.py's flags),
                  SOURCE_KINDS, MOE_BLOCKS, TOKEN_BLOCKS, and measure(model, linear="gns", embedding="gns",
                  norm="shim", kinds=None, strict=False, batch_dim=0)
    experts.py    Experts (a mixture of experts' routed GELU MLPs, weights [E, out, in]) and
                  PEGradNormExperts, the same measured per example and per expert
    hf_moe.py     Hugging Face's MoE blocks' routed experts (PEGradNormHFExperts) and routers
                  (PEGradNormHFRouter), converted in place by measure()
    config.py     the flags' classes, chosen for nanoGPT's model.py (the reference's layer_config)
    linear_kernel.py  the Triton GEMM of materialised Linear norms
    sharded.py    the layers under torch's tensor and sequence parallelism (parallelize_module): how
                  each buffer's per-rank sums combine over the TP group, allreduce_sharded_buffers;
                  split_tokens, the normalisations under context parallelism (tokens split over ranks)

Every layer must be applied once per forward (a layer used twice would need the cross terms
between its uses: in a model measure() converted, an error); the one exception handled is the tied
token embedding / output head, linked by tie_weights() (or measure()).
"""
# What other code reads from here (nanogns.layers.X), each from its module
from nanogns.layers.buffers import (CPU_DOT_PIECE, MeasuredLayer, all_sqgradnorm_buffers,  # noqa: F401
                                    allreduce_buffers, allreduce_sqgradnorm_buffers, coordinate_buffers,
                                    find_sqgradnorm_buffers, keep_out_of_ddp_broadcast,
                                    register_sqgradnorm_buffers, sum_of_squares,
                                    zero_sqgradnorm_buffers)
from nanogns.layers.experts import Experts, PEGradNormExperts  # noqa: F401
from nanogns.layers.hf_moe import PEGradNormHFExperts, PEGradNormHFRouter  # noqa: F401
from nanogns.layers.embedding import PEGradNormEmbedding, PEGradNormShimEmbedding, link_tied, tie_weights  # noqa: F401
from nanogns.layers.linear import (CUBLAS_ROUTE, DTYPE_NAMES, FUSED_GHOST_RATIO, HAS_TRITON, NORM_METHODS,  # noqa: F401
                                   PER_EXAMPLE_MODES, ROUTE_COLUMNS, ROUTE_TOLERANCE, ROUTES_DIR,
                                   LinearRouteTableError, PEGradNormLinear, PEGradNormShimLinear,
                                   agree_linear_norm_methods, card_family,
                                   choose_linear_norm_methods, linear_norm_methods, linear_sqnorms,
                                   materialised_route, measured_linears, read_route_table, route_table_path,
                                   set_linear_norm_methods, set_per_example_mode, table_method)
from nanogns.layers.sharded import allreduce_sharded_buffers, split_tokens  # noqa: F401
from nanogns.layers.norms import (LAYERNORM_DEFAULTS, LayerNorm, PEGradNormFusedLayerNorm,  # noqa: F401
                                  PEGradNormFusedRMSNorm, PEGradNormSeparatedLayerNorm, PEGradNormSeparatedRMSNorm,
                                  layernorm_arguments, register_coordinate_buffers)
from nanogns.layers.registry import (KIND_NAMES, MEASURED_CLASSES, MOE_BLOCKS, NORM_KINDS, SOURCE_KINDS,  # noqa: F401
                                     TOKEN_BLOCKS, TRANSPOSED_WEIGHT, entry_names, kind_of_measured, layer_kinds, measure,
                                     measured_batch_dim, source_kind)
from nanogns.refusals import module_refusals


# the reference's names this module does not keep (buffered.<name>): refused, saying what to use
__getattr__ = module_refusals("buffered")
