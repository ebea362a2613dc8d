"""
The gradient noise scale in Lightning: one callback, no other change.

    from nanogns.lightning import GNSCallback
    trainer = lightning.Trainer(..., callbacks=[GNSCallback()])

The callback measures the LightningModule when training is set up (nanogns.GNSMeter,
nanogns.measure), and on every optimizer step writes the step's row into log.csv for
gns-analysis.py (in trainer.default_root_dir unless out_dir= says otherwise) and logs the live
GNS ('gns/total', 'gns/LayerNorm') through the module's log, to the Trainer's loggers.

Lightning calls on_before_optimizer_step once per optimizer step, after the last accumulated
backward and before it clips the gradients: the GNS is that of the gradient before clipping.
The callback's state goes into Lightning's checkpoints, so a fit resumed from one (ckpt_path=)
carries on the live GNS and the log. Each fit gets a meter of its own, on the module it trains;
the same Trainer's next fit of the same module carries on from the last fit's meter, and a fit
that starts a new run at step 0 refuses an out_dir holding a log (GNSMeter's rule).

Only code that uses the callback imports this file, and lightning with it: train.py and the
modules it imports never do.
"""
import math
import os
import weakref

from nanogns.maths import LOG_NAME
from nanogns.meter import GNSMeter

try:
    import lightning
except ImportError:
    raise ImportError("nanogns.lightning.GNSCallback is a callback for Lightning's Trainer: pip install lightning") from None


class GNSCallback(lightning.pytorch.Callback):
    """
    out_dir: where log.csv goes (default: the Trainer's default_root_dir); a fit that starts a new
        run at step 0 refuses an out_dir that holds another run's log.
    module: the attribute of the LightningModule that training_step calls, e.g. "model" (default:
        the one child module holding every trainable parameter, if there is one, else the
        LightningModule itself). measure() learns each step's batch from that module's input,
        so it must be the one called with the batch.
    linear, embedding, norm, strict: nanogns.measure's (every Linear, Embedding and normalisation
        layer by default); a parameter left unmeasured is named in a warning, strict=True raises.
    """

    def __init__(self, out_dir=None, module=None, linear="gns", embedding="gns", norm="shim", strict=False):
        self.out_dir = out_dir
        self.module = module
        self.layers = dict(linear=linear, embedding=embedding, norm=norm)
        self.strict = strict
        self.meter = None         # this fit's meter, on the module it trains
        self.saved_state = None   # the meter's state from this fit's checkpoint, loaded before the fit starts
        self.last_run = None      # (Trainer's weak reference, meter) of the last fit that started: one may continue it
        self.clean = False        # the measured layers' buffers hold nothing since the last step() or discard()

    def setup(self, trainer, pl_module, stage):
        if stage != "fit":
            return
        # every fit gets a meter of its own, on the module it trains; the last fit's is closed (its
        # log and out_dir given back), and a fit that continues it takes its state in on_train_start
        if self.meter is not None:
            self.meter.close()
        self.saved_state = None  # a checkpoint this fit resumes sets it (load_state_dict) before on_train_start
        # before the strategy wraps the module (DDP) and before any torch.compile
        out_dir = trainer.default_root_dir if self.out_dir is None else self.out_dir
        self.meter = GNSMeter(self._measured_module(pl_module), out_dir=out_dir, strict=self.strict,
                              world_size=trainer.world_size, config={"trainer": "lightning"}, **self.layers)

    def _measured_module(self, pl_module):
        if self.module is not None:
            found = pl_module.get_submodule(self.module) if isinstance(self.module, str) else None
            if found is None:
                raise ValueError(f"GNSCallback: module= names an attribute of the LightningModule, as a string, "
                                 f"not {self.module!r}")
            return found
        trainable = {id(p) for p in pl_module.parameters() if p.requires_grad}
        holders = [child for child in pl_module.children()
                   if trainable and {id(p) for p in child.parameters() if p.requires_grad} == trainable]
        return holders[0] if len(holders) == 1 else pl_module

    def on_train_start(self, trainer, pl_module):
        if getattr(trainer.precision_plugin, "scaler", None) is not None:
            raise ValueError("GNSCallback does not support precision='16-mixed' yet (Lightning unscales the "
                             "gradients before the callback sees them): use '32' or 'bf16-mixed'")
        step = trainer.global_step
        last_trainer, last_meter = (self.last_run[0](), self.last_run[1]) if self.last_run else (None, None)
        if self.saved_state is not None:
            self.meter.load_state_dict(self.saved_state)
        elif step > 0 and trainer.ckpt_path is not None:
            raise ValueError(f"GNSCallback: the checkpoint this fit resumes at step {step} holds no GNS state (it "
                             f"was saved without GNSCallback): start a fresh fit in another out_dir")
        elif step > 0 and last_trainer is trainer and last_meter.model is self.meter.model:
            # the same Trainer fits the same module on from its step: the log and the live GNS carry on
            self.meter.load_state_dict({**last_meter.state_dict(), "step": step})
        elif step > 0:
            raise ValueError(f"GNSCallback: this fit starts at step {step} with no GNS state to carry on (no "
                             f"checkpoint saved with GNSCallback, nor this callback's last fit of the same module "
                             f"on this Trainer): start a fresh fit (a new Trainer) in another out_dir")
        try:
            self.meter.open_log()
        except FileExistsError:  # GNSMeter's refusal, in the words of a Lightning fit
            log = os.path.join(self.meter.out_dir, LOG_NAME)
            raise FileExistsError(f"GNSCallback: {log} holds another run's log, and this fit starts a new run at "
                                  f"step 0: give it another out_dir (default_root_dir= or GNSCallback(out_dir=)), or "
                                  f"move that log away (a run continues with ckpt_path=, or as the same Trainer's "
                                  f"next fit)") from None
        self.meter.discard()  # what an earlier fit left in the buffers (an exception mid-step) is not this fit's
        self.clean = True
        self.last_run = (weakref.ref(trainer), self.meter)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        # each optimizer step starts from clean buffers: the micro-batches of a step that never
        # reached the optimizer (an optimizer_step that skipped it) do not count into the next. step()
        # leaves them clean, so only a window after a skipped step zeroes them. Under manual
        # optimization the module accumulates as it likes, and its steps reset them.
        if pl_module.automatic_optimization and batch_idx % trainer.accumulate_grad_batches == 0:
            if not self.clean:
                self.meter.discard()
            self.clean = False

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        values = self.meter.step(step=trainer.global_step)
        self.clean = True
        live = {key: value for key, value in values.items() if key.startswith("gns/") and math.isfinite(value)}
        if live:
            pl_module.log_dict(live, on_step=True, on_epoch=False)

    def on_train_end(self, trainer, pl_module):
        self.meter.close()

    def on_exception(self, trainer, pl_module, exception):
        if self.meter is not None:
            self.meter.close()

    def state_dict(self):
        return {"meter": self.meter.state_dict()} if self.meter is not None else {}

    def load_state_dict(self, state_dict):
        self.saved_state = state_dict.get("meter")
