"""
Gradient noise scale from micro-batches, the estimator of GPT-NeoX and others: the small batch
is one gradient-accumulation micro-step (on one process), the big batch the accumulated gradient
of the optimizer step (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training",
App. A, with B_small = the micro-batch size instead of 1). Kept to compare with the exact
per-example estimator in the same run.

How, exactly and without a copy of the gradients: a tensor hook on a parameter (p.register_hook)
is called with the gradient arriving from this backward pass *before* it is added into p.grad,
i.e. with the micro-step's own gradient d_k, not the running sum. So sum_k ||d_k||^2 is exact
from one squared-norm reduction per parameter per micro-step. A parameter used twice in the
forward (GPT's tied wte/lm_head weight) gets its hook called once per backward with the summed
gradient, which is what we want. Under DDP the hook sees the process's local gradient (the
all-reduce acts on p.grad after accumulation), with or without no_sync. The hooks sit on the
parameters' gradient accumulation, outside any compiled graph, so torch.compile is unaffected.
Memory: one float32 scalar per parameter tensor. Cost: one extra read of every gradient per
micro-step (about what clip_grad_norm_ costs, once per micro-step instead of once per step).

Scaling: the loss of a micro-step is its mean over b examples divided by m = grad_accum_steps,
so d_k = g_k / m with g_k the micro-batch's mean gradient, and under a float16 GradScaler with
scale s the hooks see s * d_k. With W processes there are M = m W micro-batches of b examples,
the big batch is B = m W b, and
    |G_small|^2 = (1/M) sum_{ranks, k} ||g_k||^2 = (m / W) sum_{ranks, k} ||d_k||^2 / s^2,
    |G_big|^2   = ||p.grad||^2  (after the all-reduce and unscale_, before clipping).
The estimators with B_small = b (McCandlish App. A):
    |G|^2  ~ (B |G_big|^2 - b |G_small|^2) / (B - b),
    tr(S)  ~ (|G_small|^2 - |G_big|^2) / (1/b - 1/B),
undefined when B = b (one micro-step on one process): then the small batch is the big batch.
"""
import torch


class MicrobatchGNS:
    """
    mb = MicrobatchGNS(model)   # hooks every trainable parameter
    ... the step's micro-steps: forward, loss / grad_accum_steps, backward ...
    scaler.unscale_(optimizer)
    log.update(mb.measurements(micro_batch_size=batch_size, loss_scale=scaler.get_scale()))
    ... clip, optimizer step, zero_grad ...
    mb.zero()
    """

    def __init__(self, model):
        # named_parameters() lists a tied parameter once, under its first name
        self.named_params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.sqnorm_sums = [None] * len(self.named_params)  # sum_k ||d_k||^2, float32, on device
        self.micro_steps = [0] * len(self.named_params)  # backward passes that reached p
        self.handles = [p.register_hook(self._hook(i)) for i, (_, p) in enumerate(self.named_params)]

    def _hook(self, i):
        def on_grad(grad):
            with torch.no_grad():
                sq = torch.linalg.vector_norm(grad, dtype=torch.float32).square()
                self.sqnorm_sums[i] = sq if self.sqnorm_sums[i] is None else self.sqnorm_sums[i] + sq
            self.micro_steps[i] += 1
        return on_grad

    def results(self):
        """(name, sum over micro-steps of ||d_k||^2 as the hooks saw it, micro-steps) per
        parameter that got a gradient since the last zero(); tensors stay on the device."""
        return [(n, s, k) for (n, _), s, k in zip(self.named_params, self.sqnorm_sums, self.micro_steps)
                if s is not None]

    @torch.no_grad()
    def measurements(self, micro_batch_size, loss_scale=1.0, prefix='train/microbatch_gns'):
        """
        The step's measurements in the tracker's CSV schema, a dict of floats:
          {prefix}/{name}/norm              |G_big| = ||p.grad||
          {prefix}/{name}/pegn              |G_small|, the RMS norm of the micro-batch mean gradients
          {prefix}/{name}/batch_size        B, examples of the optimizer step over all processes
          {prefix}/{name}/small_batch_size  b = micro_batch_size (per process), the small batch
        The analysis must use small_batch_size as B_small (the exact trackers' columns have
        B_small = 1 and no such column). Call after the last backward and scaler.unscale_, before
        clipping; loss_scale = the GradScaler scale of this step (scaler.get_scale()). Under DDP
        call it on every rank (one all-reduce). One host transfer.
        """
        kept = [i for i, s in enumerate(self.sqnorm_sums) if s is not None]
        if not kept:
            return {}
        m = max(self.micro_steps)  # the loss divisor: every micro-step reaches nearly every parameter
        device = self.sqnorm_sums[kept[0]].device
        sums = torch.stack([self.sqnorm_sums[i].to(device) for i in kept])
        dist = torch.distributed
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if world_size > 1:
            dist.all_reduce(sums)
        small_sq = sums * m / world_size / loss_scale ** 2
        norms = []
        for i in kept:
            grad = self.named_params[i][1].grad
            norms.append(torch.linalg.vector_norm(grad, dtype=torch.float32).to(device) if grad is not None
                         else torch.zeros((), dtype=torch.float32, device=device))
        norms, small = torch.stack([torch.stack(norms), small_sq.sqrt()]).tolist()
        big_batch = m * world_size * micro_batch_size
        out = {}
        for i, norm, pegn in zip(kept, norms, small):
            name = self.named_params[i][0]
            out[f"{prefix}/{name}/norm"] = norm
            out[f"{prefix}/{name}/pegn"] = pegn
            out[f"{prefix}/{name}/batch_size"] = big_batch
            out[f"{prefix}/{name}/small_batch_size"] = micro_batch_size
        return out

    def zero(self):
        """Forget the step's sums (after each optimizer step)."""
        self.sqnorm_sums = [None] * len(self.named_params)
        self.micro_steps = [0] * len(self.named_params)

    def remove(self):
        """Take the hooks off the parameters."""
        for h in self.handles:
            h.remove()
        self.handles = []
