"""
The measured layers under torch.distributed.tensor's tensor and sequence parallelism
(parallelize_module: ColwiseParallel, RowwiseParallel, SequenceParallel).

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
every rank makes the same. The normalisations, separated and fused alike, normalise with torch's own
and measure from the local tensors. A Linear whose tokens are split over the ranks (its parameters
replicated) is refused in one line: its norm would need the other ranks' activations. Eager mode only:
under torch.compile nothing here runs.

Only a process that made DTensors has torch.distributed.tensor loaded, so the checks cost a dict
read elsewhere.
"""
import sys

import torch

from nanogns.layers.buffers import allreduce_buffers, localise_buffers  # noqa: F401


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


def note_sharded(module, mesh, rules):
    """Record on `module` the TP mesh its buffers combine over and each buffer's rule ("sum" or "once",
    by buffer name); the buffers themselves stay plain local tensors (buffers.localise_buffers)."""
    module.__dict__["_shard_mesh"] = mesh
    module.__dict__["_shard_rules"] = rules


@torch.no_grad()
def allreduce_sharded_buffers(modules):
    """Combine the buffers of the sharded measured `modules` (note_sharded) over their TP groups: one
    all_reduce per group of all of them laid end to end, a "once" buffer contributed by the group's
    first rank only. Modules no parallelism touched are left alone; nothing runs without any."""
    by_mesh = {}
    for module in modules:
        mesh = module.__dict__.get("_shard_mesh")
        if mesh is None:
            continue
        for name, rule in module.__dict__["_shard_rules"].items():
            buf = module._buffers.get(name)
            if buf is not None:
                by_mesh.setdefault(id(mesh), (mesh, {}))[1].setdefault(id(buf), (buf, rule))
    for mesh, found in by_mesh.values():
        first = mesh.get_local_rank() == 0
        bufs = []
        for buf, rule in found.values():
            if rule == "once" and not first:
                buf.zero_()
            bufs.append(buf)
        allreduce_buffers(bufs, group=mesh.get_group())
