"""
The gradient noise scale in OLMo-core's Trainer: one callback. Measure the model before the train
module parallelises it (the measured layers must be in place before FSDP, DDP, tensor or context
parallelism wraps them), then give the Trainer the callback:

    import nanogns
    from nanogns.olmo import GNSCallback
    model = nanogns.measure(model_config.build(init_device="cpu"))
    train_module = train_module_config.build(model)
    trainer = trainer_config.with_callback("gns", GNSCallback()).build(train_module, data_loader)
    trainer.fit()

On every optimizer step the callback writes the step's row into log.csv for gns-analysis.py (in
out_dir, default the Trainer's save_folder/gns; its step column counts from 0, OLMo-core's step 1 its 0) and puts the live GNS ('gns/total', 'gns/LayerNorm')
into OLMo-core's own metrics, where its wandb and comet callbacks see them (and its console logger, to
whose list the callback adds them). It measures at
pre_optim_step, after the last micro-batch's backward and before the train module clips: the GNS is
that of the gradient before clipping. Its state rides in OLMo-core's checkpoints (the trainer state's
"callbacks"), so a run resumed from one carries on the live GNS and the log.

What each parallelism measures (the train module's dp, tp and cp configs):
- DDP, FSDP, HSDP: every measured layer; the sums add over the data-parallel ranks.
- tensor parallelism: every layer (nanogns/layers/sharded.py: a weight's shards add, the vocabulary-sharded
  Embedding's too; a replicated bias and a sequence-parallel norm count once).
- context parallelism: each example's tokens are split over the cp ranks, so a per-example norm needs
  every rank's part of the example. The normalisations sum their per-example vectors over the cp group
  before squaring (split_tokens: one [B, D] all_reduce per layer per micro-batch) and are exact; a
  Linear or Embedding would need the other ranks' activations and is refused: measure the model with
  linear=None, embedding=None (the paper's normalisation-only GNS).

The batch size from the GNS (bs_controller="gns"): train.py's --bs_controller=gns rules in OLMo-core's
units. The start is the data loader's global batch (tokens), also the floor; the ceiling bs_max_tokens
is a power-of-two multiple of it, as OLMo-core changes its batch by whole factors only. The target is
bs_gns_fraction x the live GNS of bs_gns_group (examples, made tokens), rounded up to the start's
power-of-two multiples; the batch stays at the start until the GNS's EMA has averaged
bs_warmup_steps steps, changes at most once per bs_update_tokens tokens, shrinks only with
bs_allow_decrease, grows only where the data loader can (its batches so far a multiple of the
factor: OLMo-core's own rule), and every rank takes rank 0's decision. The learning rate is left as
the run's schedule sets it. The batch's tokens and the target are in log.csv
('bs_controller/batch_tokens', 'bs_controller/target_examples').

Only code that uses the callback imports this file, and olmo_core with it: train.py never does.
"""
import math
import os
from dataclasses import dataclass
from typing import Optional

import torch

from nanogns import layers
from nanogns.estimators import exact
from nanogns.maths import NORM_KINDS
from nanogns.meter import GNSMeter
from nanogns.schedules import GNSBatchController

try:
    from olmo_core.train.callbacks import Callback, ConsoleLoggerCallback
except ImportError:
    raise ImportError("nanogns.olmo.GNSCallback is a callback for OLMo-core's Trainer: pip install 'nanogns[olmo]' "
                      "(ai2-olmo-core)") from None

BS_CONTROLLERS = ("none", "gns")


class GNSCallbackError(ValueError):
    """A setting or a model GNSCallback cannot measure (a one-line message)."""


@dataclass
class GNSCallback(Callback):
    """
    out_dir: where log.csv, config.json and layer_kinds.json go (default: the Trainer's save_folder/gns);
        a fresh run refuses an out_dir that holds another run's log.
    bs_controller: "none", or "gns" to set the global batch from the live GNS (the module's docstring),
        with bs_max_tokens (the ceiling, global tokens; required), bs_gns_fraction, bs_gns_group ("total"
        or "LayerNorm"; None: the group measured, LayerNorm where the normalisations alone are),
        bs_warmup_steps, bs_update_tokens (None: a hundredth of the run's max_duration in tokens) and
        bs_allow_decrease, train.py's flags of the same names.
    """
    out_dir: Optional[str] = None
    bs_controller: str = "none"
    bs_max_tokens: Optional[int] = None
    bs_gns_fraction: float = 1.0
    bs_gns_group: Optional[str] = None
    bs_warmup_steps: int = 50
    bs_update_tokens: Optional[int] = None
    bs_allow_decrease: bool = False
    enabled: bool = True

    # set when attached (class attributes, so that they are no config fields)
    _meter = None
    _controller = None
    _start_batch = None      # the data loader's global batch (tokens) at the start: the floor
    _examples = None         # the global examples of the step being trained, from its batch
    _saved = None            # the controller's state from a checkpoint, applied once the loader's is loaded

    def __post_init__(self):
        if self.bs_controller not in BS_CONTROLLERS:
            raise GNSCallbackError(f"GNSCallback: bs_controller={self.bs_controller!r} is not one of "
                                   f"{', '.join(map(repr, BS_CONTROLLERS))}")
        if self.bs_controller == "gns":
            checks = [("bs_max_tokens", self.bs_max_tokens, isinstance(self.bs_max_tokens, int) and self.bs_max_tokens > 0),
                      ("bs_gns_fraction", self.bs_gns_fraction, isinstance(self.bs_gns_fraction, (int, float))
                       and math.isfinite(self.bs_gns_fraction) and self.bs_gns_fraction > 0),
                      ("bs_gns_group", self.bs_gns_group, self.bs_gns_group in (None, "total", "LayerNorm")),
                      ("bs_warmup_steps", self.bs_warmup_steps, isinstance(self.bs_warmup_steps, int)
                       and self.bs_warmup_steps >= 1),
                      ("bs_update_tokens", self.bs_update_tokens, self.bs_update_tokens is None or (
                          isinstance(self.bs_update_tokens, int) and self.bs_update_tokens >= 0))]
            for name, value, good in checks:
                if not good:
                    raise GNSCallbackError(f"GNSCallback: {name}={value!r} is not valid: bs_max_tokens a positive "
                                           f"number of tokens, bs_gns_fraction > 0, bs_gns_group 'total', "
                                           f"'LayerNorm' or None, bs_warmup_steps >= 1, bs_update_tokens >= 0 or None")

    # -- OLMo-core's events ------------------------------------------------------------------------

    def post_attach(self):
        if not self.enabled:
            return
        train_module = self.trainer.train_module
        model = getattr(train_module, "model", None)
        if not isinstance(model, torch.nn.Module) or not hasattr(train_module, "world_mesh"):
            raise GNSCallbackError(f"GNSCallback measures the model of a TransformerTrainModule; this Trainer's "
                                   f"train module is a {type(train_module).__name__}")
        if not layers.find_sqgradnorm_buffers(model):
            raise GNSCallbackError("GNSCallback: the train module's model has no measured layers: measure the model "
                                   "before the train module is built, model = nanogns.measure(model_config.build(...)), "
                                   "then train_module_config.build(model)")
        mesh = train_module.world_mesh
        tp = bool(getattr(train_module, "tp_enabled", False))
        cp = bool(getattr(train_module, "cp_enabled", False))
        compiled = any(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())
        if compiled and (tp or cp):  # the measured layers' sharded maths runs eagerly only (layers/sharded.py)
            raise GNSCallbackError(f"GNSCallback: a compiled model (compile_model=True) under "
                                   f"{'tensor' if tp else 'context'} parallelism is not measured: the measured "
                                   f"layers take DTensors and split tokens in eager mode only; train it uncompiled")
        if cp:
            from olmo_core.distributed.parallel import get_cp_mesh
            try:
                # OLMo-core scales each cp rank's loss by the cp size and averages the gradient over dp x cp
                layers.split_tokens(model, get_cp_mesh(mesh).get_group(), average=True)
            except ValueError as e:
                raise GNSCallbackError(f"GNSCallback, under context parallelism: {str(e).removeprefix('split_tokens: ')}"
                                       ) from None
        group = train_module.dp_process_group
        dp = torch.distributed.get_world_size(group) if group is not None else 1
        out_dir = self.out_dir or os.path.join(str(self.trainer.save_folder), "gns")
        loader = self.trainer.data_loader
        config = {"trainer": "olmo-core", "data_parallel": dp,
                  "tensor_parallel": _mesh_size(mesh, "tp") if tp else 1,
                  "context_parallel": _mesh_size(mesh, "cp") if cp else 1,
                  "global_batch_tokens": loader.global_batch_size,
                  "rank_microbatch_tokens": getattr(train_module, "rank_microbatch_size", None),
                  "bs_controller": self.bs_controller}
        self._meter = GNSMeter(model, out_dir=out_dir, world_size=dp, group=group, config=config)
        for callback in self.trainer.callbacks.values():  # the console prints the metrics it lists: the GNS too
            if isinstance(callback, ConsoleLoggerCallback) and "gns/*" not in callback.metrics:
                callback.metrics.append("gns/*")
        if self.bs_controller == "gns":
            self._controller = self._build_controller(model, loader)

    def pre_step(self, batch):
        if self._meter is None:
            return
        self._meter.discard()  # what the layers hold from before this step (a step given up, a skipped one)
        ids = batch.get("input_ids")
        self._examples = ids.shape[0] * self._meter.world_size if isinstance(ids, torch.Tensor) else None

    def pre_optim_step(self):
        if self._meter is None:
            return
        values = self._controller_row() if self._controller is not None else None
        # log.csv counts steps from 0, as train.py's does: OLMo-core's step 1 is its row 0
        live = self._meter.step(values=values, step=self.step - 1, examples=self._examples)
        for key in ("gns/total", "gns/LayerNorm"):
            value = live.get(key)
            if value is not None and math.isfinite(value):
                self.trainer.record_metric(key, value)

    def pre_load_batch(self):
        if self._controller is not None:
            self._change_batch()

    def post_checkpoint_loaded(self, path):
        del path
        if self._controller is not None and self._saved is not None:
            # the loader's position and batch are the checkpoint's now: the controller's state with them
            self._controller.load_state_dict(self._saved)
            self._saved = None

    def close(self):
        if self._meter is not None:
            self._meter.close()

    # -- the state in OLMo-core's checkpoints ------------------------------------------------------

    def state_dict(self):
        if self._meter is None:
            return {}
        state = {"meter": self._meter.state_dict()}
        if self._controller is not None:
            state["bs_controller"] = self._controller.state_dict()
        return state

    def load_state_dict(self, state_dict):
        if self._meter is None or not state_dict:
            return
        if "meter" not in state_dict:
            raise GNSCallbackError("GNSCallback: the checkpoint holds no GNS state (it was saved without "
                                   "GNSCallback): start a fresh run in another save_folder")
        self._meter.load_state_dict(state_dict["meter"])
        if self._controller is not None and "bs_controller" in state_dict:
            self._saved = state_dict["bs_controller"]
            self._controller.load_state_dict(self._saved)

    # -- the batch size from the GNS ------------------------------------------------------------------

    def _build_controller(self, model, loader):
        start = loader.global_batch_size
        factor = self.bs_max_tokens // start
        if self.bs_max_tokens % start or factor & (factor - 1):
            raise GNSCallbackError(f"GNSCallback: bs_max_tokens={self.bs_max_tokens} is not a power-of-two multiple "
                                   f"of the data loader's global batch, {start} tokens (OLMo-core changes its batch "
                                   f"by whole factors): give {start} x 2^k")
        kinds = set(layers.layer_kinds(model).values())
        norms_only = kinds <= set(NORM_KINDS)
        group = self.bs_gns_group or ("LayerNorm" if norms_only else "total")
        if group == "LayerNorm" and not kinds & set(NORM_KINDS):
            raise GNSCallbackError("GNSCallback: bs_gns_group='LayerNorm' but no normalisation layer is measured")
        seq_len = getattr(getattr(loader, "dataset", None), "sequence_length", None)
        if not seq_len:
            raise GNSCallbackError(f"GNSCallback: bs_controller='gns' needs a data loader of fixed-length instances "
                                   f"(its sequence_length), not a {type(loader).__name__}")
        update_tokens = self.bs_update_tokens
        if update_tokens is None:
            duration = self.trainer.max_duration
            total = duration.value if duration.unit == "tokens" else self.trainer.max_steps * start
            update_tokens = total // 100
        self._start_batch = start
        meter = self._meter
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        return GNSBatchController(
            lambda: exact.live_gns([meter.build_estimator()], group),  # a resumed run's averages before its first step
            fraction=self.bs_gns_fraction, batch_size=start // seq_len, floor=1, ceiling=factor,
            warmup_steps=self.bs_warmup_steps, update_tokens=update_tokens, allow_decrease=self.bs_allow_decrease,
            ddp_device="cpu" if distributed and torch.distributed.get_backend() == "gloo" else (
                torch.device("cuda", torch.cuda.current_device()) if distributed else None),
            powers_of_two=True)

    def _change_batch(self):
        """Before each batch is loaded: the controller's batch, where the data loader can take it now."""
        loader = self.trainer.data_loader
        wanted = self._start_batch * self._controller.steps_at(self.trainer.global_train_tokens_seen)
        current = loader.global_batch_size
        if wanted > current and loader.batches_processed % (wanted // current):
            return  # growing by a factor waits for a multiple of it (the loader would skip or repeat data)
        if wanted != current:
            loader.global_batch_size = wanted

    def _controller_row(self):
        return {"bs_controller/target_examples": self._controller.target,
                "bs_controller/batch_tokens": self.trainer.data_loader.global_batch_size}


def _mesh_size(mesh, name):
    names = mesh.mesh_dim_names or ()
    return mesh[name].size() if name in names else 1
