"""
nanogns: exact per-example gradient norms, and from them the gradient noise scale (GNS), as a side
effect of the ordinary backward pass (Gray et al. 2024, "Normalization Layer Per-Example Gradients
are Sufficient to Predict Gradient Noise Scale in Transformers"; McCandlish et al. 2018 for the GNS).

    from nanogns import GNSMeter          # any training loop: one object, one call per step
    from nanogns.hf import GNSCallback    # Hugging Face's Trainer   (pip install "nanogns[hf]")
    from nanogns.lightning import GNSCallback  # Lightning         (pip install "nanogns[lightning]")
    from nanogns import measure           # put the measured layers into any model
    from nanogns.olmo import GNSCallback  # OLMo-core's Trainer     (pip install "nanogns[olmo]")

The package's parts:
    layers/      the measured Linear, Embedding, LayerNorm, RMSNorm and MoE experts, their buffers, measure()
    normgnorm/   the fused LayerNorm/RMSNorm kernels (Triton, CUDA C++, C, PyTorch)
    estimators/  the GNS estimators a run can log (exact per-example, DDP, micro-batch, hooks, Adam)
    meter.py     GNSMeter, the loop object;  hf.py, lightning.py  the callbacks built on it
    runlog.py    the run's log (log.csv, wandb, the printed line);  pending.py  deferred device reads
    maths.py     the GNS maths and log.csv's column names (no torch);  logread.py  reading log.csv back
    analysis.py  the offline analysis of a log, the `gns-analysis` command (commands.py; no torch);
                 figures.py  its PNG figures;  extras.py  the one-line refusal where an extra is missing
    schedules.py, stopping.py  train.py's schedules and its stop on a signal
    refusals.py  the reference implementation's names that are not kept, each with what to use instead
"""
import importlib

__version__ = "0.1.0"

# the public names, imported on first use: `import nanogns.maths` (the offline analysis) loads no torch
_PUBLIC = {
    "GNSMeter": "nanogns.meter",
    "GNSMeterError": "nanogns.meter",
    "measure": "nanogns.layers",
    "find_sqgradnorm_buffers": "nanogns.layers",
    "split_tokens": "nanogns.layers",  # context parallelism: the normalisations' per-example vectors summed over it
    # every class measure() builds (nanogns.layers.MEASURED_CLASSES)
    "PEGradNormLinear": "nanogns.layers",
    "PEGradNormShimLinear": "nanogns.layers",
    "PEGradNormEmbedding": "nanogns.layers",
    "PEGradNormShimEmbedding": "nanogns.layers",
    "PEGradNormSeparatedLayerNorm": "nanogns.layers",
    "PEGradNormFusedLayerNorm": "nanogns.layers",
    "PEGradNormSeparatedRMSNorm": "nanogns.layers",
    "PEGradNormFusedRMSNorm": "nanogns.layers",
    "PEGradNormExperts": "nanogns.layers",
    "Experts": "nanogns.layers",  # a mixture of experts' routed MLPs, unmeasured (PEGradNormExperts measures them)
    "GradientNoiseScale": "nanogns.maths",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'nanogns' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))
