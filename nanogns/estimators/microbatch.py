"""
Gradient noise scale from micro-batches, the estimator of GPT-NeoX and others: the small batch is
one gradient-accumulation micro-step of b examples on one process, the big batch the optimizer
step's B (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training", App. A, with
B_small = b). Kept to compare with the exact per-example estimator in the same run.

A tensor hook on each parameter sees the micro-step's own gradient d_k before it is added into
p.grad (a tied weight's once, summed), so sum_k ||d_k||^2 costs one squared norm per parameter and
micro-step, and no copy. With m micro-steps per process (the loss divided by m), W processes and a
GradScaler scale s, the mean squared norm of the micro-batch mean gradients is
|G_b|^2 = (m / W) sum_{ranks, k} ||d_k||^2 / s^2. Undefined where B = b (one micro-step, one process).
"""
import torch

from nanogns.estimators.base import Estimator, current_scale, distributed_world_size, read_now
from nanogns.maths import PREFIXES, parameter_columns


class MicrobatchGNS:
    """
    mb = MicrobatchGNS(model)   # hooks every trainable parameter
    ... the step's micro-steps: forward, loss / grad_accum_steps, backward ...
    scaler.unscale_(optimizer)
    log.update(mb.measurements(micro_batch_size=batch_size, loss_scale=scaler.get_scale()))
    ... clip, optimizer step, zero_grad ...
    mb.zero()
    (MicrobatchEstimator below does the same behind the estimators' interface, before unscale_.)
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
    def measurements(self, micro_batch_size, loss_scale=1.0, prefix=PREFIXES['microbatch'], grad_scale=1.0):
        """
        The step's measurements in the tracker's CSV schema (nanogns.maths.parameter_columns), floats:
          {prefix}/{name}/norm              |G_big| = ||p.grad||
          {prefix}/{name}/pegn              |G_small|, the RMS norm of the micro-batch mean gradients
          {prefix}/{name}/batch_size        B, examples of the optimizer step over all processes
          {prefix}/{name}/small_batch_size  b = micro_batch_size (per process), the small batch
        Call after the last backward, before clipping. loss_scale: the GradScaler scale s of this
        step's backward (a float, or the scaler's device tensor); grad_scale: the scale p.grad still
        carries, 1.0 after scaler.unscale_, s before it. Under DDP call it on every rank (one
        all-reduce). One host transfer.
        """
        values, context = self.sums(micro_batch_size, loss_scale, prefix, grad_scale)
        return self.finish(read_now(values), context)

    @torch.no_grad()
    def sums(self, micro_batch_size, loss_scale=1.0, prefix=PREFIXES['microbatch'], grad_scale=1.0):
        """measurements() up to its read: (values, context), values the norms on the device (None when
        no parameter got a gradient) and finish(values.tolist(), context) measurements()' dict."""
        kept = [i for i, s in enumerate(self.sqnorm_sums) if s is not None]
        if not kept:
            return None, None
        m = max(self.micro_steps)  # the loss divisor: every micro-step reaches nearly every parameter
        device = self.sqnorm_sums[kept[0]].device
        squares = torch.stack([self.sqnorm_sums[i].to(device) for i in kept])
        world_size = distributed_world_size()
        if world_size > 1:
            torch.distributed.all_reduce(squares)
        small_sq = squares * m / world_size / loss_scale ** 2
        norms = []
        for i in kept:
            grad = self.named_params[i][1].grad
            norms.append(torch.linalg.vector_norm(grad, dtype=torch.float32).to(device) if grad is not None
                         else torch.zeros((), dtype=torch.float32, device=device))
        values = torch.cat([torch.stack(norms) / grad_scale, small_sq.sqrt()])
        names = [self.named_params[i][0] for i in kept]
        return values, (names, m * world_size * micro_batch_size, micro_batch_size, prefix)

    @staticmethod
    def finish(host, context):
        """sums()'s values, read (host), as measurements()' columns."""
        if context is None:
            return {}
        names, big_batch, micro_batch_size, prefix = context
        out = {}
        for name, norm, pegn in zip(names, host[:len(names)], host[len(names):]):
            out.update(parameter_columns(prefix, name, norm, pegn, big_batch, micro_batch_size))
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


class MicrobatchEstimator(Estimator):
    """The micro-batch estimator behind the estimators' interface: b = B / (micro-steps * processes)."""
    name = PREFIXES['microbatch']
    deferred = False  # its sums are read when collected, each step

    def __init__(self, model):
        self.mb = MicrobatchGNS(model)

    def sums(self, step, examples, scaler, skipped=None):
        micro_steps = max(self.mb.micro_steps, default=0)
        if micro_steps == 0:
            return None, None
        scale = current_scale(scaler)  # p.grad is not unscaled yet: it carries the scale too
        micro_batch_size = examples // (micro_steps * distributed_world_size())
        return self.mb.sums(micro_batch_size, loss_scale=scale, grad_scale=scale)

    def finish(self, host, context):
        return self.mb.finish(host, context)

    def reset(self):
        self.mb.zero()
