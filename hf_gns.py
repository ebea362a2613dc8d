"""
The gradient noise scale in Hugging Face's Trainer: one callback, no other change.

    from hf_gns import GNSCallback
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[GNSCallback()])

The callback measures the model at the start of training (gnsmeter.GNSMeter, buffered.measure),
and on every optimizer step writes the step's row into log.csv for gns-analysis.py (in
args.output_dir unless out_dir= says otherwise) and the live GNS ('gns/total', 'gns/LayerNorm')
into the Trainer's own logs, where report_to's integrations (wandb, tensorboard) see them.
Its state rides in the Trainer's checkpoints (trainer_state.json), so a resume from one carries
on the live GNS and the log.

Clipping: the GNS is that of the gradient before clipping. The Trainer clips (max_grad_norm)
before the first event a callback gets after the last backward, so the callback measures before
the Trainer clips: it holds args.max_grad_norm at 0 from the start of each optimizer step to its
pre-optimizer event, where it measures, puts the value back and clips itself with the same
torch.nn.utils.clip_grad_norm_ and max norm as the Trainer's accelerator does. The Trainer still
computes and logs the gradient norm before clipping, so its logs and the training are unchanged.

Only code that uses the callback imports this file, and transformers with it: train.py and the
modules it imports never do.
"""
import math
import sys
import warnings

import torch

from gnsmeter import GNSMeter

try:
    from transformers import TrainerCallback
    from transformers.trainer_callback import CallbackHandler, ExportableState
except ImportError:
    raise ImportError("hf_gns.GNSCallback is a callback for Hugging Face's Trainer: pip install transformers "
                      "accelerate") from None

STATE_NAME = "GNSCallback"  # the key of the callback's state in trainer_state.json's stateful_callbacks


class GNSCallback(TrainerCallback, ExportableState):
    """
    out_dir: where log.csv goes (default: the Trainer's args.output_dir); a fresh run refuses an
        out_dir that holds another run's log.
    linear, embedding, norm, strict: buffered.measure's (every Linear, Embedding and normalisation
        layer by default; norm="shim", linear=None, embedding=None measures the normalisation
        layers alone); a parameter left unmeasured is named in a warning, strict=True raises.
    """

    def __init__(self, out_dir=None, linear="gns", embedding="gns", norm="shim", strict=False):
        self.out_dir = out_dir
        self.layers = dict(linear=linear, embedding=embedding, norm=norm)
        self.strict = strict
        self.meter = None
        self.latest = {}       # the live GNS after the last step, for the next logs
        self.saved_state = None  # the meter's state as restored from a checkpoint, until the meter exists
        self.max_grad_norm = None  # the Trainer's, held while the callback measures before clipping

    # -- the Trainer's events --------------------------------------------------------------------

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if args.deepspeed or args.fsdp or args.fp16:
            what = "DeepSpeed" if args.deepspeed else "FSDP" if args.fsdp else "fp16 (its GradScaler)"
            raise ValueError(f"GNSCallback does not support {what} in the Trainer yet: train in fp32 or bf16, on "
                             f"one process or under DDP (torchrun)")
        if self.meter is None:
            self.meter = GNSMeter(model, out_dir=args.output_dir if self.out_dir is None else self.out_dir,
                                  strict=self.strict, config={"trainer": "transformers"}, **self.layers)
        saved = state.stateful_callbacks.get(STATE_NAME) if state.global_step > 0 else None
        if isinstance(saved, list):
            saved = saved[0]
        if saved is not None and saved.get("attributes", {}).get("meter_state"):
            self.meter.load_state_dict(saved["attributes"]["meter_state"])
        elif state.global_step > 0:
            raise ValueError(f"GNSCallback: the checkpoint this Trainer resumes at step {state.global_step} holds no "
                             f"GNS state (it was saved without GNSCallback): start a fresh run in another output_dir")
        self.meter.open_log()
        self._report_first()

    def on_step_begin(self, args, state, control, **kwargs):
        # hold the Trainer's clipping until on_pre_optimizer_step has measured (see the module docstring)
        if args.max_grad_norm and args.max_grad_norm > 0:
            self.max_grad_norm, args.max_grad_norm = args.max_grad_norm, 0.0

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        max_grad_norm, self.max_grad_norm = self.max_grad_norm, None
        if max_grad_norm is not None:
            args.max_grad_norm = max_grad_norm
        values = self.meter.step(step=state.global_step)
        self.latest = {key: value for key, value in values.items() if key.startswith("gns/")}
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or not self.latest or "loss" not in logs:  # the training logs, not evaluation's
            return
        finite = {key: value for key, value in self.latest.items() if math.isfinite(value)}
        logs.update(finite)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(finite)  # the copy the Trainer keeps, made before the callbacks ran

    def on_train_end(self, args, state, control, **kwargs):
        if self.max_grad_norm is not None:
            args.max_grad_norm, self.max_grad_norm = self.max_grad_norm, None
        if self.meter is not None:
            self.meter.close()

    # -- the state in the Trainer's checkpoints (transformers' ExportableState) --------------------

    def state(self):
        meter_state = self.meter.state_dict() if self.meter is not None else None
        return {"args": {"out_dir": self.out_dir, "strict": self.strict, **self.layers},
                "attributes": {"meter_state": meter_state}}

    # ------------------------------------------------------------------------------------------

    def _report_first(self):
        """report_to's integrations come before the callbacks given to the Trainer, and read the
        same logs dict in on_log: this callback moves itself to the front of the Trainer's list,
        so that the GNS is in that dict before they read it."""
        frame = sys._getframe(1)
        while frame is not None:
            handler = frame.f_locals.get("self")
            callbacks = getattr(handler, "callbacks", None)
            if isinstance(handler, CallbackHandler) and isinstance(callbacks, list) and self in callbacks:
                callbacks.remove(self)
                callbacks.insert(0, self)
                return
            frame = frame.f_back
        warnings.warn("GNSCallback: the Trainer's list of callbacks was not found: report_to's integrations "
                      "will not see the GNS (log.csv and the Trainer's log_history still have it)")

