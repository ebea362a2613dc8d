"""
The small interface every gradient-noise-scale estimator offers train.py's loop (Estimator), and
what each one reads from the run besides the gradients: the loss scale, the processes, the plain
model inside its wrappers, and one parameter's norms at one step (Measurement). The step every
estimator takes, its sums measured on the device now and finished on the host when the loop reads
them, is written here once (Estimator.measure and Estimator.collect).

A leaf: it imports torch and nanogns.maths only, so the estimators (exact.ExactGNS, ddp.DDPGNS,
microbatch.MicrobatchEstimator, hooks.HooksEstimator) import it, and exact.py, which builds them
all, imports them, with no circle.
"""
import dataclasses

import torch

from nanogns.maths import KINDS


class Estimator:
    """
    What train.py's loop calls on every estimator, on every rank:
        measure(step, examples, scaler) -> dict   after the step's last backward (and DDP's
            all-reduce), before scaler.unscale_ and clipping (it may run collectives); examples is
            B, over all ranks and micro-steps; scaler the GradScaler (enabled or not), whose scale
            the estimator divides out. Returns this step's log.csv columns, floats.
        collect(step, examples, scaler, skipped) -> (values, finish)   measure(), its read of the
            device left for when the loop logs (pending.PendingSteps)
        reset()              after the optimizer step: zero the step's sums
        status() -> str      its part of the status line, e.g. "gns 12.3" ('' if none)
        state_dict() / load_state_dict(state)   what a checkpoint keeps (a live EMA)
    name is its CSV prefix and its key among a checkpoint's states (save_states); an estimator
    with a live GNS keeps it in gns, a GradientNoiseScale, shown on the status line after label.
    skipped_steps counts the steps it could not measure (non-finite gradients).

    measure() and collect() are written here, once; an estimator writes the two parts they join:
        sums(step, examples, scaler, skipped) -> (values, context)   now, on the device: the
            step's sums in one 1-D device tensor (None: nothing to read), and what finishing
            them needs besides (None: nothing measured)
        finish(host, context) -> dict   later, on the host, in step order: values.tolist() made
            into the row, with the EMA update and the skipped count
    deferred False: collect() reads and finishes at once, and the loop waits for the device.
    """
    name = None
    label = None
    gns = None
    skipped_steps = 0
    deferred = True

    def sums(self, step, examples, scaler, skipped=None):
        raise NotImplementedError

    def finish(self, host, context):
        raise NotImplementedError

    def measure(self, step, examples, scaler):
        values, context = self.sums(step, examples, scaler)
        return self.finish(read_now(values), context)

    def collect(self, step, examples, scaler, skipped=None):
        """measure() with its read deferred: (values, finish), values sums()'s and finish(host) the
        row, given values.tolist(); called in step order, before the next state_dict() or status().
        skipped: the optimizer's decision for the step (a 0-dim device tensor, non-zero when it
        skips it), for an estimator to follow."""
        values, context = self.sums(step, examples, scaler, skipped)
        if not self.deferred:
            row = self.finish(read_now(values), context)
            return None, lambda host: row
        return values, lambda host: self.finish(host, context)

    def reset(self):
        pass

    def status(self):
        return "" if self.gns is None else f"{self.label} {self.gns.get_gns():.4g}"

    def state_dict(self):
        return {} if self.gns is None else self.gns.state_dict()

    def load_state_dict(self, state):
        if self.gns is not None:
            self.gns.load_state_dict(state)
        elif state:
            raise ValueError(f"the {self.name} estimator keeps no state, got {sorted(state)}")


def read_now(values):
    """A step's sums brought to the host at once, as finish() takes them: values.tolist() ([] for None)."""
    return [] if values is None else values.tolist()


def current_scale(scaler):
    """The GradScaler's current scale s (gradients carry s, per-example sums s^2): a device tensor
    when possible, so dividing it out costs no host sync; 1.0 for none or a disabled one."""
    if scaler is None or not scaler.is_enabled():
        return 1.0
    # GradScaler keeps its scale as a device tensor, created by the first scaler.scale();
    # get_scale() would call .item() on it, a second host-device sync per step.
    scale = getattr(scaler, "_scale", None)
    return scale if isinstance(scale, torch.Tensor) else float(scaler.get_scale())


def distributed_world_size():
    """The processes of the default process group; 1 without torch.distributed."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


@dataclasses.dataclass
class Measurement:
    """One parameter's norms at one step: |G_B| (big_batch_norm) and |G_1| (small_batch_norm)."""
    big_batch_norm: float
    small_batch_norm: float
    big_batch_size: int
    small_batch_size: int
    metadata: dict = None  # from the tracker: "name" and "step"

    def msg(self, prefix=""):
        """The four numbers as a logger row, e.g. msg("ddp/") -> {"ddp/big_batch_norm": ..., ...}; no metadata."""
        return {prefix + field: getattr(self, field) for field in KINDS.values()}

    def __str__(self):
        meta = self.metadata or {}
        where = ", ".join(f"{key} {meta[key]}" for key in ("name", "step") if key in meta)
        return (f"{where + ': ' if where else ''}|G_B| {self.big_batch_norm:.4g} over {self.big_batch_size} examples, "
                f"|G_b| {self.small_batch_norm:.4g} over {self.small_batch_size}")


def unwrap(model):
    # Parameter names must be those of the plain model (they are the CSV column names), not the
    # "module." / "_orig_mod." prefixed ones of a DDP or torch.compile wrapper.
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
            model = model._orig_mod
        else:
            return model
