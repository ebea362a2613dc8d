"""
The gradient noise scale in Lightning: one callback, no other change.

    from lightning_gns import GNSCallback
    trainer = lightning.Trainer(..., callbacks=[GNSCallback()])

The callback measures the LightningModule when training is set up (gnsmeter.GNSMeter,
buffered.measure), and on every optimizer step writes the step's row into log.csv for
gns-analysis.py (in trainer.default_root_dir unless out_dir= says otherwise) and logs the live
GNS ('gns/total', 'gns/LayerNorm') through the module's log, to the Trainer's loggers.

Lightning calls on_before_optimizer_step once per optimizer step, after the last accumulated
backward and before it clips the gradients: the GNS is that of the gradient before clipping.
The callback's state goes into Lightning's checkpoints, so a fit resumed from one (ckpt_path=)
carries on the live GNS and the log.

Only code that uses the callback imports this file, and lightning with it: train.py and the
modules it imports never do.
"""
import math

from gnsmeter import GNSMeter

try:
    import lightning
except ImportError:
    raise ImportError("lightning_gns.GNSCallback is a callback for Lightning's Trainer: pip install lightning") from None


class GNSCallback(lightning.pytorch.Callback):
    """
    out_dir: where log.csv goes (default: the Trainer's default_root_dir); a fresh fit refuses an
        out_dir that holds another run's log.
    module: the attribute of the LightningModule that training_step calls, e.g. "model" (default:
        the one child module holding every trainable parameter, if there is one, else the
        LightningModule itself). measure() learns each step's batch from that module's input,
        so it must be the one called with the batch.
    linear, embedding, norm, strict: buffered.measure's (every Linear, Embedding and normalisation
        layer by default); a parameter left unmeasured is named in a warning, strict=True raises.
    """

    def __init__(self, out_dir=None, module=None, linear="gns", embedding="gns", norm="shim", strict=False):
        self.out_dir = out_dir
        self.module = module
        self.layers = dict(linear=linear, embedding=embedding, norm=norm)
        self.strict = strict
        self.meter = None
        self.saved_state = None  # the meter's state from a checkpoint, loaded before the fit starts

    def setup(self, trainer, pl_module, stage):
        if stage != "fit" or self.meter is not None:
            return
        # before the strategy wraps the module (DDP) and before any torch.compile
        self.meter = GNSMeter(self._measured_module(pl_module), out_dir=trainer.default_root_dir if self.out_dir is None else self.out_dir,
                              strict=self.strict, world_size=trainer.world_size, config={"trainer": "lightning"},
                              **self.layers)

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
        if self.saved_state is not None:
            self.meter.load_state_dict(self.saved_state)
        elif trainer.global_step > 0:
            raise ValueError(f"GNSCallback: the checkpoint this fit resumes at step {trainer.global_step} holds no "
                             f"GNS state (it was saved without GNSCallback): start a fresh fit in another out_dir")
        self.meter.open_log()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        values = self.meter.step(step=trainer.global_step)
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
