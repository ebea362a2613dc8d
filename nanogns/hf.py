"""
The gradient noise scale in Hugging Face's Trainer: one callback, attached to the Trainer.

    from nanogns.hf import GNSCallback
    trainer = Trainer(model=model, args=args, train_dataset=data)
    GNSCallback().attach(trainer)
    trainer.train()

At the start of each run (each train(), each trial of a hyperparameter search) the callback measures
the model that run trains (nanogns.GNSMeter, nanogns.measure), and on every optimizer step writes
the step's row into log.csv for gns-analysis.py (in args.output_dir unless out_dir= says otherwise;
a hyperparameter search's trials each in a folder of their own there) and the live GNS ('gns/total',
'gns/LayerNorm') into the Trainer's own logs, where report_to's integrations (wandb, tensorboard) see
them. Its state rides in the Trainer's checkpoints (trainer_state.json), so a resume from one carries
on the live GNS and the log.

attach(trainer) puts the callback first among the Trainer's callbacks: report_to's integrations come
before the callbacks given in callbacks= and read the same logs dict, so the GNS must be in it before
they run. It also gives the callback the Trainer's accelerator, for the clipping:

Clipping: the GNS is that of the gradient before clipping. The Trainer clips (args.max_grad_norm)
through its accelerator's clip_grad_norm_, before the first event a callback gets after the last
backward; so for the length of each run the callback wraps that method of the Trainer's accelerator
and measures inside it, right before the Trainer clips, whatever max norm it clips to. The Trainer's
arguments, its clipping and its logged grad_norm stay its own. A Trainer that does not clip
(max_grad_norm 0) is measured at its pre-optimizer event, unless it takes the norm through the same
method first. attach() wraps trainer.train as well, so that however a run ends (its end, an error, an
interrupt) the accelerator's method is given back and the run's log closed.

Given in callbacks= alone (Trainer(..., callbacks=[GNSCallback()])), the callback has only the
Trainer's events, and the first one after the last backward, on_pre_optimizer_step, comes after the
Trainer has clipped (its unclipped norm reaches callbacks only in on_log, at logging steps, after
the optimizer step). So it measures there, exactly as attach() does, where the Trainer does not clip
(max_grad_norm=0), and refuses, in one line saying why, a Trainer that clips. It then comes after
report_to's integrations, which log without the GNS (one warning says so), and a run that ends in
an error keeps its log open until the callback's next run.

Only code that uses the callback imports this file, and transformers with it: train.py and the
modules it imports never do.
"""
import functools
import math
import os
import warnings

from nanogns.meter import GNSMeter

try:
    from transformers import TrainerCallback
    from transformers.trainer_callback import ExportableState
except ImportError:
    raise ImportError("nanogns.hf.GNSCallback is a callback for Hugging Face's Trainer: pip install transformers "
                      "accelerate") from None


class GNSCallbackError(ValueError):
    """A setting GNSCallback cannot measure, or a Trainer it is not attached to (a one-line message)."""


class GNSCallback(TrainerCallback, ExportableState):
    """
    out_dir: where log.csv goes (default: the Trainer's args.output_dir); a fresh run refuses an
        out_dir that holds another run's log.
    linear, embedding, norm, strict: nanogns.measure's (every Linear, Embedding and normalisation
        layer by default; norm="shim", linear=None, embedding=None measures the normalisation
        layers alone); a parameter left unmeasured is named in a warning, strict=True raises.
    Attach it to the Trainer with attach(trainer) before trainer.train(); or, for a Trainer that
    does not clip (max_grad_norm=0), give it in callbacks=.
    """

    def __init__(self, out_dir=None, linear="gns", embedding="gns", norm="shim", strict=False):
        self.out_dir = out_dir
        self.layers = dict(linear=linear, embedding=embedding, norm=norm)
        self.strict = strict
        self.trainer = None      # the Trainer whose train() is running, set by attach()'s wrapper of it
        self.meter = None        # the current (or last) run's
        self.latest = {}         # the live GNS after the run's last step, for the next logs
        self.open_step = None    # the optimizer step begun and not yet measured
        self.trials = 0          # the hyperparameter-search trials begun, to give each its own log
        self.clipping = None     # (accelerator, its clip_grad_norm_ before the wrap, the wrapper) during a run

    def attach(self, trainer):
        """Attach the callback to `trainer` (a transformers.Trainer) after building it, before
        train(): it becomes the first of the Trainer's callbacks (added if callbacks= did not have
        it), and measures where the Trainer clips. Returns the callback."""
        callbacks = getattr(getattr(trainer, "callback_handler", None), "callbacks", None)
        if isinstance(callbacks, list):
            if any(isinstance(other, GNSCallback) and other is not self for other in callbacks):
                raise GNSCallbackError("GNSCallback: this Trainer has another GNSCallback already; attach one only")
            if self in callbacks:
                callbacks.remove(self)
            callbacks.insert(0, self)
        else:
            trainer.add_callback(self)
            warnings.warn("GNSCallback: the Trainer's list of callbacks (trainer.callback_handler.callbacks) was not "
                          "found, so the callback could not go first: report_to's integrations will not see the GNS "
                          "(log.csv and the Trainer's log_history still have it)")
        train = trainer.train
        if getattr(train, "gns_callback", None) is not self:
            @functools.wraps(train)
            def train_measured(*args, **kwargs):
                self.trainer = trainer
                try:
                    return train(*args, **kwargs)
                finally:  # an error or an interrupt gets no callback event
                    self._end_run()
                    self.trainer = None
            train_measured.gns_callback = self
            trainer.train = train_measured
        return self

    # -- the Trainer's events --------------------------------------------------------------------

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if args.deepspeed or args.fsdp or args.fp16:
            what = "DeepSpeed" if args.deepspeed else "FSDP" if args.fsdp else "fp16 (its GradScaler)"
            raise GNSCallbackError(f"GNSCallback does not support {what} in the Trainer yet: train in fp32 or bf16, "
                                   f"on one process or under DDP (torchrun)")
        if args.n_gpu > 1:  # the Trainer's torch.nn.DataParallel: n_gpu is 1 in each process of a distributed run
            raise GNSCallbackError(f"GNSCallback does not support the Trainer's torch.nn.DataParallel ({args.n_gpu} "
                                   f"GPUs in one process: each replica adds into its own copy of the per-example "
                                   f"sums): launch one process per GPU with torchrun, or show the process one GPU "
                                   f"(CUDA_VISIBLE_DEVICES)")
        # given in callbacks= alone: measured at on_pre_optimizer_step, which comes after the Trainer's clipping
        if self.trainer is None and (args.max_grad_norm or 0) > 0:
            raise GNSCallbackError(self._unseen_clipping(args))
        integrations = args.report_to if isinstance(args.report_to, (list, tuple)) else [args.report_to or "none"]
        if self.trainer is None and [name for name in integrations if name != "none"]:
            warnings.warn(f"GNSCallback: given in callbacks=, it runs after report_to's integrations "
                          f"({', '.join(integrations)}), which then log without the GNS (log.csv and the Trainer's "
                          f"log_history have it): GNSCallback().attach(trainer) puts it first")
        self._end_run()  # the previous run's meter, if any, is closed before this run's opens
        out_dir = args.output_dir if self.out_dir is None else self.out_dir
        if state.is_hyper_param_search:
            out_dir = os.path.join(out_dir, state.trial_name or f"trial-{self.trials}")
            self.trials += 1
        self.latest = {}
        # the model this run trains (a new one for each run with model_init), measured unless it is already
        self.meter = GNSMeter(model, out_dir=out_dir, strict=self.strict, config={"trainer": "transformers"},
                              **self.layers)
        saved = state.stateful_callbacks.get(type(self).__name__) if state.global_step > 0 else None
        if isinstance(saved, list):
            saved = saved[0]
        if saved is not None and saved.get("attributes", {}).get("meter_state"):
            self.meter.load_state_dict(saved["attributes"]["meter_state"])
        elif state.global_step > 0:
            raise GNSCallbackError(f"GNSCallback: the checkpoint this Trainer resumes at step {state.global_step} "
                                   f"holds no GNS state (it was saved without GNSCallback): start a fresh run in "
                                   f"another output_dir")
        self.meter.discard()  # what the layers hold from before this run (an interrupted step's micro-steps)
        self.meter.open_log()
        if self.trainer is not None:
            self._wrap_clipping(self.trainer.accelerator)

    def on_step_begin(self, args, state, control, **kwargs):
        # the first micro-step of an optimizer step: the buffers hold this step's micro-steps only
        self.meter.discard()
        self.open_step = state.global_step

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.open_step is None:
            return  # measured in the accelerator's clip_grad_norm_
        if args.max_grad_norm is not None and args.max_grad_norm > 0:
            if self.trainer is None:  # clipping turned on since the run began (another callback's schedule)
                raise GNSCallbackError(self._unseen_clipping(args))
            raise GNSCallbackError("GNSCallback: the Trainer clipped the gradient without its accelerator's "
                                   "clip_grad_norm_, so the gradient before clipping went unmeasured: clip through "
                                   "trainer.accelerator.clip_grad_norm_, or set max_grad_norm=0")
        self._measure()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or not self.latest or "loss" not in logs:  # the training logs, not evaluation's
            return
        finite = {key: value for key, value in self.latest.items() if math.isfinite(value)}
        logs.update(finite)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(finite)  # the copy the Trainer keeps, made before the callbacks ran

    def on_train_end(self, args, state, control, **kwargs):
        self._end_run()

    # -- the state in the Trainer's checkpoints (transformers' ExportableState) --------------------
    # The Trainer keeps it under the class's name, type(self).__name__ (a subclass's own).

    def state(self):
        meter_state = self.meter.state_dict() if self.meter is not None else None
        return {"args": {"out_dir": self.out_dir, "strict": self.strict, **self.layers},
                "attributes": {"meter_state": meter_state}}

    # ------------------------------------------------------------------------------------------

    def _measure(self):
        values = self.meter.step(step=self.open_step)
        self.open_step = None
        self.latest = {key: value for key, value in values.items() if key.startswith("gns/")}

    @staticmethod
    def _unseen_clipping(args):
        """Why a callback given only in callbacks= cannot measure a Trainer that clips, in one line."""
        restored = (" (restore_callback_states_from_checkpoint=True put an unattached copy in its place: leave it "
                    "False, the callback restores its own state)"
                    if args.restore_callback_states_from_checkpoint else "")
        return (f"GNSCallback: given in callbacks= and not attached{restored}, it first sees the gradient at "
                f"on_pre_optimizer_step, which the Trainer calls after clipping it to max_grad_norm="
                f"{args.max_grad_norm:g}, so the GNS would be that of the clipped gradient: call "
                f"GNSCallback(...).attach(trainer) before trainer.train() (it measures inside the Trainer's "
                f"clipping), or train with max_grad_norm=0")

    def _wrap_clipping(self, accelerator):
        """Measure inside accelerator.clip_grad_norm_, at the optimizer step's first call of it (the
        Trainer's clipping, or its norm without clipping), before it clips."""
        clip = accelerator.clip_grad_norm_

        def measure_then_clip(parameters, max_norm, *args, **kwargs):
            if self.open_step is not None and accelerator.sync_gradients:  # the step's last micro-step is done
                self._measure()
            return clip(parameters, max_norm, *args, **kwargs)

        self.clipping = (accelerator, vars(accelerator).get("clip_grad_norm_"), measure_then_clip)
        accelerator.clip_grad_norm_ = measure_then_clip

    def _end_run(self):
        """Give the accelerator its clip_grad_norm_ back and close the run's log; a second call does nothing."""
        if self.clipping is not None:
            accelerator, before, wrapper = self.clipping
            if vars(accelerator).get("clip_grad_norm_") is wrapper:
                if before is None:
                    del accelerator.clip_grad_norm_  # the class's method again
                else:
                    accelerator.clip_grad_norm_ = before
            self.clipping = None
        self.open_step = None
        if self.meter is not None:
            self.meter.close()
