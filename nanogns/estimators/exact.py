"""
What a training run measures the gradient noise scale with: the exact per-example estimator and
the small interface every estimator offers train.py's loop. The maths (McCandlish et al. 2018,
App. A: the unbiased estimates, their bias-corrected EMA) and log.csv's column names are
nanogns/maths.py's, imported here.

The exact per-example estimator (b = 1) reads, after the last micro-step and before
scaler.unscale_ and clipping, |G_B|^2 = ||p.grad||^2 and the per-example-norm buffers
(nanogns/layers), which hold S = sum_b ||g_b / B||^2, so |G_1|^2 = B S. Under DDP over W ranks each
rank's layers see its own mean loss; once buffers and counts are summed over ranks,
|G_1|^2 = B S / W^2 (under FSDP too; there p.grad is each rank's shard and |G_B|^2 the sum over
ranks of the shards' squares). Under a float16 GradScaler gradients carry s and buffers s^2.

Every estimator (ExactGNS here, ddp.DDPGNS, microbatch.MicrobatchEstimator,
gnshooks.HooksEstimator) is an estimator.Estimator; estimators_for() builds a run's list:

    estimators = estimators_for(raw_model, ddp_model=model if ddp else None, world_size=W,
                                hooks='none', microbatch=False)
    ... micro-steps: scaler.scale(loss / grad_accum_steps).backward()
    row = measure_all(estimators, iter_num, B, scaler)   # every rank, before scaler.unscale_
    ... scaler.unscale_, clipping, scaler.step, scaler.update, zero_grad
    reset_all(estimators)
    ... logger.log(row); print(f"... {status_line(estimators)}")
"""
import collections
import math
import warnings

import torch

import nanogns.estimators.adam as adamgns
import nanogns.estimators.ddp as ddp
import nanogns.estimators.hooks as gnshooks
import nanogns.estimators.microbatch as microbatch_gns
from nanogns.layers import (agree_linear_norm_methods, all_sqgradnorm_buffers, allreduce_buffers, entry_names,
                            find_sqgradnorm_buffers, layer_kinds, linear_norm_methods, measured_linears,
                            set_linear_norm_methods, sum_of_squares)
# the interface every estimator offers, from its leaf module (importable from here, as before)
from nanogns.estimators.base import (Estimator, Measurement, current_scale, distributed_world_size, read_now,  # noqa: F401
                                     unwrap)
# the maths and the column names, from their torch-free home; imported here by the estimators
from nanogns.layers.buffers import MeasuredLayer
from nanogns.layers.experts import PEGradNormExperts
from nanogns.layers.sharded import allreduce_sharded_buffers
from nanogns.maths import (EMA_BETA, KINDS, NORM_KINDS, PREFIXES, REACHED_CELL, GradientNoiseScale, column,  # noqa: F401
                           debiased_ema,
                     layer_kind, layer_type, parameter_columns, parse_column, total_columns, unbiased_estimates)
from nanogns.refusals import module_refusals, refuse_attributes, refuse_tracker_constructor

# ---------------------------------------------------------------------------------------------
# The exact per-example estimator's measurements

# one expert's rows of a gradient that FSDP2 shards over the experts (Shard(0) of an [E, ...] weight)
ExpertRows = collections.namedtuple("ExpertRows", "grad expert")


def _grad_sqnorms(grads, device, foreach=None):
    """||grad||^2 of each gradient, float32 0-dim tensors on `device`. A DTensor gradient (FSDP2's shards,
    tensor parallelism's, both on a 2-D mesh) is squared on each rank's local tensor, and one all-reduce
    per mesh dimension of all of a mesh's squares sums them over the dimensions where some gradient is
    sharded (never a gather of the full gradients): a gradient replicated over such a dimension is
    counted from its first rank only, and a partial sum (a sequence-parallel LayerNorm's gain) is summed
    over its group before it is squared. An ExpertRows is one expert's rows of a shard on the experts'
    dimension, which the rank holding them squares (0 elsewhere). foreach (default: on a GPU): all the
    norms from one multi-tensor kernel, where a launch per gradient costs host time each step; on the
    CPU one dot each (sum_of_squares: more precise there)."""
    meshes = [getattr(g.grad if isinstance(g, ExpertRows) else g, "device_mesh", None) for g in grads]
    foreach = device.type == "cuda" if foreach is None else foreach
    if all(m is None for m in meshes):
        if foreach and all(g.dtype == torch.float32 and g.device == device for g in grads):
            norms = torch.stack(torch._foreach_norm(grads))
            return list((norms * norms).unbind())
        return [sum_of_squares(g).to(device) for g in grads]
    out, by_mesh = [None] * len(grads), {}
    for i, (g, mesh) in enumerate(zip(grads, meshes)):
        if mesh is None:
            out[i] = sum_of_squares(g).to(device)
        else:
            by_mesh.setdefault(id(mesh), (mesh, []))[1].append(i)
    for mesh, indices in by_mesh.values():
        placements = [[pl for pl in (grads[i].grad if isinstance(grads[i], ExpertRows) else grads[i]).placements]
                      for i in indices]
        # sharded: Shard, and FSDP2's _StridedShard of a TP shard (which is_shard() does not count)
        summed = [d for d in range(mesh.ndim)
                  if any(not (pls[d].is_replicate() or pls[d].is_partial()) for pls in placements)]
        squares = torch.stack([_local_sqnorm(grads[i], device, mesh, summed) for i in indices])
        for d in summed:
            torch.distributed.all_reduce(squares, group=mesh.get_group(d) if mesh.ndim > 1 else mesh.get_group())
        for i, sq in zip(indices, squares.unbind()):
            out[i] = sq
    return out


def _local_sqnorm(g, device, mesh, summed):
    """This rank's part of ||g||^2 for a DTensor gradient (or ExpertRows) on `mesh`, whose squares are then
    summed over the mesh dimensions `summed`: a partial sum reduced over its dimension first, and 0 on
    the ranks other than the first of a summed dimension over which g is replicated."""
    if isinstance(g, ExpertRows):
        return _expert_rows_sqnorm(g, device)
    if any(pl.is_partial() for pl in g.placements):
        from torch.distributed.tensor import Replicate
        g = g.redistribute(placements=[Replicate() if pl.is_partial() else pl for pl in g.placements])
    sq = sum_of_squares(g.to_local()).to(device)
    for d in summed:
        if g.placements[d].is_replicate() and mesh.get_local_rank(d) != 0:
            return torch.zeros_like(sq)
    return sq


def _expert_rows_sqnorm(rows, device):
    """This rank's part of ||grad[e]||^2 for a gradient sharded on its first dimension: FSDP2 gives each of
    the W ranks ceil(E / W) consecutive experts (torch.chunk's split; the last ranks may hold fewer)."""
    grad, e = rows
    if [pl.dim if pl.is_shard() else None for pl in grad.placements] != [0]:
        raise ValueError(f"an experts weight's gradient is sharded as {grad.placements}, not on its first (the "
                         "experts') dimension over one mesh dimension: its per-expert norms are not measured so")
    local, mesh = grad.to_local(), grad.device_mesh
    first = mesh.get_local_rank() * -(-grad.shape[0] // mesh.size())
    if not first <= e < first + local.shape[0]:
        return torch.zeros((), dtype=torch.float32, device=device)
    return sum_of_squares(local[e - first]).to(device)


def _per_measurement(entries):
    """(name, gradient, sum buffer, count buffer) of each measurement of `entries` (name, parameter, sum,
    count): a parameter's own, or for one whose sum holds an entry per expert ([E], its first dimension
    the experts') one per expert, name[e] with the gradient's e-th slice (ExpertRows of a DTensor
    gradient, which FSDP2 shards on the experts) and the sum's."""
    found = []
    for name, p, sq, count in entries:
        if sq.dim() == 0:
            found.append((name, p.grad, sq, count))
            continue
        sharded = hasattr(p.grad, "device_mesh")
        found += [(each, ExpertRows(p.grad, e) if sharded else p.grad[e], sq[e], count)
                  for e, each in enumerate(entry_names(name, sq))]
    return found


# what finishing a tracked step needs besides its values: the measured parameters' names (the
# values' order), the loss scale (a tensor is read with the values), B, the step's number, and
# whether the optimizer's decision is the values' last
TrackedStep = collections.namedtuple("TrackedStep", "names scale batch_size step decided")


@refuse_attributes  # the reference's attributes not kept (refusals.ATTRIBUTES)
class MeasurementTracker:
    """
    Reads, once per optimizer step, every measured parameter's gradient and per-example-norm
    buffer, and emits one Measurement per parameter.

    entries: list of (name, parameter, sqgradnorm buffer, count buffer), as returned by
        nanogns.layers.find_sqgradnorm_buffers; from_model() finds them.
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
    nanogns.layers.zero_sqgradnorm_buffers(model) instead, or the next step sees two steps' sums
    (which step() then reports as a count mismatch).
    """

    def __init__(self, entries, callback=None, scaler=None, world_size=1):
        entries = list(entries)
        if not all(isinstance(e, (tuple, list)) and len(e) == 4 for e in entries):
            raise ValueError("MeasurementTracker entries are (name, parameter, sqgradnorm buffer, count buffer) "
                             "tuples, as nanogns.layers.find_sqgradnorm_buffers returns; or use MeasurementTracker.from_model")
        self.entries = entries
        self.callback = callback
        self.scaler = scaler
        self.world_size = int(world_size)
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.step_count = 0
        self.skipped_steps = 0
        self.measurements = []
        self._unmeasured_named = set()  # parameters named once already as unmeasured (finish)
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
        model = unwrap(model)
        entries = find_sqgradnorm_buffers(model)
        if not entries:
            raise ValueError("the model has no per-example gradient norm buffers: build it with the "
                             "per-example-norm layer classes (nanogns.layers.config.set_contextual_config)")
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
        """The tracked measurements' names, in model.named_parameters() order: each parameter's, or for
        one measured per expert (a sum buffer of one entry per expert) name[0], name[1], ..."""
        return [each for name, _, sq, _ in self.entries for each in entry_names(name, sq)]

    @torch.no_grad()
    def step(self, batch_size=None, step=None):
        """
        Measure the current gradients and buffers; returns this step's list of Measurements.

        Call after the last micro-step's backward (and the DDP all-reduce of the buffers), before
        scaler.unscale_ and gradient clipping. batch_size is B, the examples in the whole
        optimizer step over all ranks and micro-steps; every buffer's count must equal it
        (default: take B from the counts). step goes into the metadata (default: step_count,
        the number of earlier calls). Parameters without a gradient or with a zero count this
        step are left out; one that has a gradient but a zero count (its sums never reached its
        buffers) is named in a warning, once per tracker.

        A step with an inf/nan gradient or buffer (float16 overflow, which GradScaler skips too,
        or a diverged run) is counted in skipped_steps and still gives every parameter its
        Measurement, with inf norms and the real batch size: each log row keeps its GNS cells
        (readers check one batch size per row), and a sum of squared norms over the step is
        inf or nan, never a number that silently leaves something out.
        """
        values, context = self.sums(batch_size, step)
        return self.finish(read_now(values), context)

    @torch.no_grad()
    def sums(self, batch_size=None, step=None, skipped=None):
        """step()'s reads, kept on the device: (values, context), values one float32 device tensor of
        everything step() reads (None when no parameter has a gradient) and finish(values.tolist(),
        context) step()'s Measurements. The buffers are zeroed now, so a training loop may read the
        values of several steps at once, later, and finish them in order. skipped: the optimizer's
        decision, a 0-dim device tensor (non-zero: it skips this step), so that a step it skips is
        skipped here too, whatever made its gradient non-finite (a parameter this tracker does not
        measure, say)."""
        step = self.step_count if step is None else step
        self.step_count += 1
        live = _per_measurement([(n, p, sq, count) for n, p, sq, count in self.entries if p.grad is not None])
        if not live:
            self._zero_buffers()
            return None, None
        # everything in one tensor: one device-to-host copy, whenever it is read
        scale = current_scale(self.scaler)
        device = next(p.grad.device for _, p, _, _ in self.entries if p.grad is not None)
        values = _grad_sqnorms([grad for _, grad, _, _ in live], device)
        values += [sq.to(device) for _, _, sq, _ in live]
        values += [count.to(device) for _, _, _, count in live]
        if isinstance(scale, torch.Tensor):
            values.append(scale.to(device=device, dtype=torch.float32).reshape(()))
        if skipped is not None:
            local = skipped.to_local() if hasattr(skipped, "to_local") else skipped  # FSDP: a replicated DTensor
            values.append(local.to(device=device, dtype=torch.float32).reshape(()))
        values = torch.stack(values)
        self._zero_buffers()
        return values, TrackedStep([name for name, _, _, _ in live], scale, batch_size, step, skipped is not None)

    def finish(self, host, context):
        """sums()'s values, read (host), as the step's Measurements; [] when nothing was measured."""
        if context is None:
            return []
        names, scale, batch_size, step, decided = context
        n = len(names)
        grad_sqnorms, sq_sums, counts = host[:n], host[n:2 * n], host[2 * n:3 * n]
        if isinstance(scale, torch.Tensor):
            scale = host[3 * n]
        skipped = decided and host[-1] != 0
        finite = (all(math.isfinite(v) for v in grad_sqnorms + sq_sums) and math.isfinite(scale) and scale > 0
                  and not skipped)
        if not finite:
            self.skipped_steps += 1

        measurements, unmeasured = [], []
        for name, grad_sqnorm, sq_sum, count in zip(names, grad_sqnorms, sq_sums, counts):
            if count == 0:  # no per-example information: its module did not run this step, or
                if grad_sqnorm != 0 and name not in self._unmeasured_named:  # it ran and its sums went astray
                    unmeasured.append(name)
                continue
            B = int(round(count)) if batch_size is None else int(batch_size)
            if count != B:
                times = count / B if B and count > B and count % B == 0 else None
                twice = (f"was its layer applied {times:g} times in one forward (a per-example norm would need the "
                         f"cross terms between the uses: not measured)? or " if times else "")
                raise ValueError(
                    f"{name}: the buffers counted {count:g} examples but batch_size={B}; {twice}were the buffers "
                    f"zeroed after the previous step, and under DDP were the counts summed over ranks?")
            big_norm = small_norm = math.inf
            if finite:
                # grads carry the loss scale s, buffers s^2; see the module docstring for B / W^2
                big_norm = math.sqrt(grad_sqnorm / scale ** 2)
                small_norm = math.sqrt(max(B * (sq_sum / scale ** 2) / self.world_size ** 2, 0.0))
            m = Measurement(big_batch_norm=big_norm, small_batch_norm=small_norm, big_batch_size=B,
                            small_batch_size=1, metadata={"name": name, "step": step})
            measurements.append(self._run_callbacks(m))
        if unmeasured:
            self._unmeasured_named.update(unmeasured)
            warnings.warn(f"{', '.join(unmeasured)}: received a gradient but no per-example sums, so "
                          f"{'they are' if len(unmeasured) > 1 else 'it is'} not measured (under torch.compile a "
                          "measured layer hands its sums out as a gradient that torch.autograd.grad and "
                          "backward(inputs=...) leave uncomputed: call backward() on the whole loss)", stacklevel=3)
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

    # the reference implementation's constructor and attributes, not kept here: refused by name
    def __new__(cls, entries=(), *args, **keywords):
        refuse_tracker_constructor(entries, keywords)
        return super().__new__(cls)


class AccumulateMeasurements:
    """
    Callback that collects one step's measurements as a flat dict for the logger:

        {prefix}{name}/norm        |G_B|, the big-batch gradient norm
        {prefix}{name}/pegn        |G_1| = sqrt(mean_b ||g_b||^2), the per-example gradient norm
        {prefix}{name}/batch_size  B
        {prefix}{name}/small_batch_size  b, only where it is not 1

    e.g. train/gns/transformer.h.0.ln_1.weight/norm (column()), with a '/' added to a prefix that
    does not end in one. pop() (or get_msg()) returns the dict `msg` and starts a new one; a measurement
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
        # a small batch of b > 1 must be written down, or a reader takes the pegn for b = 1's
        small = m.small_batch_size if m.small_batch_size != 1 else None
        self.msg.update(parameter_columns(self.prefix, m.metadata["name"], m.big_batch_norm, m.small_batch_norm,
                                          m.big_batch_size, small))
        return None

    def pop(self):
        msg, self.msg = self.msg, {}
        return msg

    # the reference implementation's name for pop()
    def get_msg(self):
        """pop(), under the reference implementation's name."""
        return self.pop()


class ExactGNS(Estimator):
    """
    The exact per-example estimator (b = 1): every parameter whose layer keeps per-example-norm
    buffers (nanogns/layers), read by a MeasurementTracker, the buffers first summed over the DDP
    ranks when world_size > 1. Its live GNS, for the status line, is an EMA (beta EMA_BETA) of the
    estimates from the totals over all measured parameters, carried across a resume; and one of
    the normalisation group's alone when it has measured LayerNorms or RMSNorms (live_gns() reads
    either; the group is called 'LayerNorm' there, --bs_gns_group's value, whichever they are).
    Under DDP each rank's measured Linears choose their ghost/materialise method alike (nanogns/layers'
    per_example_mode "auto": the routes table or the shapes, nothing timed); measure() still gives
    every rank rank 0's, in one broadcast of them all, on the step in which a layer first chose (the
    same step on every rank, which run the same layers on the same shapes), so that methods restored
    differently cannot part the ranks.

    Tensor and sequence parallelism (torch's parallelize_module over a TP mesh, with or without FSDP2
    over a data-parallel one; nanogns/layers/sharded.py): every rank of a TP group sees the same
    examples, so world_size is the number of data-parallel ranks alone (1 under TP alone), and group
    their process group (None: every rank, right only without TP). Each step the sharded layers' sums
    are first combined over their TP groups (a shard's add, a replicated value counts once), then the
    buffers are summed over `group` when world_size > 1.
    """
    name = PREFIXES["exact"]
    label = "gns"

    def __init__(self, model, world_size=1, beta=EMA_BETA, group=None):
        self.model = unwrap(model)
        self.group = group  # the data-parallel ranks' process group (None: all of them)
        self.logs = AccumulateMeasurements(prefix=self.name)
        self.tracker = MeasurementTracker.from_model(self.model, callback=self.logs, world_size=world_size)
        # every buffer, the untracked ones too (a layer whose parameters are frozen, or shared): found once,
        # as the tracker's entries are, not by a walk over the model's modules twice a step
        self.buffers = all_sqgradnorm_buffers(self.model)
        # the measured layers, whose buffers tensor or sequence parallelism combines over its group first
        self.layers = [m for m in self.model.modules() if isinstance(m, MeasuredLayer)]
        self.gns = GradientNoiseScale(beta=beta)
        self.groups = {"total": self.gns}
        kinds = layer_kinds(self.model)  # as measured, not by name: any model's normalisation layers
        self.norm_names = {n for n in self.tracker.names if layer_kind(n, kinds) in NORM_KINDS}
        if self.norm_names:
            self.groups["LayerNorm"] = GradientNoiseScale(beta=beta)
        self.linears = [layer for _, layer in measured_linears(self.model)]
        # mixture-of-experts layers: the examples that reached each expert, logged beside its norms
        self.experts = [(name, m) for name, m in self.model.named_modules() if isinstance(m, PEGradNormExperts)]
        self.agreed_methods = None  # how many Linears had a method when the ranks last agreed on them

    @property
    def skipped_steps(self):
        return self.tracker.skipped_steps

    def sums(self, step, examples, scaler, skipped=None):
        # tensor/sequence parallelism: each layer's sums over its TP group (its shards', or once); none else
        allreduce_sharded_buffers(self.layers)
        if self.tracker.world_size > 1:
            allreduce_buffers(self.buffers, group=self.group)  # the global batch's sums, not one rank's
            methods = sum(layer.norm_method is not None for layer in self.linears)
            if methods != self.agreed_methods:  # a layer chose this step: rank 0's choices for all
                agree_linear_norm_methods(self.model)
                self.agreed_methods = sum(layer.norm_method is not None for layer in self.linears)
        self.tracker.scaler = scaler
        values, context = self.tracker.sums(batch_size=examples, step=step, skipped=skipped)
        if values is None or not self.experts:
            return values, (context, 0)
        reached = torch.cat([m.expert_examples.to(values.device) for _, m in self.experts])  # a copy: reset() zeroes them
        return torch.cat([values, reached]), (context, reached.numel())

    def finish(self, host, context):
        context, n_reached = context
        reached_row = {}
        if n_reached:
            host, reached = host[:-n_reached], iter(host[-n_reached:])
            for name, m in self.experts:  # the examples that reached each expert (an estimate from few is noisy)
                for e in range(m.n_expert):
                    reached_row[column(self.name, f"{name}[{e}]", REACHED_CELL)] = int(next(reached))
        measurements = self.tracker.finish(host, context)
        examples = context.batch_size if context is not None else None
        if examples is None and measurements:  # B from the layers' own example counts, which must agree
            by_count = {}
            for m in measurements:
                by_count.setdefault(m.big_batch_size, []).append(m.metadata["name"])
            if len(by_count) > 1:
                seen = "; ".join(f"{count} by {names[0]}" + (f" and {len(names) - 1} more" if len(names) > 1 else "")
                                 for count, names in by_count.items())
                raise ValueError(f"the measured layers counted different numbers of examples this step ({seen}): "
                                 f"pass the step's batch size, or see which layer ran on other inputs")
            examples = measurements[0].big_batch_size
        if measurements and examples > 1:  # one example: no small batch below it
            for group, gns in self.groups.items():
                members = [m for m in measurements if group == "total" or m.metadata["name"] in self.norm_names]
                gns.update(sum(m.small_batch_norm ** 2 for m in members),
                           sum(m.big_batch_norm ** 2 for m in members), 1, examples)
        row = self.logs.pop()
        if measurements:
            row.update(reached_row)
        return row

    def reset(self):
        torch._foreach_zero_(self.buffers)

    def state_dict(self):
        return {**self.gns.state_dict(), "skipped_steps": self.tracker.skipped_steps}

    def load_state_dict(self, state):
        state = dict(state)
        self.tracker.skipped_steps = int(state.pop("skipped_steps", 0))  # older checkpoints: none counted
        self.gns.load_state_dict(state)


def estimators_for(model, ddp_model=None, world_size=1, hooks="none", microbatch=False, checkpoint=None, fsdp=False,
                   adam_optimizer=None):
    """
    The estimators of a run, in the order their columns go into log.csv: the exact per-example one
    whenever `model` (the plain model, or its DDP/compile wrapper) has per-example-norm layers; the
    Linear hooks ('exact' or 'sogns', nanogns/estimators/hooks.py) and the micro-batch one (nanogns/estimators/microbatch.py) when
    asked; the DDP one (nanogns/estimators/ddp.py, on ddp_model, the DistributedDataParallel wrapper) when
    world_size > 1. Build it after the DDP wrapper, before the first forward; the hooks go on the
    model's modules and parameters. With a checkpoint dict, their states resume (load_states).
    fsdp: the model is sharded with FSDP2 over world_size ranks: no DDP estimator (its comm hook is
    DDP's), the exact one all-reduces its buffers and squares the gradient shards (_grad_sqnorms).
    adam_optimizer: the run's Adam(W), for the Adam-preconditioned GNS of the normalisation layers
    (nanogns/estimators/adam.py), after the exact one; None: not measured.
    """
    choices = ("none", *gnshooks.ADD_HOOKS)
    if hooks not in choices:
        raise ValueError(f"hooks={hooks!r} is not one of {', '.join(choices)}")
    if world_size > 1 and ddp_model is None and not fsdp:
        raise ValueError(f"world_size={world_size}: the DDP estimator needs the DistributedDataParallel model "
                         f"(ddp_model=...)")
    model = unwrap(model)
    estimators = []
    if find_sqgradnorm_buffers(model):
        estimators.append(ExactGNS(model, world_size))
    if hooks != "none":
        estimators.append(gnshooks.HooksEstimator(model, hooks))
    if microbatch:
        estimators.append(microbatch_gns.MicrobatchEstimator(model))
    if adam_optimizer is not None:
        estimators.append(adamgns.AdamGNS(model, adam_optimizer, world_size))
    if world_size > 1 and not fsdp:
        estimators.append(ddp.DDPGNS(ddp_model))
    if checkpoint is not None:
        load_states(estimators, checkpoint)
    return estimators


def measure_all(estimators, step, examples, scaler):
    """Every estimator's measure() (see Estimator), their columns in one dict, in order."""
    row = {}
    for e in estimators:
        row.update(e.measure(step, examples, scaler))
    return row


def collect_all(estimators, step, examples, scaler, skipped=None):
    """measure_all() with the reads left on the device: every estimator's collect() (see Estimator),
    for a pending.PendingSteps that reads them with the loop's other values when it logs. skipped:
    the optimizer's decision for this step (a 0-dim device tensor, non-zero when it skips), which
    the exact estimator follows: a step the optimizer skips never enters its live GNS."""
    return [e.collect(step, examples, scaler, skipped) for e in estimators]


def reset_all(estimators):
    for e in estimators:
        e.reset()


def status_line(estimators):
    """The estimators' parts of the status line, e.g. 'gns 12.3, ddp gns 11.9' ('' if none)."""
    return ", ".join(s for s in (e.status() for e in estimators) if s)


def live_gns(estimators, group="total"):
    """(GNS, steps its EMA has averaged) of the exact estimator's live EMA for `group` ('total' or
    'LayerNorm'); (nan, 0) when nothing measures that group."""
    for e in estimators:
        if group == "adam" and isinstance(e, adamgns.AdamGNS) or isinstance(e, ExactGNS) and group in e.groups:
            gns = e.gns if group == "adam" else e.groups[group]
            updates = math.log(gns.beta_cumprod) / math.log(gns.beta) if gns.beta_cumprod > 0 else math.inf
            return gns.get_gns(), round(updates)
    return float("nan"), 0


def measured_groups(estimators):
    """The groups live_gns() can read: 'total' and 'LayerNorm' (when measured), or none; 'LayerNorm'
    first when the LayerNorms are all that is measured."""
    adam = ["adam"] if any(isinstance(e, adamgns.AdamGNS) for e in estimators) else []
    for e in estimators:
        if isinstance(e, ExactGNS):
            groups = list(e.groups)  # "total" first
            return (groups[::-1] if e.norm_names == set(e.tracker.names) else groups) + adam
    return adam


def skipped_steps(estimators):
    """The most steps any estimator could not measure (they all see the same non-finite steps)."""
    return max((e.skipped_steps for e in estimators), default=0)


def skipped_steps_line(estimators, float16):
    """What a run says at its end about the steps its estimators could not measure, and why."""
    why = ("float16 overflow: GradScaler skipped them" if float16
           else "non-finite gradients: the optimizer skipped them")
    return f"GNS: {skipped_steps(estimators)} step(s) were not measured ({why})"


# the checkpoint key of the estimators' states, and this fork's older keys of single ones
CHECKPOINT_KEY = "gns_estimators"
GROUPS_KEY = "gns_groups"
METHODS_KEY = "linear_norm_methods"  # each measured Linear's ghost/materialise method (nanogns.layers.linear_norm_methods)
OLDER_CHECKPOINT_KEYS = {"live_gns": PREFIXES["exact"], "ddp_gns": PREFIXES["ddp"]}


def save_states(estimators, checkpoint):
    """Put the estimators' states (those that keep one) into the checkpoint dict, under CHECKPOINT_KEY."""
    checkpoint[CHECKPOINT_KEY] = {e.name: e.state_dict() for e in estimators if e.state_dict()}
    # the exact estimator's live GNS of its groups other than the total (the batch-size controller's)
    checkpoint[GROUPS_KEY] = {g: gns.state_dict() for e in estimators if isinstance(e, ExactGNS)
                              for g, gns in e.groups.items() if g != "total"}
    # the Linears' methods, so that a resumed run measures as the run it continues (the two
    # methods' norms are exact, but not to the bit)
    checkpoint[METHODS_KEY] = {name: method for e in estimators if isinstance(e, ExactGNS)
                               for name, method in linear_norm_methods(e.model).items()}


def load_states(estimators, checkpoint):
    """
    Restore the estimators' states from a checkpoint dict: save_states()'s (with the measured
    Linears' methods), or this fork's older 'live_gns' (the exact estimator's) and 'ddp_gns'. An
    estimator without a state there starts afresh (nanoGPT's and the reference's checkpoints have
    none); a state without its estimator is ignored.
    """
    states = checkpoint.get(CHECKPOINT_KEY)
    if states is None:
        states = {name: checkpoint[old] for old, name in OLDER_CHECKPOINT_KEYS.items() if old in checkpoint}
    for e in estimators:
        if e.name in states:
            e.load_state_dict(states[e.name])
        for group, state in checkpoint.get(GROUPS_KEY, {}).items():
            if isinstance(e, ExactGNS) and group in e.groups:
                e.groups[group].load_state_dict(state)
        if isinstance(e, ExactGNS):
            set_linear_norm_methods(e.model, checkpoint.get(METHODS_KEY, {}))


# ---------------------------------------------------------------------------------------------
# The reference implementation's names (exact/gnstracking.py) not kept here; the classes' own are
# at the end of each class.

# the reference's names this module does not keep (gnstracking.<name>): refused, saying what to use
__getattr__ = module_refusals("gnstracking")
