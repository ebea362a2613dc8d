"""
Gradient noise scale from DDP for free, and the helper that makes per-example buffers global.

The DDP estimator (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training",
arXiv:1812.06162, App. A). On the micro-step that synchronises, each of the W ranks holds its
own accumulated gradient, the mean over its B_rank examples: a "small batch" gradient. DDP
averages them into the "big batch" gradient of B = W * B_rank examples. For a batch of n
examples E|G_n|^2 = |G|^2 + tr(Sigma)/n, so the mean over ranks of |G_small|^2 and the
|G_big|^2 of the average give two equations in the two unknowns |G|^2 and tr(Sigma).
All of it comes from the gradients DDP already has in hand: no per-example work at all.

In train.py (every rank runs all of it; see each docstring for the why):

    hook = DDPGradientStatsHook(model)            # right after model = DDP(...)
    ddp_gns = GradientNoiseScale()                # load_state_dict(ckpt['ddp_gns']) on resume
    ... micro-steps, the last one synchronises ...
    sq_small, sq_big = hook.get_sq_norms(loss_scale=scaler.get_scale())   # before scaler.update()
    ddp_gns.update(sq_small, sq_big, B_rank, W * B_rank)
    log(ddp_gns_log(ddp_gns, sq_small, sq_big, B_rank, W * B_rank))   # master only
"""
import math

import torch
import torch.distributed as dist

from gnstracking import Measurement
from reference_names import refused


class DDPGradientStatsHook:
    """
    A DDP communication hook that averages gradients exactly as DDP's default hook does and,
    on the way, records the squared norm of each rank's local gradient and of the average.

    The hook only runs on a backward that synchronises (require_backward_grad_sync True, i.e.
    nanoGPT's last micro-step), when each bucket holds the rank's gradient accumulated over all
    micro-steps. Per bucket it records two 0-dim tensors on the device, float32 (float64 for
    float64 gradients): ||local bucket||^2 before the all-reduce and ||averaged bucket||^2 in
    the all-reduce's then-callback. Nothing is read back per bucket.

    Cost per optimizer step: two extra reads of the gradient (one norm kernel per bucket
    before the all-reduce, one after it), one all_reduce of a single float and one host sync
    for two floats in get_sq_norms(). Micro-steps that do not synchronise cost nothing.

    Under a float16 GradScaler the gradients the hook sees are s times the true ones; pass
    loss_scale=s to get_sq_norms() (or get_stats()), which divides the squared norms by s^2.
    """

    def __init__(self, ddp_model):
        if not hasattr(ddp_model, "register_comm_hook"):
            raise ValueError("DDPGradientStatsHook needs a DistributedDataParallel model")
        self.process_group = ddp_model.process_group
        self.world_size = dist.get_world_size(self.process_group)
        # bucket index -> 0-dim tensor. One entry per bucket rather than one running tensor:
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
        self.local_sq[index] = torch.linalg.vector_norm(grads, dtype=sq_dtype).square()
        grads.div_(self.world_size)  # divide first, like DDP's default hook: no fp16 overflow
        work = dist.all_reduce(grads, group=process_group, async_op=True)

        def record_average(fut):
            averaged = fut.value()[0]
            self.averaged_sq[index] = torch.linalg.vector_norm(averaged, dtype=sq_dtype).square()
            return averaged  # DDP copies this into .grad

        return work.get_future().then(record_average)

    @torch.no_grad()
    def get_sq_norms(self, loss_scale=1.0):
        """
        (sq_small, sq_big) as Python floats: the mean over ranks of ||local gradient||^2
        (each rank's gradient over its own examples) and ||averaged gradient||^2, both summed
        over every bucket, divided by loss_scale^2, and reset for the next step.

        Call it on every rank (it runs one collective) once per optimizer step, after the
        synchronising backward and before scaler.update() changes the scale; where it falls
        relative to scaler.unscale_() or clipping does not matter.
        """
        if not self.local_sq or len(self.averaged_sq) != len(self.local_sq):
            raise RuntimeError("DDPGradientStatsHook: no synchronised backward since the last get_sq_norms()/get_stats()")
        local = sum(self.local_sq.values())  # a few adds on the device, one per bucket
        averaged = sum(self.averaged_sq.values())
        dist.all_reduce(local, group=self.process_group)  # SUM; /W below gives the mean
        sq_small, sq_big = torch.stack([local / self.world_size, averaged.to(local.dtype)]).tolist()  # the one sync
        # freed only now that the device is done with them: with NCCL the callbacks' tensors
        # live on a side stream the caching allocator would otherwise hand out again
        self.local_sq.clear()
        self.averaged_sq.clear()
        return sq_small / loss_scale ** 2, sq_big / loss_scale ** 2

    def get_stats(self, loss_scale=1.0):
        """sq_small alone, as one float (the reference implementation's return value): see get_sq_norms()."""
        return self.get_sq_norms(loss_scale)[0]

    # the reference implementation's per-bucket list, not kept here
    bucket_sq_norms_small_batch = refused("DDPGradientStatsHook.bucket_sq_norms_small_batch",
                                          "use get_stats() for their mean over ranks, or get_sq_norms() for "
                                          "(sq_small, sq_big)")


class GradientNoiseScale:
    """
    The simple gradient noise scale B_simple = tr(Sigma) / |G|^2 from two batch sizes
    (McCandlish et al. 2018, App. A), smoothed the way k-diffusion does it: an exponential
    moving average of each unbiased estimate, debiased for its start at zero like Adam's,
    and the GNS is the ratio of the two averages (never an average of ratios, which is biased).

    ema_sq_norm, ema_var: the EMAs of the |G|^2 and tr(Sigma) estimates, biased towards their
    start at 0; beta_cumprod: beta^updates, so the debiasing factor is 1 - beta_cumprod;
    gradient_noise_scale: the GNS after the last update (NaN before the first).
    Both averages may dip below zero from noise early on; get_stats() reports them as they are,
    the GNS clamps each (biased) average to eps first, so a GNS of ~0 or ~1/eps flags an
    average that did. (The debiasing factor cancels in the ratio.)
    """

    def __init__(self, beta=0.995, eps=1e-8):
        self.beta = beta
        self.eps = eps
        self.ema_sq_norm = 0.0
        self.ema_var = 0.0
        self.beta_cumprod = 1.0
        self.gradient_noise_scale = float('nan')

    def update(self, sq_small, sq_big, n_small, n_big):
        """
        Add one step: sq_small is the mean squared norm of gradients over n_small examples each,
        sq_big the squared norm of their mean over n_big examples. A non-finite input (a float16
        overflow step, which GradScaler skips too) is ignored. Returns the current GNS.
        """
        if not 0 < n_small < n_big:
            raise ValueError(f"GradientNoiseScale needs 0 < n_small < n_big, got {n_small} and {n_big}")
        if not (math.isfinite(sq_small) and math.isfinite(sq_big)):
            return self.gradient_noise_scale
        # E|G_n|^2 = |G|^2 + tr(Sigma)/n at n = n_small and n = n_big, solved for both unknowns
        sq_norm = (n_big * sq_big - n_small * sq_small) / (n_big - n_small)
        var = (sq_small - sq_big) / (1 / n_small - 1 / n_big)
        self.ema_sq_norm = self.beta * self.ema_sq_norm + (1 - self.beta) * sq_norm
        self.ema_var = self.beta * self.ema_var + (1 - self.beta) * var
        self.beta_cumprod *= self.beta
        self.gradient_noise_scale = self._ratio()
        return self.gradient_noise_scale

    def _ratio(self):
        return max(self.ema_var, self.eps) / max(self.ema_sq_norm, self.eps)

    def get_stats(self):
        """(|G|^2, tr(Sigma)): the debiased EMAs; NaN before the first update."""
        if self.beta_cumprod == 1.0:
            return float('nan'), float('nan')
        debias = 1 - self.beta_cumprod
        return self.ema_sq_norm / debias, self.ema_var / debias

    def get_gns(self):
        """EMA(tr(Sigma)) / EMA(|G|^2), each clamped to eps; NaN before the first update."""
        return self.gradient_noise_scale

    def get_msg(self, prefix=''):
        """{prefix}gtg, {prefix}trsigma (the debiased EMAs) and {prefix}gns, for a logger row."""
        gtg, trsigma = self.get_stats()
        return {f'{prefix}gtg': gtg, f'{prefix}trsigma': trsigma, f'{prefix}gns': self.get_gns()}

    def state_dict(self):
        return dict(beta=self.beta, eps=self.eps, ema_sq_norm=self.ema_sq_norm, ema_var=self.ema_var,
                    beta_cumprod=self.beta_cumprod, gradient_noise_scale=self.gradient_noise_scale)

    def load_state_dict(self, state):
        """Loads state_dict()'s dict, or that of this fork's older checkpoints (ema_gtg, ema_trsigma)."""
        state = dict(state)
        for old, new in (('ema_gtg', 'ema_sq_norm'), ('ema_trsigma', 'ema_var')):
            if old in state:
                state[new] = state.pop(old)
        unknown = set(state) - set(self.state_dict())
        if unknown:
            raise ValueError(f"GradientNoiseScale.load_state_dict: unknown keys {sorted(unknown)}")
        # beta comes back too: beta_cumprod only debiases the EMAs for the beta that made them
        for key, value in state.items():
            setattr(self, key, value)
        if 'gradient_noise_scale' not in state:  # older checkpoints did not store it
            self.gradient_noise_scale = float('nan') if self.beta_cumprod == 1.0 else self._ratio()


def ddp_gns_log(gns, sq_small, sq_big, n_small, n_big):
    """
    The CSV/wandb row of the DDP estimator, with the reference's column names: the raw
    per-step norms and batch sizes (so the EMA can be re-chosen offline) and the smoothed
    |G|^2, tr(Sigma) and GNS of `gns`, a GradientNoiseScale already updated with this step.
    """
    raw = Measurement(math.sqrt(sq_big), math.sqrt(sq_small), n_big, n_small)
    return {**raw.msg(prefix='ddp/'), **gns.get_msg(prefix='ddp/')}


@torch.no_grad()
def allreduce_sqgradnorm_buffers(model, group=None):
    """
    Sum every per-example-norm buffer (the `{param}_sqgradnorm` and `example_count` buffers of
    buffered.py's convention) over the ranks of `group`, in place, with one all_reduce of all
    of them stacked into one tensor. Call it on every rank after the last micro-step's backward,
    before the tracker reads the buffers (and before they are zeroed).

    Afterwards each count is the global batch B = W * B_rank, and each sum is
    S = sum over ranks of sum_b ||g_b / B_rank||^2: every rank's layers saw the gradient of its
    own rank's mean loss, not of the global one. The mean per-example squared norm is then
        |G_1|^2 = (B_rank^2 / B) * S = B * S / W^2,
    so the tracker must know W (the naive B * S is W^2 times too large). Under a float16
    GradScaler S is still s^2 times too large, as on one process.
    """
    bufs, seen = [], set()
    for module in model.modules():
        if "example_count" not in module._buffers:
            continue
        for name, buf in module._buffers.items():
            if buf is not None and id(buf) not in seen and (name == "example_count" or name.endswith("_sqgradnorm")):
                seen.add(id(buf))
                bufs.append(buf)
    if not bufs:
        return
    stacked = torch.stack(bufs)  # all float32 0-dim by the convention
    dist.all_reduce(stacked, group=group)
    torch._foreach_copy_(bufs, list(stacked.unbind()))
