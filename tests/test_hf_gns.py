"""
hf_gns.GNSCallback in Hugging Face's Trainer: the same GNS as our own loop on the same model and
batches (gradient accumulation, clipping on), the Trainer's training unchanged, the values in the
logs report_to's integrations read, a resume from a Trainer checkpoint, two DDP ranks against one
process, and one-line refusals.
"""
import json
import os
import warnings

import pytest
import torch

pytest.importorskip("accelerate")
import transformers  # noqa: E402

from gns_fixtures import one_thread, tiny_hf  # noqa: E402,F401  (one_thread: autouse)
from hf_gns import GNSCallback  # noqa: E402
from loop_fixtures import (LR, assert_bfloat16_rounding, gns_columns, largest_difference, own_loop,  # noqa: E402
                           run_readme_example, token_rows, torchrun_two_ranks)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH, ACCUMULATION, STEPS, MAX_GRAD_NORM = 4, 2, 4, 0.5


class Rows(torch.utils.data.IterableDataset):
    """The rows in order (no shuffling), each a causal-LM example."""

    def __init__(self, rows):
        self.rows = rows

    def __iter__(self):
        for x in self.rows:
            yield {"input_ids": x, "labels": x}


def trainer(out_dir, rows, callbacks, steps=STEPS, batch=BATCH, model=None, **settings):
    settings = {"save_strategy": "no", **settings}
    args = transformers.TrainingArguments(
        output_dir=str(out_dir), per_device_train_batch_size=batch, gradient_accumulation_steps=ACCUMULATION,
        max_steps=steps, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        optim="adamw_torch", max_grad_norm=MAX_GRAD_NORM, logging_steps=1, report_to="none",
        use_cpu=True, disable_tqdm=True, seed=0, **settings)
    model = tiny_hf("gpt2") if model is None else model
    # the causal-LM loss by name: the Trainer then counts the shifted labels, as the model's mean loss does
    # (unnamed, it divides the summed loss by every label, 16 per row where 15 are predicted)
    model.loss_type = "ForCausalLM"
    return transformers.Trainer(model=model, args=args, train_dataset=Rows(rows), callbacks=callbacks)


def test_the_trainer_callback_gives_our_loops_numbers_and_leaves_training_alone(tmp_path):
    rows = token_rows(BATCH * ACCUMULATION * STEPS)
    ours, _, _ = own_loop(str(tmp_path / "ours"), rows, BATCH, ACCUMULATION, STEPS, MAX_GRAD_NORM)
    hf = trainer(tmp_path / "hf", rows, [GNSCallback()])
    hf.train()
    difference = largest_difference(gns_columns(str(tmp_path / "ours")), gns_columns(str(tmp_path / "hf")))
    assert difference < 1e-5
    # the Trainer's clipping was on and clipped, and its weights are our loop's
    assert max(entry.get("grad_norm", 0) for entry in hf.state.log_history) > MAX_GRAD_NORM
    assert hf.args.max_grad_norm == MAX_GRAD_NORM  # given back
    for (name, mine), theirs in zip(ours.named_parameters(), hf.model.parameters()):
        torch.testing.assert_close(theirs, mine, rtol=1e-5, atol=1e-6, msg=name)


class LogReader(transformers.TrainerCallback):
    """Stands for a report_to integration (wandb, tensorboard), which the Trainer lists before the callbacks it is given."""

    def __init__(self):
        self.seen = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.seen.append(dict(logs))


def test_the_gns_is_in_the_logs_before_report_to_reads_them(tmp_path):
    rows = token_rows(BATCH * ACCUMULATION * 2)
    hf = trainer(tmp_path / "hf", rows, [GNSCallback()], steps=2)
    reader = LogReader()
    hf.callback_handler.callbacks.insert(1, reader)  # where get_reporting_integration_callbacks puts them
    hf.train()
    steps = [logs for logs in reader.seen if "loss" in logs]
    assert len(steps) == 2 and all("gns/total" in logs and "gns/LayerNorm" in logs for logs in steps)
    assert all("gns/total" in entry for entry in hf.state.log_history if "loss" in entry)


def test_a_trainer_resumed_from_its_checkpoint_continues_the_gns(tmp_path):
    rows = token_rows(BATCH * ACCUMULATION * 6)
    whole = trainer(tmp_path / "whole", rows, [GNSCallback()], steps=6)
    whole.train()
    cut = trainer(tmp_path / "cut", rows, [GNSCallback()], steps=3, save_strategy="steps", save_steps=3)
    cut.train()
    assert os.path.isdir(tmp_path / "cut" / "checkpoint-3")
    resumed = trainer(tmp_path / "cut", rows, [GNSCallback()], steps=6)
    resumed.train(resume_from_checkpoint=str(tmp_path / "cut" / "checkpoint-3"))
    assert sorted(gns_columns(str(tmp_path / "cut"))) == list(range(6))
    assert largest_difference(gns_columns(str(tmp_path / "whole")), gns_columns(str(tmp_path / "cut"))) < 1e-5
    last = [entry for entry in whole.state.log_history if "gns/total" in entry][-1]
    again = [entry for entry in resumed.state.log_history if "gns/total" in entry][-1]
    assert again["step"] == last["step"] == 6
    assert again["gns/total"] == pytest.approx(last["gns/total"], rel=1e-5)  # the EMA went on, not restarted


def test_two_ddp_ranks_give_one_process_with_the_doubled_batch(tmp_path):
    rows = token_rows(BATCH * ACCUMULATION * STEPS)
    torch.save(rows, tmp_path / "rows.pt")
    one = trainer(tmp_path / "one", rows, [GNSCallback()])
    one.train()
    torchrun_two_ranks("hf_ddp_worker.py", tmp_path / "rows.pt", tmp_path / "two", cwd=tmp_path)
    two = gns_columns(str(tmp_path / "two"))
    assert all(cells[column] == BATCH * ACCUMULATION for cells in two.values()
               for column in cells if column.endswith("/batch_size"))
    one = gns_columns(str(tmp_path / "one"))
    # the first step on the same weights; later ones on weights that the ranks' averaged gradients, rounded
    # apart from one process's in float32, have moved a little apart
    assert largest_difference({0: one[0]}, {0: two[0]}) < 1e-5 and largest_difference(one, two) < 1e-4


def test_refusals_are_one_line(tmp_path):
    rows = token_rows(BATCH * ACCUMULATION)
    frozen = tiny_hf("gpt2").requires_grad_(False)
    frozen.lm_head.weight.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters") as error:
        trainer(tmp_path / "frozen", rows, [GNSCallback()], steps=1, model=frozen).train()
    assert "\n" not in str(error.value)

    trainer(tmp_path / "taken", rows, [GNSCallback()], steps=1).train()
    with pytest.raises(FileExistsError, match="holds another run's log") as error:
        trainer(tmp_path / "taken", rows, [GNSCallback()], steps=1).train()
    assert "\n" not in str(error.value)
    assert sorted(gns_columns(str(tmp_path / "taken"))) == [0]

    # a checkpoint saved without the callback cannot give the EMA back
    trainer(tmp_path / "plain", token_rows(BATCH * ACCUMULATION * 2), [], steps=1, save_strategy="steps",
            save_steps=1).train()
    with pytest.raises(ValueError, match="holds no GNS state"):
        trainer(tmp_path / "plain", token_rows(BATCH * ACCUMULATION * 2), [GNSCallback(out_dir=str(tmp_path / "g"))],
                steps=2).train(resume_from_checkpoint=str(tmp_path / "plain" / "checkpoint-1"))


def test_strict_refuses_a_model_it_cannot_measure_fully(tmp_path):
    model = tiny_hf("gpt2")
    model.transformer.h[0].mlp.act = Gain()  # a trainable layer of a class measure() does not know
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(tmp_path / "lenient", token_rows(BATCH * ACCUMULATION), [GNSCallback()], steps=1, model=model).train()
    assert any("act.gain (Gain)" in str(w.message) for w in caught)
    model = tiny_hf("gpt2")
    model.transformer.h[0].mlp.act = Gain()
    with pytest.raises(ValueError, match=r"act\.gain \(Gain\)"):
        trainer(tmp_path / "strict", token_rows(BATCH * ACCUMULATION), [GNSCallback(strict=True)], steps=1,
                model=model).train()


class Gain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gain = torch.nn.Parameter(torch.ones(()))

    def forward(self, x):
        return torch.nn.functional.gelu(x) * self.gain


def test_the_state_in_trainer_state_json_is_json():
    callback = GNSCallback()
    assert json.loads(json.dumps(callback.state()))["args"]["norm"] == "shim"


def test_the_readme_example_runs_as_written(tmp_path):
    run_readme_example(1, tmp_path, "out-hf-trainer")


@pytest.mark.parametrize("setting", ["fp16", "fsdp", "deepspeed"])
def test_what_it_does_not_support_is_refused_in_one_line(setting):
    from types import SimpleNamespace
    args = SimpleNamespace(fp16=setting == "fp16", fsdp="full_shard" if setting == "fsdp" else "",
                           deepspeed="ds.json" if setting == "deepspeed" else None, output_dir="unused")
    with pytest.raises(ValueError, match="does not support") as error:
        GNSCallback().on_train_begin(args, transformers.TrainerState(), transformers.TrainerControl(),
                                     model=tiny_hf("gpt2"))
    assert "\n" not in str(error.value)


def test_bfloat16_measures_what_float32_does_within_its_rounding(tmp_path):
    rows = token_rows(BATCH * ACCUMULATION)
    trainer(tmp_path / "fp32", rows, [GNSCallback()], steps=1).train()
    trainer(tmp_path / "bf16", rows, [GNSCallback()], steps=1, bf16=True).train()
    assert_bfloat16_rounding(gns_columns(str(tmp_path / "fp32"))[0], gns_columns(str(tmp_path / "bf16"))[0])
