"""
Turns the per-example-norm buffers and the gradients into gradient noise scale measurements.

After the last micro-step of an optimizer step (and after any DDP all-reduce, before gradient
clipping and before scaler.unscale_), for every measured parameter p:

    big batch    |G_B|^2 = ||p.grad||^2                        (the minibatch gradient, B examples)
    small batch  |G_1|^2 = (1/B) sum_b ||g_b||^2               (mean squared per-example gradient)

where g_b is the gradient of example b's own loss l_b and the training loss is L = (1/B) sum_b l_b.
The layers see the gradient of L, so their buffer holds S = sum_b ||g_b / B||^2 and
|G_1|^2 = B * S. Under DDP over W ranks with B_rank = B / W examples each, every rank's buffer
holds sum_b ||g_b / B_rank||^2 over its own examples; once buffers and counts are summed over
ranks, |G_1|^2 = (B_rank^2 / B) * S_sum = B * S_sum / W^2 (B * S_sum would be W^2 too large).

These two are the B_big = B, B_small = 1 case of McCandlish et al. 2018, "An Empirical Model of
Large-Batch Training", App. A, whose unbiased estimators

    |G|^2  ~ (B |G_B|^2 - |G_1|^2) / (B - 1)
    tr(S)  ~ (|G_1|^2 - |G_B|^2) / (1 - 1/B)

and the noise scale B_simple = tr(S) / |G|^2 are computed offline by gns-analysis.py, after
smoothing numerator and denominator separately. What is logged per parameter and step is only the
raw |G_B| ("norm"), |G_1| ("pegn", per-example gradient norm) and B ("batch_size").

Usage in a training loop:

    gns_logs = AccumulateMeasurements(prefix="train/gns/")
    gns_tracker = MeasurementTracker.from_model(model, callback=gns_logs, scaler=scaler)
    ...  # micro-steps: scaler.scale(loss / grad_accum_steps).backward()
    gns_tracker.step(batch_size=B)     # reads, then zeroes, every per-example-norm buffer
    ...  # scaler.unscale_, clipping, scaler.step, scaler.update
    logger.log(gns_logs.pop())
"""
import dataclasses
import math

import torch

from buffered import find_sqgradnorm_buffers, sum_of_squares
from reference_names import ReferenceNameError, refuse_module_names, refused


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
        return {prefix + f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "metadata"}

    def __str__(self):
        meta = self.metadata or {}
        where = ", ".join(f"{key} {meta[key]}" for key in ("name", "step") if key in meta)
        return (f"{where + ': ' if where else ''}|G_B| {self.big_batch_norm:.4g} over {self.big_batch_size} examples, "
                f"|G_b| {self.small_batch_norm:.4g} over {self.small_batch_size}")


def _unwrap(model):
    # Parameter names must be those of the plain model (they are the CSV column names), not the
    # "module." / "_orig_mod." prefixed ones of a DDP or torch.compile wrapper.
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
            model = model._orig_mod
        else:
            return model


class MeasurementTracker:
    """
    Reads, once per optimizer step, every measured parameter's gradient and per-example-norm
    buffer, and emits one Measurement per parameter.

    entries: list of (name, parameter, sqgradnorm buffer, count buffer), as returned by
        buffered.find_sqgradnorm_buffers; from_model() finds them.
    callback: None, a callable, or a list of callables; each is called with every Measurement.
        A callback may return a replacement Measurement (or any object) to be returned by step()
        in place of the original; at most one callback may do so per measurement.
    scaler: the torch.amp.GradScaler in use, if any; its scale s is divided out (grads carry s,
        buffers s^2). A disabled scaler is the same as none.
    world_size: number of DDP ranks whose buffers and counts have been summed (all-reduced)
        before step() is called; 1 without DDP.

    measurements: every Measurement kept, over all steps: each one when there is no callback,
        else what a callback returned (train.py's AccumulateMeasurements returns nothing, so it
        stays empty). Without a callback it grows by one per parameter per step: clear it.
    step_count: the calls to step() so far; the default "step" in the metadata.
    skipped_steps: steps with an inf/nan gradient or buffer (see step()).

    Zeroing: step() zeroes every buffer it tracks after reading it, on every call, including
    steps it skips. On an optimizer step where step() is not called, the caller must call
    buffered.zero_sqgradnorm_buffers(model) instead, or the next step sees two steps' sums
    (which step() then reports as a count mismatch).
    """

    def __init__(self, entries, callback=None, scaler=None, world_size=1, **reference_keywords):
        entries = list(entries)
        _refuse_reference_constructor(entries, reference_keywords)
        if not all(isinstance(e, (tuple, list)) and len(e) == 4 for e in entries):
            raise ValueError("MeasurementTracker entries are (name, parameter, sqgradnorm buffer, count buffer) "
                             "tuples, as buffered.find_sqgradnorm_buffers returns; or use MeasurementTracker.from_model")
        self.entries = entries
        self.callback = callback
        self.scaler = scaler
        self.world_size = int(world_size)
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.step_count = 0
        self.skipped_steps = 0
        self.measurements = []
        # the count buffer is shared by all parameters of a module: zero each buffer once
        unique = {}
        for _, _, sq, count in self.entries:
            unique[id(sq)], unique[id(count)] = sq, count
        self._buffers = list(unique.values())

    @classmethod
    def from_model(cls, model, callback=None, enforce_coverage=False, scaler=None, world_size=1):
        """
        Track every trainable parameter of `model` (or of the model inside a DDP/compile wrapper)
        that has buffers. enforce_coverage: raise a ValueError if a trainable parameter has none.
        """
        model = _unwrap(model)
        entries = find_sqgradnorm_buffers(model)
        if not entries:
            raise ValueError("the model has no per-example gradient norm buffers: build it with the "
                             "per-example-norm layer classes (layer_config.set_contextual_config)")
        if enforce_coverage:
            measured = {id(p) for _, p, _, _ in entries}
            for name, p in model.named_parameters():
                if p.requires_grad and id(p) not in measured:
                    raise ValueError(f"enforce_coverage: the trainable parameter {name} has no per-example "
                                     f"gradient norm buffer (its layer is not a per-example-norm class, or it is "
                                     f"a tied weight only one of whose layers measures)")
        return cls(entries, callback=callback, scaler=scaler, world_size=world_size)

    @property
    def names(self):
        """The tracked parameters' names, in model.named_parameters() order."""
        return [name for name, _, _, _ in self.entries]

    def _scale(self):
        """The GradScaler's current scale, as a device tensor when possible (no host sync), else a float."""
        if self.scaler is None or not self.scaler.is_enabled():
            return 1.0
        # GradScaler keeps its scale as a device tensor, created by the first scaler.scale();
        # get_scale() would call .item() on it, a second host-device sync per step.
        scale = getattr(self.scaler, "_scale", None)
        return scale if isinstance(scale, torch.Tensor) else float(self.scaler.get_scale())

    @torch.no_grad()
    def step(self, batch_size=None, step=None):
        """
        Measure the current gradients and buffers; returns this step's list of Measurements.

        Call after the last micro-step's backward (and the DDP all-reduce of the buffers), before
        scaler.unscale_ and gradient clipping. batch_size is B, the examples in the whole
        optimizer step over all ranks and micro-steps; every buffer's count must equal it
        (default: take B from the counts). step goes into the metadata (default: step_count,
        the number of earlier calls). Parameters without a gradient or with a zero count this
        step are left out.

        A step with an inf/nan gradient or buffer (float16 overflow, which GradScaler skips too,
        or a diverged run) is counted in skipped_steps and still gives every parameter its
        Measurement, with inf norms and the real batch size: each log row keeps its GNS cells
        (readers check one batch size per row), and a sum of squared norms over the step is
        inf or nan, never a number that silently leaves something out.
        """
        step = self.step_count if step is None else step
        self.step_count += 1
        live = [(n, p, sq, count) for n, p, sq, count in self.entries if p.grad is not None]
        if not live:
            self._zero_buffers()
            return []

        # One host-device transfer for everything: stack on device, then a single .tolist().
        scale = self._scale()
        device = live[0][1].grad.device
        values = [sum_of_squares(p.grad).to(device) for _, p, _, _ in live]
        values += [sq.to(device) for _, _, sq, _ in live]
        values += [count.to(device) for _, _, _, count in live]
        if isinstance(scale, torch.Tensor):
            values.append(scale.to(device=device, dtype=torch.float32).reshape(()))
        host = torch.stack(values).tolist()
        self._zero_buffers()
        n = len(live)
        grad_sqnorms, sq_sums, counts = host[:n], host[n:2 * n], host[2 * n:3 * n]
        if isinstance(scale, torch.Tensor):
            scale = host[3 * n]
        finite = all(math.isfinite(v) for v in grad_sqnorms + sq_sums) and math.isfinite(scale) and scale > 0
        if not finite:
            self.skipped_steps += 1

        measurements = []
        for (name, _, _, _), grad_sqnorm, sq_sum, count in zip(live, grad_sqnorms, sq_sums, counts):
            if count == 0:
                continue  # module not run this step: no per-example information
            B = int(round(count)) if batch_size is None else int(batch_size)
            if count != B:
                raise ValueError(
                    f"{name}: the buffers counted {count:g} examples but batch_size={B}; were the buffers "
                    f"zeroed after the previous step, and under DDP were the counts summed over ranks?")
            big_norm = small_norm = math.inf
            if finite:
                # grads carry the loss scale s, buffers s^2; see the module docstring for B / W^2
                big_norm = math.sqrt(grad_sqnorm / scale ** 2)
                small_norm = math.sqrt(max(B * (sq_sum / scale ** 2) / self.world_size ** 2, 0.0))
            m = Measurement(big_batch_norm=big_norm, small_batch_norm=small_norm, big_batch_size=B,
                            small_batch_size=1, metadata={"name": name, "step": step})
            measurements.append(self._run_callbacks(m))
        return measurements

    def _run_callbacks(self, m):
        if not self.callback:  # None or an empty list
            self.measurements.append(m)
            return m
        callbacks = self.callback if isinstance(self.callback, (list, tuple)) else [self.callback]
        kept = None
        for callback in callbacks:
            result = callback(m)
            if result is not None:
                if kept is not None:
                    raise ValueError("more than one callback returned a value for the same measurement; "
                                     "at most one may (the others must return None)")
                kept = result
        if kept is None:
            return m
        self.measurements.append(kept)
        return kept

    def _zero_buffers(self):
        if self._buffers:
            torch._foreach_zero_(self._buffers)  # one call for all of them

    # the reference implementation's attributes not kept here
    params_and_buffers = refused("MeasurementTracker.params_and_buffers",
                                 "use .entries: (name, parameter, sqgradnorm buffer, count buffer) per parameter")
    indexes = refused("MeasurementTracker.indexes", "use .names (the parameters' names) or .entries")
    shared_params = refused("MeasurementTracker.shared_params",
                            "a tied weight is tracked once, under its first name, with the exact per-example norm "
                            "of its summed gradient (buffered.tie_weights)")


class AccumulateMeasurements:
    """
    Callback that collects one step's measurements as a flat dict for the logger:

        {prefix}{name}/norm        |G_B|, the big-batch gradient norm
        {prefix}{name}/pegn        |G_1| = sqrt(mean_b ||g_b||^2), the per-example gradient norm
        {prefix}{name}/batch_size  B

    e.g. train/gns/transformer.h.0.ln_1.weight/norm, with a '/' added to a prefix that does not
    end in one. pop() (or get_msg()) returns the dict `msg` and starts a new one; a measurement
    from a new step (its metadata "step", kept in `step`) also starts a new one, so a missed
    pop() never leaks stale values into the next step's row.
    """

    def __init__(self, prefix="train/gns/"):
        self.prefix = prefix
        self.msg = {}
        self.step = None

    def __call__(self, m):
        step = m.metadata.get("step")
        if step != self.step:
            self.msg, self.step = {}, step
        separator = "" if self.prefix == "" or self.prefix.endswith("/") else "/"
        key = self.prefix + separator + m.metadata["name"]
        self.msg[f"{key}/norm"] = m.big_batch_norm
        self.msg[f"{key}/pegn"] = m.small_batch_norm
        self.msg[f"{key}/batch_size"] = m.big_batch_size
        return None

    def pop(self):
        msg, self.msg = self.msg, {}
        return msg

    # the reference implementation's name for pop()
    def get_msg(self):
        """pop(), under the reference implementation's name."""
        return self.pop()


# ---------------------------------------------------------------------------------------------
# The reference implementation's names (exact/gnstracking.py) not kept here; the classes' own are
# at the end of each class.

def _refuse_reference_constructor(entries, keywords):
    # the reference's MeasurementTracker(params_and_buffers, names, indexes, callback, scaler,
    # shared_params) takes (parameter, buffer) pairs
    if any(len(e) == 2 for e in entries if isinstance(e, (tuple, list))) or \
            set(keywords) & {"names", "indexes", "shared_params"}:
        raise ReferenceNameError(
            "MeasurementTracker(params_and_buffers, names=..., indexes=..., shared_params=...) is the reference "
            "implementation's constructor and is not kept in this fork: use "
            "MeasurementTracker.from_model(model, callback=..., scaler=...)")
    if keywords:
        raise TypeError(f"MeasurementTracker() got unexpected keyword arguments {sorted(keywords)}")


__getattr__ = refuse_module_names(__name__, {
    "exists": "write `x is not None`",
    "shared_weights": "a tied weight is tracked once, under its first name, with the exact per-example norm of its "
                      "summed gradient (buffered.tie_weights)",
    "named_parameters_and_buffers": "use buffered.find_sqgradnorm_buffers(model): (name, parameter, sqgradnorm "
                                    "buffer, count buffer) per measured parameter; "
                                    "MeasurementTracker.from_model(model, enforce_coverage=True) checks coverage",
})
