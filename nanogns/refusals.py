"""
The reference implementation's names that this fork does not keep (CerebrasResearch/nanoGNS,
exact/), all in this one file. Code written against the reference either runs here with the same
meaning or, where it uses one of these, fails at once with one line saying what to use instead:
never with a different number.

A module refuses the names listed under the name the reference's code imports it by:

    __getattr__ = module_refusals("gnstracking")

a class the attributes listed under its name (@refuse_attributes), and the measured layers the
reference's buffer names (refuse_layer_attribute, from their __getattr__).
"""


class ReferenceNameError(ImportError):
    """A reference name not kept here; the message says what to use instead. An ImportError and
    not an AttributeError, so that `from module import name` shows the message (Python replaces
    an AttributeError raised there with its own) and nn.Module's __getattr__ does not swallow it."""


def _message(qualified_name, hint):
    return f"{qualified_name} is the reference implementation's and is not kept in this fork: {hint}"


def refuse_module_names(module_name, hints):
    """A module-level __getattr__ (PEP 562) refusing each name in `hints` with its hint."""
    def __getattr__(name):
        if name in hints:
            raise ReferenceNameError(_message(f"{module_name}.{name}", hints[name]))
        raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
    return __getattr__


def refused(qualified_name, hint):
    """A class attribute (read, called or assigned) that fails with the hint."""
    def fail(*_):
        raise ReferenceNameError(_message(qualified_name, hint))
    return property(fail, fail)


# ---------------------------------------------------------------------------------------------
# Module-level names, under the module name the reference's code uses

_EXISTS = "write `x is not None`"
_SHIM_LINEAR = "use PEGradNormShimLinear, whose backward adds the norms to weight_sqgradnorm / bias_sqgradnorm"
_FUSED_LINEAR = "use PEGradNormLinear, whose backward computes the weight gradient and the norms together"
_SHIM_EMBEDDING = "use PEGradNormShimEmbedding, whose backward adds the norms to weight_sqgradnorm"
_FUSED_EMBEDDING = "use PEGradNormEmbedding, whose backward builds the weight gradient and the norms together"
_SEPARATED = ("use PEGradNormSeparatedLayerNorm(ndim, bias): its own weight and bias are the affine part "
              "(.affine is the layer itself), measured into weight_sqgradnorm / bias_sqgradnorm")
_SELF_TEST = "use pytest tests/test_layers.py, this fork's tests of the same layers"
_MODULE_WITH_BUFFERS = ("use buffered.MeasuredLayer, the measured layers' shared base; "
                        "register_sqgradnorm_buffers(module) gives a module the buffers, "
                        "find_sqgradnorm_buffers(model) finds them")
_TIED = ("a tied weight is tracked once, under its first name, with the exact per-example norm of its "
         "summed gradient (buffered.tie_weights)")

MODULES = {
    # kept in buffered (nanogns.layers): the five layer classes with the reference's constructor
    # arguments, LayerNorm(ndim, bias), zero_sqgradnorm_buffers(model), weight_pegsqnorm() and
    # bias_pegsqnorm() on the layers, the separated LayerNorm's .affine
    "buffered": {
        "exists": _EXISTS,
        "safe_sum": "use x.sum(dim, keepdim, dtype=torch.float32).to(x.dtype)",
        "safe_sqnorm": "use x.float().square().sum(dim, keepdim).to(x.dtype)",
        "stack_with_ones": "use torch.stack([x, torch.ones_like(x)], dim); this fork keeps the running sum and "
                           "the example count in two buffers, {name}_sqgradnorm and example_count",
        "ModuleWithBuffers": _MODULE_WITH_BUFFERS,
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
    },
    # kept in fused_gns: PEGradNormFusedLayerNorm(ndim, bias) and LayerNorm
    "fused_gns": {
        "ModuleWithBuffers": _MODULE_WITH_BUFFERS,
        "LNShimTest": "use pytest tests/test_fused_gns.py, this fork's tests of the same layer",
    },
    "normgnorm": {
        "layernorm_fwd": "use normgnorm.PEGLayerNorm.apply(x, weight, bias, ...) or normgnorm.layer_norm(x, "
                         "weight, bias, weight_sqgradnorm, bias_sqgradnorm, example_count, eps) (forward and "
                         "backward)",
        "layernorm_bwd": "use normgnorm.PEGLayerNorm.apply (its backward adds the norms) or, for the per-example "
                         "dγ_b, dβ_b themselves, normgnorm.torch_path.per_example_affine_grads",
        "normgnorm_cuda": "use normgnorm.PEGLayerNorm.apply(..., backend='cuda') or a fused layer's "
                          "backend='cuda': the CUDA extension (normgnorm.cuda_ext) is built on first use",
        "current_dir": "use os.path.dirname(normgnorm.__file__)",
        "exists": _EXISTS,
    },
    "gnstracking": {
        "exists": _EXISTS,
        "shared_weights": _TIED,
        "named_parameters_and_buffers": "use buffered.find_sqgradnorm_buffers(model): (name, parameter, "
                                        "sqgradnorm buffer, count buffer) per measured parameter; "
                                        "MeasurementTracker.from_model(model, enforce_coverage=True) checks "
                                        "coverage",
    },
    "tracker": {"exists": _EXISTS},
    "gns_analysis": {
        "analyze_gns": "use analyze(load_log(out_dir)[0], alpha, prefix); its results hold gtg, trsigma, "
                       "gtg_ema, trsigma_ema, gns, sgn, spegn with a bias-corrected EMA (module docstring)",
        "compute_ema": "use debiased_ema(x, alpha): bias-corrected, over the measured steps only "
                       "(the reference's was ewm(adjust=False))",
        "compute_total_norms": "use analyze(df, alpha)'s sgn and spegn columns (the main estimator's summed "
                               "squared norms)",
        "get_aligned_columns": "use find_estimators(df)",
        "unbiased_stats": "use unbiased_estimates(sgn, spegn, B), NaN where B <= 1",
        "create_plots": "use plots(results, df, info)",
    },
    "plot": {
        "plot_metric": "use nanogns.logread.figure([(x, y, label)], x_label, y_label, width=..., height=...), "
                       "or run plot.py LOG_DIR METRIC",
    },
}


def module_refusals(reference_module):
    """The module-level __getattr__ of the module the reference's code imports as `reference_module`."""
    return refuse_module_names(reference_module, MODULES[reference_module])


# ---------------------------------------------------------------------------------------------
# Attributes of classes, under the class's name

_ONE_FILE = "log.csv is written directly by step(); its path is .path"

ATTRIBUTES = {
    # the reference's CSV machinery (a header file and a data file, joined into log.csv at exit):
    # here step() writes log.csv itself, complete after every step
    "LogWrapper": {
        "setup_csv_writer": "nothing to set up: the first step() writes log.csv",
        "write_config": "pass config= to LogWrapper(config=..., out_dir=...), which writes out_dir/config.json",
        "update_header": "step() rewrites log.csv's header when a new key appears",
        "finalize_csv": "nothing to finalize: log.csv is complete after every step(); call close() at the end",
        "csv_writer": _ONE_FILE,
        "csv_data_file": _ONE_FILE,
        "csv_header_file": _ONE_FILE,
        "csv_data_path": _ONE_FILE,
        "csv_header_path": _ONE_FILE,
        "header_updated": "step() rewrites the header as soon as a new key appears; .ordered_keys are the "
                          "columns after 'step'",
        "is_finalized": "log.csv is complete after every step()",
    },
    "MeasurementTracker": {
        "params_and_buffers": "use .entries: (name, parameter, sqgradnorm buffer, count buffer) per parameter",
        "indexes": "use .names (the parameters' names) or .entries",
        "shared_params": _TIED,
    },
    "DDPGradientStatsHook": {
        "bucket_sq_norms_small_batch": "use get_stats() for their mean over ranks, or get_sq_norms() for "
                                       "(sq_small, sq_big)",
    },
    # the reference's separated LayerNorm held its gain and bias in a submodule .affine, after a
    # .layernorm without them; here they are the layer's own (.affine is the layer)
    "PEGradNormSeparatedLayerNorm": {
        "layernorm": "the layer normalises and applies its weight and bias in one call; for the normalisation "
                     "alone use F.layer_norm(x, ln.normalized_shape, None, None, ln.eps)",
    },
}


def refuse_attributes(cls):
    """Class decorator: each attribute ATTRIBUTES lists under cls's name fails when read, called or set."""
    for name, hint in ATTRIBUTES[cls.__name__].items():
        setattr(cls, name, refused(f"{cls.__name__}.{name}", hint))
    return cls


_SUM_AND_COUNT = "(both float32 0-dim)"
LAYER_ATTRIBUTES = {  # every measured layer's (an nn.Module's __getattr__ asks refuse_layer_attribute)
    "weight_upegsqnorm": f"use weight_sqgradnorm (the running sum) and example_count {_SUM_AND_COUNT}, "
                         "or weight_pegsqnorm() for their product",
    "bias_upegsqnorm": f"use bias_sqgradnorm (the running sum) and example_count {_SUM_AND_COUNT}, "
                       "or bias_pegsqnorm() for their product",
    "marked_buffers": "use buffered.find_sqgradnorm_buffers(model): (name, parameter, sum buffer, count buffer) "
                      "per measured parameter",
    "named_buffers_with_marker": "use buffered.find_sqgradnorm_buffers(model): (name, parameter, sum buffer, "
                                 "count buffer) per measured parameter",
    "register_marked_buffer": "use buffered.register_sqgradnorm_buffers(module)",
    "register_upegsqnorm_buffer": "use buffered.register_sqgradnorm_buffers(module)",
}


def refuse_layer_attribute(name):
    """Raise for a measured layer's reference attribute; return for any other name."""
    if name in LAYER_ATTRIBUTES:
        raise ReferenceNameError(_message(f"PEGradNorm*.{name}", LAYER_ATTRIBUTES[name]))


def refuse_tracker_constructor(entries, keywords):
    """The reference's MeasurementTracker(params_and_buffers, names, indexes, callback, scaler,
    shared_params) takes (parameter, buffer) pairs; its keywords reach __new__, never __init__."""
    keywords = {k: v for k, v in keywords.items() if k not in ("callback", "scaler", "world_size")}
    entries = entries if isinstance(entries, (list, tuple)) else ()  # a generator stays for __init__
    if any(len(e) == 2 for e in entries if isinstance(e, (tuple, list))) or \
            set(keywords) & {"names", "indexes", "shared_params"}:
        raise ReferenceNameError(
            "MeasurementTracker(params_and_buffers, names=..., indexes=..., shared_params=...) is the reference "
            "implementation's constructor and is not kept in this fork: use "
            "MeasurementTracker.from_model(model, callback=..., scaler=...)")
    if keywords:
        raise TypeError(f"MeasurementTracker() got unexpected keyword arguments {sorted(keywords)}")
