"""
Gradient noise scale from DDP for free (McCandlish et al. 2018, "An Empirical Model of Large-Batch
Training", App. A, B_small = one rank's batch).

On the micro-step that synchronises, each of the W ranks holds the mean gradient over its own
B_rank examples, a small batch; DDP averages them into the big batch of B = W B_rank. The mean over
ranks of |G_small|^2 and the |G_big|^2 of the average are the two squared norms the estimators
need: no per-example work at all. DDPGNS is this estimator behind the Estimator interface
(nanogns/estimators/base.py); the GradientNoiseScale it smooths with lives in nanogns/maths.py (importable from here, the
reference's place). The helper that makes per-example buffers global, allreduce_sqgradnorm_buffers,
lives beside the buffers in nanogns/layers (importable from here too).
"""
import math

import torch
import torch.distributed as dist

from nanogns.layers import allreduce_sqgradnorm_buffers  # noqa: F401  (its older home was here)
from nanogns.estimators.base import Estimator, Measurement, current_scale
from nanogns.maths import PREFIXES, GradientNoiseScale
from nanogns.refusals import refuse_attributes


@refuse_attributes  # the reference's per-bucket list, not kept (refusals.ATTRIBUTES)
class DDPGradientStatsHook:
    """
    A DDP communication hook that averages gradients exactly as DDP's default hook does and,
    on the way, records the squared norm of each rank's local gradient and of the average.

    The hook only runs on a backward that synchronises (require_backward_grad_sync True, i.e.
    nanoGPT's last micro-step), when each bucket holds the rank's gradient accumulated over all
    micro-steps. Per bucket it records the squared norm of each of its parameters' gradients on
    the device, float32 (float64 for float64 gradients): local before the all-reduce, averaged in
    the all-reduce's then-callback. Nothing is read back per bucket. The sums over parameters are
    taken in the model's parameter order, whatever the buckets: DDP regroups them after its first
    step, and a sum by bucket would round differently in a resumed run's first step than in the
    uninterrupted run's.

    Cost per optimizer step: two extra reads of the gradient (one multi-tensor norm per bucket
    before the all-reduce, one after it), one all_reduce of a single float and one host sync
    for two floats in get_sq_norms(). Micro-steps that do not synchronise cost nothing.

    Under a float16 GradScaler the gradients the hook sees are s times the true ones; pass
    loss_scale=s to get_sq_norms() (or get_stats()), which divides the squared norms by s^2
    (s a float, or the scaler's device tensor: read back with the norms, no extra sync).
    """

    def __init__(self, ddp_model):
        if not hasattr(ddp_model, "register_comm_hook"):
            raise ValueError("DDPGradientStatsHook needs a DistributedDataParallel model")
        self.process_group = ddp_model.process_group
        self.world_size = dist.get_world_size(self.process_group)
        self.order = {id(p): i for i, p in enumerate(ddp_model.module.parameters())}
        self.bucket_params = {}  # bucket index -> the positions in `order` of its parameters
        # bucket index -> its parameters' squared norms. One entry per bucket rather than one running tensor:
        # gloo runs the callbacks on its own threads, where a shared add_ would race.
        self.local_sq = {}
        self.averaged_sq = {}
        # DDP allows one comm hook, registered before the first backward
        ddp_model.register_comm_hook(self.process_group, self._hook)

    def _hook(self, process_group, bucket):
        index = bucket.index()
        grads = bucket.buffer()
        # at least float32 whatever the gradient dtype (bf16/fp16 sums lose digits fast)
        sq_dtype = torch.promote_types(grads.dtype, torch.float32)
        sizes = [g.numel() for g in bucket.gradients()]  # the parameters lie in the buffer one after another

        def sq_norms(flat):
            return torch.stack(torch._foreach_norm(flat[:sum(sizes)].split(sizes), 2, dtype=sq_dtype)).square()

        self.bucket_params[index] = [self.order[id(p)] for p in bucket.parameters()]
        self.local_sq[index] = sq_norms(grads)
        grads.div_(self.world_size)  # divide first, like DDP's default hook: no fp16 overflow
        work = dist.all_reduce(grads, group=process_group, async_op=True)

        def record_average(fut):
            averaged = fut.value()[0]
            self.averaged_sq[index] = sq_norms(averaged)
            return averaged  # DDP copies this into .grad

        return work.get_future().then(record_average)

    def get_sq_norms(self, loss_scale=1.0):
        """
        (sq_small, sq_big) as Python floats: the mean over ranks of ||local gradient||^2
        (each rank's gradient over its own examples) and ||averaged gradient||^2, both summed
        over every bucket, divided by loss_scale^2, and reset for the next step.

        Call it on every rank (it runs one collective) once per optimizer step, after the
        synchronising backward and before scaler.update() changes the scale; where it falls
        relative to scaler.unscale_() or clipping does not matter.
        """
        values, context = self.sums(loss_scale)
        return self.finish(values.tolist(), context)  # the one sync

    @torch.no_grad()
    def sums(self, loss_scale=1.0):
        """get_sq_norms() up to its read: (values, context), values the two sums (and the loss scale,
        a tensor) on the device, finish(values.tolist(), context) get_sq_norms()'s pair. The hook
        starts the next step afresh now."""
        if not self.local_sq or len(self.averaged_sq) != len(self.local_sq):
            raise RuntimeError("DDPGradientStatsHook: no synchronised backward since the last get_sq_norms()/get_stats()")
        buckets = list(self.local_sq)
        local = torch.cat([self.local_sq[b] for b in buckets])
        averaged = torch.cat([self.averaged_sq[b] for b in buckets])
        order = torch.tensor([i for b in buckets for i in self.bucket_params[b]]).argsort().to(local.device)
        local, averaged = local[order].sum(), averaged[order].sum()  # a sum in the parameters' order
        dist.all_reduce(local, group=self.process_group)  # SUM; /W below gives the mean
        values = [local / self.world_size, averaged.to(local.dtype)]
        if isinstance(loss_scale, torch.Tensor):
            values.append(loss_scale.to(device=local.device, dtype=local.dtype).reshape(()))
        # the callbacks' tensors go with the context, freed only once the values are read: with NCCL
        # they live on a side stream the caching allocator would otherwise hand out again
        recorded = (self.local_sq, self.averaged_sq)
        self.local_sq, self.averaged_sq = {}, {}
        return torch.stack(values), (loss_scale, recorded)

    @staticmethod
    def finish(host, context):
        """sums()'s values, read (host), as (sq_small, sq_big) with the loss scale divided out."""
        sq_small, sq_big, *scale = host
        loss_scale = scale[0] if scale else context[0]
        return sq_small / loss_scale ** 2, sq_big / loss_scale ** 2

    def get_stats(self, loss_scale=1.0):
        """sq_small alone, as one float (the reference implementation's return value): see get_sq_norms()."""
        return self.get_sq_norms(loss_scale)[0]


def ddp_gns_log(gns, sq_small, sq_big, n_small, n_big):
    """
    The CSV/wandb row of the DDP estimator, with the reference's column names: the raw
    per-step norms and batch sizes (so the EMA can be re-chosen offline) and the smoothed
    |G|^2, tr(Sigma) and GNS of `gns`, a GradientNoiseScale already updated with this step.
    """
    raw = Measurement(math.sqrt(sq_big), math.sqrt(sq_small), n_big, n_small)
    prefix = PREFIXES['ddp'] + '/'
    return {**raw.msg(prefix=prefix), **gns.get_msg(prefix=prefix)}


class DDPGNS(Estimator):
    """
    The DDP estimator behind the estimators' interface (nanogns.estimators.base): the comm hook on `ddp_model` and its own
    GradientNoiseScale (beta 0.995, the reference's), logged as ddp_gns_log() writes it.
    """
    name = PREFIXES['ddp']
    label = 'ddp gns'
    deferred = False  # its sums are read when collected, each step

    def __init__(self, ddp_model, beta=0.995):
        self.hook = DDPGradientStatsHook(ddp_model)
        self.gns = GradientNoiseScale(beta=beta)

    def sums(self, step, examples, scaler, skipped=None):
        values, context = self.hook.sums(loss_scale=current_scale(scaler))
        return values, (examples, context)

    def finish(self, host, context):
        examples, hooked = context
        n_small = examples // self.hook.world_size  # one rank's examples
        sq_small, sq_big = self.hook.finish(host, hooked)
        self.gns.update(sq_small, sq_big, n_small, examples)
        return ddp_gns_log(self.gns, sq_small, sq_big, n_small, examples)


# ---------------------------------------------------------------------------------------------
# The reference implementation's names (exact/ddpgns.py): DDPGradientStatsHook with its get_stats(),
# and GradientNoiseScale, nanogns.maths' (imported above). The hook's per-bucket
# list is refused at the end of its class.
