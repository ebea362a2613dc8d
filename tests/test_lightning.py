"""
lightning_gns.GNSCallback in Lightning's Trainer: the same GNS as our own loop (and so as the
Hugging Face Trainer's callback) on the same model and batches, with gradient accumulation and
clipping on; the live GNS in Lightning's loggers; a fit resumed from a checkpoint; refusals; one
callback over several fits (each fit's own module, a continued fit, a fit after an exception).
"""
import copy
import csv
import os

import pytest
import torch

lightning = pytest.importorskip("lightning")

from gns_fixtures import one_thread, shapes_rule, tiny_hf  # noqa: E402,F401  (one_thread, shapes_rule: autouse)
from nanogns.lightning import GNSCallback  # noqa: E402
from loop_fixtures import (LR, assert_bfloat16_rounding, gns_columns, installed_package,  # noqa: E402
                           largest_difference, own_loop, run_readme_example, token_rows, torchrun_two_ranks)

BATCH, ACCUMULATION, STEPS, MAX_GRAD_NORM = 4, 2, 4, 0.5


class CausalLM(lightning.LightningModule):
    def __init__(self, model=None):
        super().__init__()
        self.model = tiny_hf("gpt2").train() if model is None else model

    def training_step(self, batch, index):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.0)


class PlainSGD(CausalLM):
    """SGD without momentum keeps no state: a second fit, which builds its optimizer anew, trains on as one fit does."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


class Abandoned(Exception):
    pass


class FailsOnce(CausalLM):
    """Raises Abandoned from training_step at its call number fail_at (from 0, counted over every fit), once."""

    def __init__(self, fail_at):
        super().__init__()
        self.fail_at, self.calls = fail_at, 0

    def training_step(self, batch, index):
        self.calls += 1
        if self.calls - 1 == self.fail_at:
            raise Abandoned(f"training_step call {self.fail_at}")
        return super().training_step(batch, index)


class SkipsFirstStep(CausalLM):
    """optimizer_step runs the first step's micro-batches (the closure) but not the optimizer, as a
    module that skips a bad step does."""

    def optimizer_step(self, epoch, batch_index, optimizer, optimizer_closure):
        if batch_index < ACCUMULATION:
            optimizer_closure()
        else:
            optimizer.step(closure=optimizer_closure)


class ManualAccumulation(CausalLM):
    """Manual optimization, accumulating ACCUMULATION batches into each optimizer step itself."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, index):
        self.manual_backward(super().training_step(batch, index) / ACCUMULATION)
        if (index + 1) % ACCUMULATION == 0:
            optimizer = self.optimizers()
            optimizer.step()
            optimizer.zero_grad()


def trainer_for(out_dir, callbacks, steps=STEPS, logger=False, epochs=None, **settings):
    """The tests' Trainer: STEPS optimizer steps (or whole epochs) of ACCUMULATION micro-batches, clipped;
    settings: other Trainer arguments, in place of these."""
    return lightning.Trainer(**{
        **dict(default_root_dir=str(out_dir), max_steps=-1 if epochs else steps, max_epochs=epochs,
               accumulate_grad_batches=ACCUMULATION, gradient_clip_val=MAX_GRAD_NORM, accelerator="cpu", devices=1,
               logger=logger, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
               log_every_n_steps=1, callbacks=callbacks),
        **settings})


def loader(rows):
    return torch.utils.data.DataLoader(rows, batch_size=BATCH, shuffle=False)


def fit(out_dir, rows, callbacks, steps=STEPS, module=None, ckpt_path=None, logger=False, epochs=None):
    trainer = trainer_for(out_dir, callbacks, steps, logger, epochs)
    module = CausalLM() if module is None else module
    trainer.fit(module, loader(rows), ckpt_path=ckpt_path)
    return trainer, module


def test_the_lightning_callback_gives_our_loops_numbers(tmp_path):
    rows = token_rows(BATCH * ACCUMULATION * STEPS)
    ours, _, _ = own_loop(str(tmp_path / "ours"), rows, BATCH, ACCUMULATION, STEPS, MAX_GRAD_NORM)
    logger = lightning.pytorch.loggers.CSVLogger(str(tmp_path / "logs"), name="", version="")
    _, module = fit(tmp_path / "pl", rows, [GNSCallback()], logger=logger)
    assert largest_difference(gns_columns(str(tmp_path / "ours")), gns_columns(str(tmp_path / "pl"))) < 1e-5
    for (name, mine), theirs in zip(ours.named_parameters(), module.model.parameters()):
        torch.testing.assert_close(theirs, mine, rtol=1e-5, atol=1e-6, msg=name)
    with open(tmp_path / "logs" / "metrics.csv", newline="") as f:
        logged = [row for row in csv.DictReader(f) if row.get("gns/total")]
    assert len(logged) == STEPS  # the live GNS of every optimizer step, through the module's log


def test_a_fit_resumed_from_its_checkpoint_continues_the_gns(tmp_path):
    # an epoch is 3 optimizer steps, and the cut falls between epochs (where Lightning resumes a plain DataLoader)
    rows = token_rows(BATCH * ACCUMULATION * 3)
    whole_callback = GNSCallback()
    fit(tmp_path / "whole", rows, [whole_callback], epochs=2)
    trainer, _ = fit(tmp_path / "cut", rows, [GNSCallback()], epochs=1)
    trainer.save_checkpoint(str(tmp_path / "cut.ckpt"))
    resumed_callback = GNSCallback()
    fit(tmp_path / "cut", rows, [resumed_callback], epochs=2, ckpt_path=str(tmp_path / "cut.ckpt"))
    assert sorted(gns_columns(str(tmp_path / "cut"))) == list(range(6))
    assert largest_difference(gns_columns(str(tmp_path / "whole")), gns_columns(str(tmp_path / "cut"))) < 1e-5
    assert resumed_callback.meter.live()["gns/total"] == pytest.approx(whole_callback.meter.live()["gns/total"],
                                                                       rel=1e-5)


def test_refusals_are_one_line(tmp_path):
    rows = token_rows(BATCH * ACCUMULATION)
    fit(tmp_path / "taken", rows, [GNSCallback()], steps=1)
    with pytest.raises(FileExistsError, match="holds another run's log") as error:
        fit(tmp_path / "taken", rows, [GNSCallback()], steps=1)
    assert "\n" not in str(error.value)
    assert sorted(gns_columns(str(tmp_path / "taken"))) == [0]
    with pytest.raises(ValueError, match="module= names an attribute"):
        fit(tmp_path / "bad", rows, [GNSCallback(module=3)], steps=1)


def test_the_readme_example_runs_as_written(tmp_path, tmp_path_factory):
    run_readme_example(2, tmp_path, "out-lightning", "7 parameters (LayerNorm 2, Linear 4, Embedding 1)",
                       installed_package(tmp_path_factory))
    with open(tmp_path / "out-lightning" / "lightning_logs" / "version_0" / "metrics.csv", newline="") as f:
        assert sum(1 for row in csv.DictReader(f) if row["gns/total"]) == 4  # every 5th of 20 steps


def test_sixteen_bit_mixed_precision_is_refused_in_one_line(tmp_path):
    callback = GNSCallback(out_dir=str(tmp_path))
    trainer = lightning.Trainer(accelerator="cpu", devices=1, logger=False)
    trainer.precision_plugin.scaler = torch.amp.GradScaler("cpu")  # what precision="16-mixed" sets up on a GPU
    with pytest.raises(ValueError, match="16-mixed") as error:
        callback.on_train_start(trainer, None)
    assert "\n" not in str(error.value)


def test_bf16_mixed_measures_what_32_does_within_its_rounding(tmp_path):
    rows = token_rows(BATCH * ACCUMULATION)
    fit(tmp_path / "fp32", rows, [GNSCallback()], steps=1)
    trainer = lightning.Trainer(
        default_root_dir=str(tmp_path / "bf16"), max_steps=1, accumulate_grad_batches=ACCUMULATION,
        gradient_clip_val=MAX_GRAD_NORM, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, precision="bf16-mixed", callbacks=[GNSCallback()])
    trainer.fit(CausalLM(), torch.utils.data.DataLoader(rows, batch_size=BATCH, shuffle=False))
    assert_bfloat16_rounding(gns_columns(str(tmp_path / "fp32"))[0], gns_columns(str(tmp_path / "bf16"))[0])


def test_two_ddp_ranks_give_one_process_with_the_doubled_batch(tmp_path):
    rows = token_rows(BATCH * ACCUMULATION * STEPS)
    torch.save(rows, tmp_path / "rows.pt")
    fit(tmp_path / "one", rows, [GNSCallback()])
    torchrun_two_ranks("lightning_ddp_worker.py", tmp_path / "rows.pt", tmp_path / "two", cwd=tmp_path)
    one, two = gns_columns(str(tmp_path / "one")), gns_columns(str(tmp_path / "two"))
    assert all(cells[column] == BATCH * ACCUMULATION for cells in two.values()
               for column in cells if column.endswith("/batch_size"))
    # the first step on the same weights; later ones on weights rounded apart by the ranks' averaged gradients
    assert largest_difference({0: one[0]}, {0: two[0]}) < 1e-5 and largest_difference(one, two) < 1e-4


def batch_sizes(out_dir):
    """{step: the set of its /batch_size cells} in out_dir/log.csv."""
    return {step: {value for column, value in cells.items() if column.endswith("/batch_size")}
            for step, cells in gns_columns(str(out_dir)).items()}


def test_a_new_trainer_refuses_the_out_dir_the_callbacks_last_fit_logged_into(tmp_path):
    rows = token_rows(BATCH * ACCUMULATION * 2)
    callback = GNSCallback()
    _, module = fit(tmp_path / "first", rows, [callback], steps=2)
    weights = {name: p.detach().clone() for name, p in module.named_parameters()}
    with pytest.raises(FileExistsError, match="holds another run's log") as error:
        fit(tmp_path / "first", rows, [callback], steps=2, module=module)
    assert "\n" not in str(error.value)
    assert sorted(gns_columns(str(tmp_path / "first"))) == [0, 1]
    for name, p in module.named_parameters():  # refused before its first step: nothing trained unlogged
        assert torch.equal(p, weights[name]), name
    fit(tmp_path / "second", rows, [callback], steps=2, module=module)  # an out_dir of its own: a run of its own
    assert batch_sizes(tmp_path / "second") == {0: {BATCH * ACCUMULATION}, 1: {BATCH * ACCUMULATION}}


def test_the_same_trainer_fit_again_with_more_steps_continues_the_log_and_the_live_gns(tmp_path):
    first_rows, second_rows = token_rows(BATCH * ACCUMULATION * 2, seed=1), token_rows(BATCH * ACCUMULATION * 2, seed=2)
    whole = GNSCallback()
    fit(tmp_path / "whole", torch.cat([first_rows, second_rows]), [whole], steps=4, module=PlainSGD())
    continued = GNSCallback()
    trainer, module = fit(tmp_path / "continued", first_rows, [continued], steps=2, module=PlainSGD())
    trainer.fit_loop.epoch_loop.max_steps = 4
    trainer.fit(module, loader(second_rows))
    assert sorted(gns_columns(str(tmp_path / "continued"))) == [0, 1, 2, 3]
    assert largest_difference(gns_columns(str(tmp_path / "whole")), gns_columns(str(tmp_path / "continued"))) < 1e-5
    assert continued.meter.live()["gns/total"] == pytest.approx(whole.meter.live()["gns/total"], rel=1e-5)


def test_the_callback_measures_the_module_each_fit_trains(tmp_path):
    rows = token_rows(BATCH * ACCUMULATION * 2)
    callback = GNSCallback()
    fit(tmp_path / "first", rows, [callback], steps=2)
    other = CausalLM(tiny_hf("gpt2", seed=1).train())
    twin = copy.deepcopy(other)
    fit(tmp_path / "other", rows, [callback], steps=2, module=other)
    alone = GNSCallback()
    fit(tmp_path / "alone", rows, [alone], steps=2, module=twin)
    assert largest_difference(gns_columns(str(tmp_path / "alone")), gns_columns(str(tmp_path / "other"))) < 1e-5
    assert callback.meter.live()["gns/total"] == pytest.approx(alone.meter.live()["gns/total"], rel=1e-5)


def test_micro_steps_abandoned_by_an_exception_do_not_count_in_the_next_fit(tmp_path):
    rows = token_rows(BATCH * ACCUMULATION * 2)
    module = FailsOnce(fail_at=1)  # the first step's second micro-batch: the first one's backward has run
    with pytest.raises(Abandoned):
        fit(tmp_path / "failed", rows, [GNSCallback()], steps=2, module=module)
    fit(tmp_path / "again", rows, [GNSCallback()], steps=2, module=module)
    assert batch_sizes(tmp_path / "again") == {0: {BATCH * ACCUMULATION}, 1: {BATCH * ACCUMULATION}}


def test_a_step_the_module_skips_does_not_count_in_the_next(tmp_path):
    rows = token_rows(BATCH * ACCUMULATION * 3)
    fit(tmp_path, rows, [GNSCallback()], steps=3, module=SkipsFirstStep())
    sizes = batch_sizes(tmp_path)
    assert len(sizes) == 2 and all(size == {BATCH * ACCUMULATION} for size in sizes.values())


def test_manual_optimization_accumulates_its_own_micro_batches(tmp_path):
    rows = token_rows(BATCH * ACCUMULATION * 2)
    trainer = trainer_for(tmp_path, [GNSCallback()], steps=2, accumulate_grad_batches=1, gradient_clip_val=None)
    trainer.fit(ManualAccumulation(), loader(rows))
    assert batch_sizes(tmp_path) == {0: {BATCH * ACCUMULATION}, 1: {BATCH * ACCUMULATION}}


def test_a_fit_after_an_exception_continues_on_the_same_trainer(tmp_path):
    rows = token_rows(BATCH * ACCUMULATION * STEPS)
    module = FailsOnce(fail_at=ACCUMULATION + 1)  # in the second step, after one of its micro-batches
    trainer = trainer_for(tmp_path, [GNSCallback()])
    with pytest.raises(Abandoned):
        trainer.fit(module, loader(rows))
    assert sorted(gns_columns(str(tmp_path))) == [0]
    trainer.fit(module, loader(rows))  # the meter the exception closed gave out_dir back
    assert batch_sizes(tmp_path) == {step: {BATCH * ACCUMULATION} for step in range(STEPS)}
