"""
lightning_gns.GNSCallback in Lightning's Trainer: the same GNS as our own loop (and so as the
Hugging Face Trainer's callback) on the same model and batches, with gradient accumulation and
clipping on; the live GNS in Lightning's loggers; a fit resumed from a checkpoint; refusals.
"""
import csv
import os

import pytest
import torch

lightning = pytest.importorskip("lightning")

from gns_fixtures import one_thread, tiny_hf  # noqa: E402,F401  (one_thread: autouse)
from lightning_gns import GNSCallback  # noqa: E402
from loop_fixtures import (LR, assert_bfloat16_rounding, gns_columns, largest_difference, own_loop,  # noqa: E402
                           run_readme_example, token_rows, torchrun_two_ranks)

BATCH, ACCUMULATION, STEPS, MAX_GRAD_NORM = 4, 2, 4, 0.5


class CausalLM(lightning.LightningModule):
    def __init__(self, model=None):
        super().__init__()
        self.model = tiny_hf("gpt2").train() if model is None else model

    def training_step(self, batch, index):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.0)


def fit(out_dir, rows, callbacks, steps=STEPS, module=None, ckpt_path=None, logger=False, epochs=None):
    trainer = lightning.Trainer(
        default_root_dir=str(out_dir), max_steps=-1 if epochs else steps, max_epochs=epochs, accumulate_grad_batches=ACCUMULATION,
        gradient_clip_val=MAX_GRAD_NORM, accelerator="cpu", devices=1, logger=logger, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1, callbacks=callbacks)
    module = CausalLM() if module is None else module
    trainer.fit(module, torch.utils.data.DataLoader(rows, batch_size=BATCH, shuffle=False), ckpt_path=ckpt_path)
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


def test_the_readme_example_runs_as_written(tmp_path):
    run_readme_example(2, tmp_path, "out-lightning")
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
