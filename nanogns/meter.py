"""
The gradient noise scale of any training loop, in one object. GNSMeter measures the model
(layers.measure, unless its layers measure already), builds the exact per-example estimator
(exact.ExactGNS), and takes one call per optimizer step, after the step's last backward
and before unscaling and clipping:

    meter = GNSMeter(model, out_dir="out-mine")   # after building the model, before torch.compile
    for x, y in batches:
        model(x, y).loss.backward()
        meter.step()                              # the step's row into out_dir/log.csv
        optimizer.step()
        optimizer.zero_grad()
    meter.close()

step() returns the step's columns (log.csv's names) and the live GNS of each measured group
('gns/total', and 'gns/LayerNorm' where normalisation layers are measured). Gradient
accumulation needs nothing: the layers add every micro-step's per-example norms, and the step's
batch size is their example count. A float16 GradScaler is passed to step(), which divides its
scale out; bfloat16 autocast needs nothing. Under DDP or FSDP2 every rank calls step() at the
same point (it sums the buffers over the ranks), and rank 0 writes the log; build the meter
before fully_shard (measure() swaps the layers of the plain model).

A micro-step given up (an out-of-memory error caught, then zero_grad()) has already added its
examples to the layers' sums: call discard() before the step is tried again. step(examples=N)
checks the layers' count against N and, where they differ, says so and measures nothing.

A resume: state_dict() goes into the checkpoint, and load_state_dict() before the first backward
of the continued run carries on the live GNS, the log from that step and each Linear's
ghost/materialise method; a state saved with another model (other measured parameters, or other
shapes) is refused. A meter that is not resumed refuses an out_dir that already holds a log.csv
(another run's): nanogns.runlog.OutDirTaken.
A model has one meter at a time: the layers' sums are read and zeroed by whichever steps first.
nanogns.hf.GNSCallback and nanogns.lightning.GNSCallback are this object in those frameworks' loops.
"""
import math
import numbers
import os
import warnings
import weakref

import torch

from nanogns import layers
from nanogns.estimators import exact
from nanogns.estimators.base import distributed_world_size, unwrap
from nanogns.maths import EMA_BETA, LOG_NAME
from nanogns.runlog import LogWrapper, OutDirTaken, lock_out_dir, release_out_dir

STATE_KEYS = ("step", exact.CHECKPOINT_KEY)  # what state_dict() always holds
# {name: shape} of the measured parameters, in state_dict(): a state is refused by another model
# (its averages are another model's). States saved before it was kept lack it.
MEASURED_KEY = "measured_parameters"
# state_dict() is strict JSON: the non-finite floats of the averages (NaN before their first
# step) are written as these strings, and load_state_dict() reads them back
NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}

# each measured model's meter (a weak reference, so that a meter dropped unclosed frees its model)
_meters = weakref.WeakKeyDictionary()


class GNSMeterError(ValueError):
    """A model, a wrapper or a step GNSMeter cannot measure; the message (one line) says what to do."""


class GNSMeter:
    """
    model: the model (or its DDP / torch.compile wrapper), measured in place unless its layers
        already keep per-example-norm buffers.
    out_dir: where log.csv, config.json and layer_kinds.json go (gns-analysis.py reads them);
        None: nothing is written.
    linear, embedding, norm, kinds, strict: layers.measure's; a trainable parameter left
        unmeasured is named in one warning, or, with strict=True, a ValueError.
    world_size: the ranks whose buffers step() sums; default: torch.distributed's world size.
        Under tensor or sequence parallelism the data-parallel ranks alone (1 under TP alone), and
    group: their process group (None: every rank): the TP ranks see the same examples.
    config: a dict of the run's settings for out_dir/config.json.
    batch_dim: the dimension of the model's input that holds the examples (layers.measure's):
        0, or 1 for sequence-first input [T, B, ...] (nn.Transformer's default).
    Under DDP build the meter on the plain model before wrapping it: the per-example-norm buffers
    are then kept out of DDP's broadcast of rank 0's buffers (broadcast_buffers=True, its default),
    which would overwrite every rank's sums; a DDP wrapper that broadcasts them is refused, and so
    is nn.DataParallel (its replicas add into copies of the buffers).
    """

    def __init__(self, model, out_dir=None, linear="gns", embedding="gns", norm="shim", kinds=None, strict=False,
                 world_size=None, config=None, beta=EMA_BETA, batch_dim=0, group=None):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"GNSMeter takes an nn.Module (the model, or its DDP / torch.compile wrapper), not "
                            f"{type(model).__name__} {_shown(model)}")
        self.model = unwrap(model)
        if any(isinstance(m, torch.nn.DataParallel) for m in (model, *self.model.modules())):
            raise GNSMeterError("GNSMeter: nn.DataParallel runs replicas whose layers add into copies of the "
                                "per-example-norm buffers, so only some examples would be counted: use "
                                "DistributedDataParallel (torchrun), or measure the model inside it on one device")
        if not any(p.requires_grad for p in self.model.parameters()):
            raise ValueError(f"GNSMeter: the model ({type(self.model).__name__}) has no trainable parameters: "
                             f"there is no gradient to measure")
        first = _meters.get(self.model)
        first = first() if first is not None else None
        if first is not None:
            raise GNSMeterError(f"GNSMeter: this {type(self.model).__name__} is already measured by a GNSMeter "
                                f"(out_dir {first.given_out_dir!r}) that is not closed; each would read and zero the "
                                f"other's sums: use that meter, or close() it first")
        if not layers.find_sqgradnorm_buffers(self.model):
            layers.measure(self.model, linear=linear, embedding=embedding, norm=norm, kinds=kinds, strict=strict,
                             batch_dim=batch_dim)
        if not layers.find_sqgradnorm_buffers(self.model):
            raise ValueError(f"GNSMeter: no layer of {type(self.model).__name__} could be measured (see the warning "
                             f"above); name your own layer classes with kinds={{Class: 'linear' | 'embedding' | "
                             f"'layernorm' | 'rmsnorm'}}")
        if layers.measured_batch_dim(self.model) != batch_dim:
            raise GNSMeterError(f"GNSMeter: the model was measured with batch_dim="
                                f"{layers.measured_batch_dim(self.model)}, not {batch_dim}: build it afresh and "
                                f"give the meter the plain model")
        _keep_out_of_ddp_broadcast(model, self.model)
        _meters[self.model] = weakref.ref(self)
        self.given_out_dir = out_dir
        self.world_size = distributed_world_size() if world_size is None else int(world_size)
        self.group = group
        self.beta = beta
        # the estimator holds the model's Parameters: it is built at the first step(), after any
        # fully_shard (FSDP2 puts sharded Parameters in place of the ones there now)
        self.estimator = None
        self.loaded_state = None  # load_state_dict()'s, for the estimator when it is built
        rank = 0
        if distributed_world_size() > 1:  # under tensor or context parallelism too, where world_size is 1
            import torch.distributed as dist
            rank = dist.get_rank()
        self.out_dir = out_dir if rank == 0 else None  # one writer
        self.config = dict(config or {})
        self.step_count = 0    # the next step's number
        self.resumed = False   # load_state_dict() was called: the log continues
        self.logger = None     # opened at the first step()
        self._lock = None
        self._methods_recorded = False

    # -- one call per optimizer step -------------------------------------------------------------

    def step(self, values=None, step=None, examples=None, scaler=None):
        """
        Measure this optimizer step: call it after the last micro-step's backward (on every rank),
        before scaler.unscale_ and clipping. values: other numbers for the step's log row (a
        loss, the learning rate): Python or numpy numbers or one-element tensors; a bool is logged
        as 1 or 0, None leaves its cell empty, and a non-finite number is logged as it is (inf, nan:
        the analysis leaves such cells out, as it does a skipped step's GNS cells); anything else
        (text, a tensor of several elements) is a TypeError, before anything is measured or
        written. step: the step's number (default: one after the last).
        examples: the step's batch size over all micro-steps and ranks (default: the measured
        layers' count of the examples they saw); where the layers counted another number (a
        micro-step given up without discard()), a warning says so and the step is not measured.
        scaler: the float16 GradScaler, if one is used.
        Returns {column: value} of the step's GNS columns and the live GNS of each group.
        A step in which the measured layers counted no example, or in which no measured parameter
        has a .grad (a backward through torch.autograd.grad), is a GNSMeterError.
        """
        values = _row_values(values)
        owner = _meters.get(self.model)
        if owner is not None and owner() is not None and owner() is not self:
            raise GNSMeterError("GNSMeter.step: this meter was closed and another GNSMeter measures its model now: "
                                "step that one (each would read and zero the other's sums)")
        step = self.step_count if step is None else int(step)
        if self.out_dir is not None and self.logger is None:
            self.open_log()
        self.build_estimator()
        if not any(p.grad is not None for _, p, _, _ in self.estimator.tracker.entries):
            counted = max(int(count.item()) for _, _, _, count in self.estimator.tracker.entries)
            if counted:  # what those examples added is dropped: no .grad to go with it
                self.estimator.reset()
                raise GNSMeterError(f"GNSMeter.step: the measured layers counted {counted} examples since the last "
                                    f"step(), but no measured parameter has a .grad: a backward that does not write "
                                    f".grad (torch.autograd.grad) is not measured; use loss.backward()")
        averages = {group: gns.state_dict() for group, gns in self.estimator.groups.items()}
        skipped = self.estimator.tracker.skipped_steps
        row = self.estimator.measure(step, None, scaler)  # the batch size from the layers' own counts
        self.estimator.reset()  # the buffers start the next step at zero, whatever this one measured
        if not row:
            raise GNSMeterError(f"GNSMeter.step: the measured layers counted no examples since the last step(): call "
                                f"it after the step's backward, on the model the meter measures (its "
                                f"{type(self.model).__name__}); is another model being trained?")
        counted = sorted({int(value) for column, value in row.items() if column.endswith("/batch_size")})
        if examples is not None and counted != [int(examples)]:
            warnings.warn(f"GNSMeter.step: the measured layers counted {counted[0]} examples since the last step(), "
                          f"the step says examples={int(examples)}: step {step} is not measured; a micro-step given "
                          f"up (an out-of-memory error caught) must be dropped with meter.discard()", stacklevel=2)
            for group, state in averages.items():  # the live GNS as it was
                self.estimator.groups[group].load_state_dict(state)
            self.estimator.tracker.skipped_steps = skipped
            row = {}
        self.step_count = step + 1
        if self.logger is not None:
            if not self._methods_recorded:  # chosen in the first step, as train.py records them
                methods = layers.linear_norm_methods(self.model)
                if methods:
                    self.logger.record_norm_methods(methods)
                self._methods_recorded = True
            self.logger.step_count = step
            self.logger.log({"iter_num": step, **values, **row})
            self.logger.step()
        return {**row, **self.live()}

    def build_estimator(self):
        """The exact estimator, built now if step() has not built it yet (it does at the first step, after any
        fully_shard), with a loaded state's averages: for what reads the live GNS before the first step of a
        resumed run (nanogns.olmo's batch controller). Returns it."""
        if self.estimator is None:
            self.estimator = exact.ExactGNS(self.model, self.world_size, beta=self.beta, group=self.group)
            if self.loaded_state is not None:
                exact.load_states([self.estimator], self.loaded_state)
        return self.estimator

    def discard(self):
        """Drop what the micro-steps since the last step() added (an abandoned step: an out-of-memory
        error caught mid-step, an interrupt): the measured layers' sums and example counts go back
        to zero, and the next step() measures only the micro-steps after this call."""
        layers.zero_sqgradnorm_buffers(self.model)

    def live(self):
        """{'gns/total': ..., 'gns/LayerNorm': ...}: each group's live GNS (an EMA); {} before the first step."""
        if self.estimator is None:
            return {}
        return {f"gns/{group}": gns.get_gns() for group, gns in self.estimator.groups.items()}

    def status(self):
        """The status line's part, e.g. 'gns 12.3'."""
        return self.estimator.status() if self.estimator is not None else ""

    @property
    def skipped_steps(self):
        """Steps with a non-finite gradient (float16 overflow, divergence), logged as inf, not averaged."""
        if self.estimator is not None:
            return self.estimator.skipped_steps
        loaded = (self.loaded_state or {}).get(exact.CHECKPOINT_KEY) or {}  # the estimator's own state keeps it
        return int(loaded.get(exact.ExactGNS.name, {}).get("skipped_steps", 0))

    # -- the log ---------------------------------------------------------------------------------

    def open_log(self):
        """Open out_dir's log now (step() does it at the first step): a fresh meter refuses an
        out_dir holding a log.csv, a resumed one keeps that log's rows before its step."""
        if self.out_dir is None or self.logger is not None:
            return
        path = os.path.join(self.out_dir, LOG_NAME)
        if not self.resumed and os.path.exists(path):
            raise OutDirTaken(f"GNSMeter: {path} holds another run's log: give this run another out_dir, or move "
                              f"that log away (to continue that run, load its state_dict first)")
        self._lock = lock_out_dir(self.out_dir, holder="GNSMeter")
        try:
            self.logger = LogWrapper(config={"gns_meter": True, "world_size": self.world_size, **self.config},
                                     out_dir=self.out_dir, resume_step=self.step_count if self.resumed else None,
                                     numbers_only=True)
            self.logger.record_kinds(layers.layer_kinds(self.model))
        except BaseException:
            release_out_dir(self._lock)
            self._lock = None
            raise

    def close(self):
        """Close the log (and release out_dir). The meter can go on measuring, without a log, until
        another meter is built on its model."""
        if _meters.get(self.model) is not None and _meters[self.model]() is self:
            del _meters[self.model]
        if self.logger is not None:
            self.logger.close()
            self.logger = None
            self.out_dir = None
        if self._lock is not None:
            release_out_dir(self._lock)
            self._lock = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- resume ----------------------------------------------------------------------------------

    def state_dict(self):
        """What a resume needs, plain numbers and strings, strict JSON (json.dumps(allow_nan=False))
        or torch.save: the next step's number, the live GNS averages (a non-finite one as a string,
        NON_FINITE), the steps skipped so far, the measured Linears' ghost/materialise methods, and
        the measured parameters' names and shapes (MEASURED_KEY)."""
        if self.estimator is None:  # nothing measured yet: what was loaded, or a fresh start
            state = dict(self.loaded_state or {"step": self.step_count, exact.CHECKPOINT_KEY: {}})
        else:
            state = {"step": self.step_count}
            exact.save_states([self.estimator], state)
        state[MEASURED_KEY] = self.measured_shapes()
        return _finite_json(state)

    def load_state_dict(self, state):
        """Continue the run that state_dict() came from: call it before the first step(), and before
        the continued run's first backward, which then measures each Linear's weight as that run did
        (its ghost/materialise method, restored here, not timed again). A state of another model (its
        measured parameters' names or shapes differ) is a GNSMeterError."""
        if not isinstance(state, dict) or any(key not in state for key in STATE_KEYS):
            raise ValueError(f"GNSMeter.load_state_dict: expected GNSMeter.state_dict()'s dict, with the keys "
                             f"{', '.join(STATE_KEYS)}")
        if self.estimator is not None or self.logger is not None:
            raise ValueError("GNSMeter.load_state_dict: load the state before the first step()")
        loaded = _from_finite_json(state)
        other = self._another_models(loaded)
        if other:
            raise GNSMeterError(f"GNSMeter.load_state_dict: the state is another model's ({other}): load the state "
                                f"saved with this model's run, or start a fresh meter")
        methods = loaded.get(exact.METHODS_KEY) or {}
        wrong = {name: method for name, method in methods.items() if method not in layers.NORM_METHODS}
        if wrong:
            name, method = next(iter(wrong.items()))
            raise GNSMeterError(f"GNSMeter.load_state_dict: the state's method for {name} is {method!r}, not one of "
                                f"{', '.join(layers.NORM_METHODS)}")
        # now, not at the first step(): the first backward must measure as the run it continues did
        layers.set_linear_norm_methods(self.model, methods)
        self.loaded_state = loaded
        self.step_count = int(state["step"])
        self.resumed = True

    def measured_shapes(self):
        """{name: shape as a list} of every parameter the meter measures (the model's, unsharded)."""
        return {name: list(p.shape) for name, p, _, _ in layers.find_sqgradnorm_buffers(self.model)}

    def _another_models(self, state):
        """What says that `state` was saved with another model than this meter's (in words), or None.
        A state saved before MEASURED_KEY was kept names only its measured Linears."""
        model = type(self.model).__name__
        here = self.measured_shapes()
        saved = state.get(MEASURED_KEY)
        if saved is None:
            linears = {name for name, _ in layers.measured_linears(self.model)}
            unknown = [name for name in state.get(exact.METHODS_KEY) or {} if name not in linears]
            return f"it measured the Linear {unknown[0]}, which this {model} does not measure" if unknown else None
        if not isinstance(saved, dict):
            return f"its {MEASURED_KEY} is not GNSMeter.state_dict()'s"
        missing = [name for name in saved if name not in here]
        extra = [name for name in here if name not in saved]
        if missing or extra:
            which = f"{missing[0]} is not measured here" if missing else f"{extra[0]} is not in it"
            return f"it measured {len(saved)} parameters, this {model} {len(here)}: {which}"
        for name, shape in saved.items():
            if list(shape) != here[name]:
                return f"{name} is {list(shape)} there, {here[name]} in this {model}"
        return None


def _row_values(values):
    """step()'s values as log.csv cells: {key: a Python number or None}; anything else is a TypeError."""
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise TypeError(f"GNSMeter.step: values is a dict of names and numbers for the step's row, not "
                        f"{type(values).__name__}")
    cells = {}
    for key, value in values.items():
        if isinstance(value, torch.Tensor):
            if value.numel() != 1 or value.is_complex():
                raise TypeError(f"GNSMeter.step: values[{key!r}] is a {value.dtype} tensor of shape "
                                f"{list(value.shape)}: log.csv takes one real number a cell (.mean(), .item())")
            value = value.item()
        elif getattr(value, "size", None) == 1 and callable(getattr(value, "item", None)):
            value = value.item()  # a numpy scalar or one-element array
        if not (value is None or isinstance(value, numbers.Real)):
            raise TypeError(f"GNSMeter.step: values[{key!r}] is {type(value).__name__} {_shown(value)}, not a "
                            f"number: log.csv holds numbers only (a resume moves a row with text aside)")
        # as Python's int or float, which a CSV cell writes as a number (a bool as 1 or 0)
        cells[key] = value if value is None else int(value) if isinstance(value, numbers.Integral) else float(value)
    return cells


def _shown(value):
    """A short repr of `value` for a one-line message."""
    text = repr(value).replace("\n", " ")
    return text if len(text) <= 40 else text[:37] + "..."


def _finite_json(value):
    """`value` (dicts, lists, numbers, strings) with each non-finite float written as NON_FINITE's string."""
    if isinstance(value, dict):
        return {key: _finite_json(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_json(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    return value


def _from_finite_json(value):
    """_finite_json() undone."""
    if isinstance(value, dict):
        return {key: _from_finite_json(v) for key, v in value.items()}
    if isinstance(value, list):
        return [_from_finite_json(v) for v in value]
    return NON_FINITE.get(value, value) if isinstance(value, str) else value


def _keep_out_of_ddp_broadcast(given, model):
    """
    DistributedDataParallel with broadcast_buffers=True (its default) copies rank 0's buffers into
    every rank at each forward, which would overwrite each rank's per-example sums with rank 0's.
    Given the plain model (DDP not built yet), name its per-example-norm buffers in the list DDP
    reads when it is built (_ddp_params_and_buffers_to_ignore, set by DDP's own
    _set_params_and_buffers_to_ignore_for_model). Given a DDP wrapper, refuse it where it
    broadcasts them.
    """
    ddp_class = torch.nn.parallel.DistributedDataParallel
    wrapper = given
    while not isinstance(wrapper, ddp_class) and isinstance(getattr(wrapper, "_orig_mod", None), torch.nn.Module):
        wrapper = wrapper._orig_mod  # torch.compile's
    if not isinstance(wrapper, ddp_class):
        layers.keep_out_of_ddp_broadcast(model)  # measure() did; a model measured by hand may not have
        return
    ours = {id(b) for b in layers.all_sqgradnorm_buffers(model)}
    names = {name for name, b in model.named_buffers() if id(b) in ours}
    if wrapper.broadcast_buffers and not names <= set(wrapper.parameters_to_ignore):
        raise GNSMeterError("GNSMeter: this DistributedDataParallel broadcasts rank 0's buffers at every forward "
                            "(broadcast_buffers=True), which would overwrite each rank's per-example sums: build the "
                            "meter on the plain model before wrapping it, or wrap with broadcast_buffers=False")
