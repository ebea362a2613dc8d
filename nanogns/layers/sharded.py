"""
The measured layers under torch.distributed.tensor's tensor and sequence parallelism
(parallelize_module: ColwiseParallel, RowwiseParallel, SequenceParallel), and under context parallelism
(split_tokens, at the end: plain tensors, each example's tokens split over the ranks).

Inside such a module's forward the input, the parameters and the output are DTensors on the TP
mesh (one dimension). A measured layer computes its per-example sums from the local tensors and
notes, per buffer, how the ranks' values combine (note_sharded):
- "sum": the local value is the squared norm of this rank's shard of every example's gradient
  (a colwise weight and bias, a rowwise weight): the whole parameter's is the sum over the group;
- "once": every rank holds the same, whole value (a rowwise Linear's replicated bias, whose
  output gradient is replicated; a normalisation under sequence parallelism, whose [B, D]
  per-example vectors its backward summed over the group before squaring; the example count).
allreduce_sharded_buffers then sums them over each group in one all_reduce, a "once" buffer
counted from the group's first rank alone. Call it on every rank after the last micro-step's
backward, before the data-parallel sum and before the tracker reads the buffers (ExactGNS does).

There both Linear classes run torch's linear and backward on the DTensors (.grad is torch's) and
measure beside it as the shim does; the ghost/materialise choice is made from the global shapes, so
every rank makes the same. Both Embedding classes do the same: a vocabulary-sharded weight (RowwiseParallel)
measures its rows' share of each example's gradient, a feature-sharded one (ColwiseParallel) its columns'. The normalisations, separated and fused alike, normalise with torch's own
and measure from the local tensors. A Linear whose tokens are split over the ranks (its parameters
replicated) is refused in one line: its norm would need the other ranks' activations. Eager mode only:
under torch.compile nothing here runs.

Only a process that made DTensors has torch.distributed.tensor loaded, so the checks cost a dict
read elsewhere.
"""
import sys

import torch

from nanogns.layers.buffers import MeasuredLayer, allreduce_buffers, localise_buffers  # noqa: F401


def dtensor_class():
    """torch's DTensor class where torch.distributed.tensor is loaded, else None."""
    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)


def is_dtensor(t):
    """Whether t is a DTensor; False while torch.compile traces (tensor parallelism is measured eagerly)."""
    if torch.compiler.is_compiling():
        return False
    cls = dtensor_class()
    return cls is not None and isinstance(t, cls)


def feature_sharded(placements, ndim, where):
    """Whether a DTensor of `ndim` dims with `placements` (one mesh dimension) is sharded on its last
    dimension (True) or replicated (False); anything else (tokens or examples split, a partial sum)
    is refused in one line naming `where`."""
    if len(placements) != 1:
        raise RuntimeError(f"{where}: a DTensor on a {len(placements)}-dimensional mesh in the forward; the "
                           "measured layers take one tensor-parallel mesh dimension (FSDP2 gathers its own)")
    pl = placements[0]
    if pl.is_replicate():
        return False
    if pl.is_shard() and pl.dim % ndim == ndim - 1:
        return True
    raise RuntimeError(f"{where}: {pl} over the tensor-parallel mesh: its per-example norms would need the other "
                       "ranks' tokens (only a Linear's features may be sharded; a sequence-parallel LayerNorm or "
                       "RMSNorm is measured by the separated class); leave the layer unmeasured")


def grad_placements(y):
    """The placements the gradient of a layer's DTensor output y must have for the local maths: y's own,
    replicated where y is a partial sum (a rowwise Linear's: the gradient of a sum is every rank's)."""
    from torch.distributed.tensor import Replicate
    return tuple(Replicate() if pl.is_partial() else pl for pl in y.placements)


def local_grad(dy, placements):
    """dy's local tensor, first redistributed to `placements` where it has others."""
    if tuple(dy.placements) != tuple(placements):
        dy = dy.redistribute(placements=placements)
    return dy.to_local()


def note_sharded(module, group, rules):
    """Record on `module` the process group its buffers combine over (the TP mesh's, or the context-parallel
    ranks') and each buffer's rule ("sum" or "once", by buffer name); the buffers themselves stay plain
    local tensors (buffers.localise_buffers)."""
    module.__dict__["_shard_group"] = group
    module.__dict__["_shard_rules"] = rules


@torch.no_grad()
def allreduce_sharded_buffers(modules):
    """Combine the buffers of the sharded measured `modules` (note_sharded) over their TP groups: one
    all_reduce per group of all of them laid end to end, a "once" buffer contributed by the group's
    first rank only. Modules no parallelism touched are left alone; nothing runs without any."""
    by_group = {}
    for module in modules:
        group = module.__dict__.get("_shard_group")
        if group is None:
            continue
        for name, rule in module.__dict__["_shard_rules"].items():
            buf = module._buffers.get(name)
            if buf is not None:
                by_group.setdefault(id(group), (group, {}))[1].setdefault(id(buf), (buf, rule))
    for group, found in by_group.values():
        first = torch.distributed.get_rank(group) == 0
        bufs = []
        for buf, rule in found.values():
            if rule == "once" and not first:
                buf.zero_()
            bufs.append(buf)
        allreduce_buffers(bufs, group=group)


def split_tokens(model, group, average=False):
    """
    Context parallelism: tell the measured layers of `model` that each example's tokens are split over the
    ranks of `group` (the context-parallel process group), the parameters replicated over it and every rank
    holding the same examples. Each rank's per-example gradient of a parameter is then a partial sum over its
    tokens, g_b = sum_r g_b^(r), whose squares do not add. A normalisation sums its per-example [B, D] vectors
    over the group before squaring (one small all_reduce per layer per micro-step, in its backward), and its
    sums then count once over the group. A measured Linear or Embedding would need the other ranks'
    activations: refused here, in one line naming it. Call after measure() and before the first forward, on
    every rank; group None undoes it. Returns the number of normalisations told.
    average: each rank's loss is its tokens' share times the group's size, and the gradient is averaged
    over the group (OLMo-core's context parallelism): the per-example vectors are averaged, not summed.
    """
    told = 0
    for name, module in model.named_modules():
        if not isinstance(module, MeasuredLayer) or not any(
                n.endswith("_sqgradnorm") for n in module._buffers):
            continue
        if not hasattr(module, "normalized_shape"):  # a measured LayerNorm or RMSNorm has one (norms.py)
            raise ValueError(f"split_tokens: {name or 'the model'} ({type(module).__name__}) is measured, but under "
                             "context parallelism its per-example norms would need the other ranks' activations; "
                             "measure the normalisations alone: measure(model, linear=None, embedding=None)")
        if group is None:
            for key in ("_token_group", "_shard_group", "_shard_rules"):
                module.__dict__.pop(key, None)
            continue
        module.__dict__["_token_group"] = (group, 1.0 / torch.distributed.get_world_size(group) if average else 1.0)
        note_sharded(module, group, {n: "once" for n in module._buffers
                                     if n == "example_count" or n.endswith("_sqgradnorm")})
        told += 1
    return told
