"""
The gradient noise scale of any training loop, in one object. GNSMeter measures the model
(buffered.measure, unless its layers measure already), builds the exact per-example estimator
(gnstracking.ExactGNS), and takes one call per optimizer step, after the step's last backward
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

A resume: state_dict() goes into the checkpoint, and load_state_dict() before the first step()
of the continued run carries on the live GNS and the log from that step. A meter that is not
resumed refuses an out_dir that already holds a log.csv (another run's).
hf_gns.GNSCallback and lightning_gns.GNSCallback are this object in those frameworks' loops.
"""
import os

import buffered
import gnstracking
from estimator import distributed_world_size, unwrap
from gnsmath import EMA_BETA, LOG_NAME
from tracker import LogWrapper, lock_out_dir, release_out_dir

STATE_KEYS = ("step", gnstracking.CHECKPOINT_KEY)  # what state_dict() always holds


class GNSMeter:
    """
    model: the model (or its DDP / torch.compile wrapper), measured in place unless its layers
        already keep per-example-norm buffers.
    out_dir: where log.csv, config.json and layer_kinds.json go (gns-analysis.py reads them);
        None: nothing is written.
    linear, embedding, norm, kinds, strict: buffered.measure's; a trainable parameter left
        unmeasured is named in one warning, or, with strict=True, a ValueError.
    world_size: the ranks whose buffers step() sums; default: torch.distributed's world size.
    config: a dict of the run's settings for out_dir/config.json.
    """

    def __init__(self, model, out_dir=None, linear="gns", embedding="gns", norm="shim", kinds=None, strict=False,
                 world_size=None, config=None, beta=EMA_BETA):
        self.model = unwrap(model)
        if not any(p.requires_grad for p in self.model.parameters()):
            raise ValueError(f"GNSMeter: the model ({type(self.model).__name__}) has no trainable parameters: "
                             f"there is no gradient to measure")
        if not buffered.find_sqgradnorm_buffers(self.model):
            buffered.measure(self.model, linear=linear, embedding=embedding, norm=norm, kinds=kinds, strict=strict)
        if not buffered.find_sqgradnorm_buffers(self.model):
            raise ValueError(f"GNSMeter: no layer of {type(self.model).__name__} could be measured (see the warning "
                             f"above); name your own layer classes with kinds={{Class: 'linear' | 'embedding' | "
                             f"'layernorm' | 'rmsnorm'}}")
        self.world_size = distributed_world_size() if world_size is None else int(world_size)
        self.beta = beta
        # the estimator holds the model's Parameters: it is built at the first step(), after any
        # fully_shard (FSDP2 puts sharded Parameters in place of the ones there now)
        self.estimator = None
        self.loaded_state = None  # load_state_dict()'s, for the estimator when it is built
        rank = 0
        if self.world_size > 1 and distributed_world_size() > 1:
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
        loss, the learning rate). step: the step's number (default: one after the last).
        examples: the step's batch size over all micro-steps and ranks (default: the measured
        layers' count of the examples they saw). scaler: the float16 GradScaler, if one is used.
        Returns {column: value} of the step's GNS columns and the live GNS of each group.
        """
        step = self.step_count if step is None else int(step)
        if self.out_dir is not None and self.logger is None:
            self.open_log()
        if self.estimator is None:
            self.estimator = gnstracking.ExactGNS(self.model, self.world_size, beta=self.beta)
            if self.loaded_state is not None:
                gnstracking.load_states([self.estimator], self.loaded_state)
        row = self.estimator.measure(step, examples, scaler)
        self.estimator.reset()  # the buffers start the next step at zero, whatever this one measured
        self.step_count = step + 1
        if self.logger is not None:
            if not self._methods_recorded:  # chosen in the first step, as train.py records them
                methods = buffered.linear_norm_methods(self.model)
                if methods:
                    self.logger.record_norm_methods(methods)
                self._methods_recorded = True
            self.logger.step_count = step
            self.logger.log({"iter_num": step, **(values or {}), **row})
            self.logger.step()
        return {**row, **self.live()}

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
        return self.estimator.skipped_steps if self.estimator is not None else 0

    # -- the log ---------------------------------------------------------------------------------

    def open_log(self):
        """Open out_dir's log now (step() does it at the first step): a fresh meter refuses an
        out_dir holding a log.csv, a resumed one keeps that log's rows before its step."""
        if self.out_dir is None or self.logger is not None:
            return
        path = os.path.join(self.out_dir, LOG_NAME)
        if not self.resumed and os.path.exists(path):
            raise FileExistsError(f"GNSMeter: {path} holds another run's log: give this run another out_dir, or move "
                                  f"that log away (to continue that run, load its state_dict first)")
        self._lock = lock_out_dir(self.out_dir)
        try:
            self.logger = LogWrapper(config={"gns_meter": True, "world_size": self.world_size, **self.config},
                                     out_dir=self.out_dir, resume_step=self.step_count if self.resumed else None,
                                     numbers_only=True)
            self.logger.record_kinds(buffered.layer_kinds(self.model))
        except BaseException:
            release_out_dir(self._lock)
            self._lock = None
            raise

    def close(self):
        """Close the log (and release out_dir). The meter can go on measuring, without a log."""
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
        """What a resume needs, plain numbers and strings (JSON or torch.save): the next step's
        number, the live GNS averages, and the measured Linears' ghost/materialise methods."""
        if self.estimator is None:  # nothing measured yet: what was loaded, or a fresh start
            return dict(self.loaded_state or {"step": self.step_count, gnstracking.CHECKPOINT_KEY: {}})
        state = {"step": self.step_count}
        gnstracking.save_states([self.estimator], state)
        return state

    def load_state_dict(self, state):
        """Continue the run that state_dict() came from: call it before the first step()."""
        if not isinstance(state, dict) or any(key not in state for key in STATE_KEYS):
            raise ValueError(f"GNSMeter.load_state_dict: expected GNSMeter.state_dict()'s dict, with the keys "
                             f"{', '.join(STATE_KEYS)}")
        if self.estimator is not None or self.logger is not None:
            raise ValueError("GNSMeter.load_state_dict: load the state before the first step()")
        self.loaded_state = dict(state)
        self.step_count = int(state["step"])
        self.resumed = True
