"""
hf_gns.GNSCallback in Hugging Face's Trainer: the same GNS as our own loop on the same model and
batches (gradient accumulation, clipping on), the Trainer's training and arguments unchanged (an
interrupt, another callback's clipping schedule), the values in the logs report_to's integrations
read, a resume from a Trainer checkpoint (in the process of an interrupted run too), one callback
in several runs, two DDP ranks against one process, the README's model's loss, and one-line refusals.
"""
import copy
import json
import os
import warnings

import pytest
import torch

pytest.importorskip("accelerate")
import transformers  # noqa: E402

import nanogns.layers as buffered  # noqa: E402

from gns_fixtures import one_thread, shapes_rule, tiny_hf  # noqa: E402,F401  (one_thread, shapes_rule: autouse)
from nanogns.hf import GNSCallback  # noqa: E402
from loop_fixtures import (LR, assert_bfloat16_rounding, gns_columns, installed_package,  # noqa: E402
                           largest_difference, own_loop, run_readme_example, token_rows, torchrun_two_ranks)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH, ACCUMULATION, STEPS, MAX_GRAD_NORM = 4, 2, 4, 0.5


class Rows(torch.utils.data.IterableDataset):
    """The rows in order (no shuffling), each a causal-LM example."""

    def __init__(self, rows):
        self.rows = rows

    def __iter__(self):
        for x in self.rows:
            yield {"input_ids": x, "labels": x}


def trainer(out_dir, rows, gns, steps=STEPS, batch=BATCH, model=None, callbacks=(), **settings):
    """A Trainer on `rows` in order with GNSCallback `gns` attached (None: without it); `callbacks` go in callbacks=."""
    settings = {"save_strategy": "no", "max_grad_norm": MAX_GRAD_NORM, **settings}
    args = transformers.TrainingArguments(
        output_dir=str(out_dir), per_device_train_batch_size=batch, gradient_accumulation_steps=ACCUMULATION,
        max_steps=steps, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        optim="adamw_torch", logging_steps=1, report_to="none", use_cpu=True, disable_tqdm=True, seed=0, **settings)
    model = tiny_hf("gpt2") if model is None else model
    # the causal-LM loss by name: the Trainer then counts the shifted labels, as the model's mean loss does
    # (unnamed, it divides the summed loss by every label, 16 per row where 15 are predicted)
    model.loss_type = "ForCausalLM"
    hf = transformers.Trainer(model=model, args=args, train_dataset=Rows(rows), callbacks=list(callbacks))
    if gns is not None:
        gns.attach(hf)
    return hf


def test_the_trainer_callback_gives_our_loops_numbers_and_leaves_training_alone(tmp_path):
    rows = token_rows(BATCH * ACCUMULATION * STEPS)
    ours, _, _ = own_loop(str(tmp_path / "ours"), rows, BATCH, ACCUMULATION, STEPS, MAX_GRAD_NORM)
    hf = trainer(tmp_path / "hf", rows, GNSCallback())
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
    hf = trainer(tmp_path / "hf", rows, None, steps=2)
    reader = LogReader()
    hf.callback_handler.callbacks.insert(1, reader)  # where get_reporting_integration_callbacks puts them
    gns = GNSCallback().attach(hf)
    assert hf.callback_handler.callbacks[0] is gns  # first, before the training starts
    hf.train()
    steps = [logs for logs in reader.seen if "loss" in logs]
    assert len(steps) == 2 and all("gns/total" in logs and "gns/LayerNorm" in logs for logs in steps)
    assert all("gns/total" in entry for entry in hf.state.log_history if "loss" in entry)


def test_attach_takes_the_callback_given_in_callbacks_and_refuses_it_unattached(tmp_path):
    rows = token_rows(BATCH * ACCUMULATION)
    gns = GNSCallback()
    hf = trainer(tmp_path / "both", rows, None, steps=1, callbacks=[LogReader(), gns])
    gns.attach(hf)
    assert hf.callback_handler.callbacks[0] is gns and hf.callback_handler.callbacks.count(gns) == 1
    hf.train()
    assert sorted(gns_columns(str(tmp_path / "both"))) == [0]
    with pytest.raises(ValueError, match="another GNSCallback"):
        GNSCallback().attach(hf)

    # given in callbacks= alone, it first sees the gradient after the Trainer clipped it: refused, saying so
    alone = trainer(tmp_path / "alone", rows, None, steps=1, callbacks=[GNSCallback()])
    with pytest.raises(ValueError, match=r"on_pre_optimizer_step, which the Trainer calls after clipping it to "
                                         r"max_grad_norm=0\.5.*attach\(trainer\).*max_grad_norm=0$") as error:
        alone.train()
    assert "\n" not in str(error.value) and not os.path.exists(tmp_path / "alone" / "log.csv")
    # and so it is where another callback turns clipping on during the run
    scheduled = trainer(tmp_path / "scheduled", rows, None, steps=1, max_grad_norm=0.0,
                        callbacks=[SchedulesClipping(0.1), GNSCallback()])
    with pytest.raises(ValueError, match=r"after clipping it to max_grad_norm=0\.1") as error:
        scheduled.train()
    assert "\n" not in str(error.value)


def test_given_in_callbacks_to_a_trainer_that_does_not_clip_it_measures_what_attach_does(tmp_path):
    rows = token_rows(BATCH * ACCUMULATION * 3)
    attached = trainer(tmp_path / "attached", rows, GNSCallback(), steps=3, max_grad_norm=0.0)
    attached.train()
    given = trainer(tmp_path / "given", rows, None, steps=3, max_grad_norm=0.0, callbacks=[GNSCallback()])
    given.train()
    assert (tmp_path / "given" / "log.csv").read_bytes() == (tmp_path / "attached" / "log.csv").read_bytes()
    live = [[entry["gns/total"] for entry in hf.state.log_history if "gns/total" in entry] for hf in (attached, given)]
    assert len(live[0]) == 3 and live[0] == live[1]
    own_loop(str(tmp_path / "ours"), rows, BATCH, ACCUMULATION, 3, float("inf"))
    assert largest_difference(gns_columns(str(tmp_path / "ours")), gns_columns(str(tmp_path / "given"))) < 1e-5
    # report_to's integrations come before it in the Trainer's list: said in one warning
    quiet = trainer(tmp_path / "reported", rows, None, steps=1, max_grad_norm=0.0, callbacks=[GNSCallback()])
    quiet.args.report_to = ["wandb"]  # read by our callback only: the Trainer built its integrations already
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet.train()
    said = [str(w.message) for w in caught if "GNSCallback" in str(w.message)]
    assert len(said) == 1 and "report_to's integrations (wandb)" in said[0] and "attach(trainer)" in said[0]
    assert "\n" not in said[0]


def test_attach_warns_in_one_line_where_it_cannot_put_the_callback_first():
    class Handmade:  # a Trainer-like object with add_callback but no callback_handler.callbacks list
        def __init__(self):
            self.added = []

        def add_callback(self, callback):
            self.added.append(callback)

        def train(self):
            return "trained"

    handmade = Handmade()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gns = GNSCallback().attach(handmade)
    assert handmade.added == [gns]
    messages = [str(w.message) for w in caught if "GNSCallback" in str(w.message)]
    assert len(messages) == 1 and "report_to" in messages[0] and "\n" not in messages[0]
    assert handmade.train() == "trained"


def test_a_trainer_resumed_from_its_checkpoint_continues_the_gns(tmp_path):
    rows = token_rows(BATCH * ACCUMULATION * 6)
    whole = trainer(tmp_path / "whole", rows, GNSCallback(), steps=6)
    whole.train()
    cut = trainer(tmp_path / "cut", rows, GNSCallback(), steps=3, save_strategy="steps", save_steps=3)
    cut.train()
    assert os.path.isdir(tmp_path / "cut" / "checkpoint-3")
    resumed = trainer(tmp_path / "cut", rows, GNSCallback(), steps=6)
    resumed.train(resume_from_checkpoint=str(tmp_path / "cut" / "checkpoint-3"))
    assert sorted(gns_columns(str(tmp_path / "cut"))) == list(range(6))
    assert largest_difference(gns_columns(str(tmp_path / "whole")), gns_columns(str(tmp_path / "cut"))) < 1e-5
    last = [entry for entry in whole.state.log_history if "gns/total" in entry][-1]
    again = [entry for entry in resumed.state.log_history if "gns/total" in entry][-1]
    assert again["step"] == last["step"] == 6
    assert again["gns/total"] == pytest.approx(last["gns/total"], rel=1e-5)  # the EMA went on, not restarted


def test_a_resumed_trainer_measures_with_the_restored_methods_without_choosing_again(tmp_path, monkeypatch):
    import nanogns.layers.linear as linear
    monkeypatch.setattr(linear._MeasuredLinear, "per_example_mode", "auto")  # each Linear chooses once
    rows = token_rows(BATCH * ACCUMULATION * 2)
    trainer(tmp_path / "cut", rows, GNSCallback(), steps=1, save_strategy="steps", save_steps=1).train()
    with open(tmp_path / "cut" / "checkpoint-1" / "trainer_state.json") as f:
        saved = json.load(f)["stateful_callbacks"]["GNSCallback"]
    saved = (saved[0] if isinstance(saved, list) else saved)["attributes"]["meter_state"]["linear_norm_methods"]
    assert len(saved) == 9
    fresh = []
    original = linear._auto_method
    monkeypatch.setattr(linear, "_auto_method", lambda *a: fresh.append(a) or original(*a))
    resumed = trainer(tmp_path / "cut", rows, GNSCallback(), steps=2)
    resumed.train(resume_from_checkpoint=str(tmp_path / "cut" / "checkpoint-1"))
    assert fresh == [] and buffered.linear_norm_methods(resumed.model) == saved
    assert sorted(gns_columns(str(tmp_path / "cut"))) == [0, 1]


def test_two_ddp_ranks_give_one_process_with_the_doubled_batch(tmp_path):
    rows = token_rows(BATCH * ACCUMULATION * STEPS)
    torch.save(rows, tmp_path / "rows.pt")
    one = trainer(tmp_path / "one", rows, GNSCallback())
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
        trainer(tmp_path / "frozen", rows, GNSCallback(), steps=1, model=frozen).train()
    assert "\n" not in str(error.value)

    trainer(tmp_path / "taken", rows, GNSCallback(), steps=1).train()
    with pytest.raises(FileExistsError, match="holds another run's log") as error:
        trainer(tmp_path / "taken", rows, GNSCallback(), steps=1).train()
    assert "\n" not in str(error.value)
    assert sorted(gns_columns(str(tmp_path / "taken"))) == [0]

    # a checkpoint saved without the callback cannot give the EMA back
    trainer(tmp_path / "plain", token_rows(BATCH * ACCUMULATION * 2), None, steps=1, save_strategy="steps",
            save_steps=1).train()
    with pytest.raises(ValueError, match="holds no GNS state"):
        trainer(tmp_path / "plain", token_rows(BATCH * ACCUMULATION * 2), GNSCallback(out_dir=str(tmp_path / "g")),
                steps=2).train(resume_from_checkpoint=str(tmp_path / "plain" / "checkpoint-1"))

    # the Trainer's restoring of callbacks would swap the attached callback for an unattached copy
    trainer(tmp_path / "saved", token_rows(BATCH * ACCUMULATION * 2), GNSCallback(), steps=1,
            save_strategy="steps", save_steps=1).train()
    with pytest.raises(ValueError, match="restore_callback_states_from_checkpoint") as error:
        trainer(tmp_path / "saved", token_rows(BATCH * ACCUMULATION * 2), GNSCallback(), steps=2,
                restore_callback_states_from_checkpoint=True).train(
                    resume_from_checkpoint=str(tmp_path / "saved" / "checkpoint-1"))
    assert "\n" not in str(error.value)


def test_strict_refuses_a_model_it_cannot_measure_fully(tmp_path):
    model = tiny_hf("gpt2")
    model.transformer.h[0].mlp.act = Gain()  # a trainable layer of a class measure() does not know
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(tmp_path / "lenient", token_rows(BATCH * ACCUMULATION), GNSCallback(), steps=1, model=model).train()
    assert any("act.gain (Gain)" in str(w.message) for w in caught)
    model = tiny_hf("gpt2")
    model.transformer.h[0].mlp.act = Gain()
    with pytest.raises(ValueError, match=r"act\.gain \(Gain\)"):
        trainer(tmp_path / "strict", token_rows(BATCH * ACCUMULATION), GNSCallback(strict=True), steps=1,
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


def test_the_readme_example_runs_as_written(tmp_path, tmp_path_factory):
    run_readme_example(1, tmp_path, "out-hf-trainer", "28 parameters (LayerNorm 10, Linear 16, Embedding 2)",
                       installed_package(tmp_path_factory))


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
    trainer(tmp_path / "fp32", rows, GNSCallback(), steps=1).train()
    trainer(tmp_path / "bf16", rows, GNSCallback(), steps=1, bf16=True).train()
    assert_bfloat16_rounding(gns_columns(str(tmp_path / "fp32"))[0], gns_columns(str(tmp_path / "bf16"))[0])


# -- clipping: measured where the Trainer clips, the Trainer's arguments untouched ----------------------

class Interrupt(transformers.TrainerCallback):
    """A KeyboardInterrupt after the first micro-step of optimizer step `step` (its second one never runs)."""

    def __init__(self, step):
        self.step = step

    def on_substep_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise KeyboardInterrupt


class ReadsClipping(transformers.TrainerCallback):
    def __init__(self):
        self.seen = []

    def on_step_begin(self, args, state, control, **kwargs):
        self.seen.append(args.max_grad_norm)


class SchedulesClipping(transformers.TrainerCallback):
    def __init__(self, max_grad_norm):
        self.max_grad_norm = max_grad_norm

    def on_step_begin(self, args, state, control, **kwargs):
        args.max_grad_norm = self.max_grad_norm


def test_other_callbacks_see_the_trainers_max_grad_norm_and_an_interrupt_leaves_it(tmp_path):
    rows = token_rows(BATCH * ACCUMULATION * STEPS)
    reader = ReadsClipping()
    hf = trainer(tmp_path / "hf", rows, GNSCallback(), callbacks=[reader, Interrupt(step=2)])
    with pytest.raises(KeyboardInterrupt):
        hf.train()
    assert reader.seen == [MAX_GRAD_NORM] * 3
    assert hf.args.max_grad_norm == MAX_GRAD_NORM
    assert "clip_grad_norm_" not in vars(hf.accelerator)  # the Trainer's own clipping again
    hf.save_model()
    saved = torch.load(tmp_path / "hf" / "training_args.bin", weights_only=False)
    assert saved.max_grad_norm == MAX_GRAD_NORM


def test_a_clipping_schedule_is_the_trainers_and_the_gns_is_of_the_gradient_before_it(tmp_path):
    rows = token_rows(BATCH * ACCUMULATION * STEPS)
    scheduled = 0.1
    ours, _, _ = own_loop(str(tmp_path / "ours"), rows, BATCH, ACCUMULATION, STEPS, scheduled)
    hf = trainer(tmp_path / "hf", rows, GNSCallback(), callbacks=[SchedulesClipping(scheduled)])
    hf.train()
    assert hf.args.max_grad_norm == scheduled  # the schedule's value, not put back
    assert largest_difference(gns_columns(str(tmp_path / "ours")), gns_columns(str(tmp_path / "hf"))) < 1e-5
    # |G_B| in log.csv is the norm the Trainer logs, taken before it clips (and it did clip)
    logged = {entry["step"] - 1: entry["grad_norm"] for entry in hf.state.log_history if "grad_norm" in entry}
    for step, cells in gns_columns(str(tmp_path / "hf")).items():
        measured = sum(value ** 2 for column, value in cells.items() if column.endswith("/norm")) ** 0.5
        assert measured == pytest.approx(logged[step], rel=1e-5) and measured > scheduled
    for (name, mine), theirs in zip(ours.named_parameters(), hf.model.parameters()):
        torch.testing.assert_close(theirs, mine, rtol=1e-5, atol=1e-6, msg=name)


def test_without_clipping_the_gns_is_measured_before_the_optimizer_step(tmp_path):
    rows = token_rows(BATCH * ACCUMULATION * 2)
    ours, _, _ = own_loop(str(tmp_path / "ours"), rows, BATCH, ACCUMULATION, 2, float("inf"))
    hf = trainer(tmp_path / "hf", rows, GNSCallback(), steps=2, max_grad_norm=0.0)
    hf.train()
    assert largest_difference(gns_columns(str(tmp_path / "ours")), gns_columns(str(tmp_path / "hf"))) < 1e-5
    # a Trainer that takes no norm through its accelerator either: measured at the pre-optimizer event
    hf = trainer(tmp_path / "no-norm", rows, GNSCallback(), steps=2, max_grad_norm=0.0)
    hf._get_grad_norm = lambda model, grad_norm=None: grad_norm
    hf.train()
    assert largest_difference(gns_columns(str(tmp_path / "ours")), gns_columns(str(tmp_path / "no-norm"))) < 1e-5


def test_a_trainer_that_clips_past_its_accelerator_is_refused_in_one_line(tmp_path):
    hf = trainer(tmp_path / "hf", token_rows(BATCH * ACCUMULATION), GNSCallback(), steps=1)
    hf._clip_grad_norm = lambda model: torch.nn.utils.clip_grad_norm_(model.parameters(), hf.args.max_grad_norm)
    with pytest.raises(ValueError, match="clip_grad_norm_") as error:
        hf.train()
    assert "\n" not in str(error.value)


# -- one callback, several runs; interrupted runs ---------------------------------------------------------

def test_one_callback_in_a_second_trainer_measures_that_trainers_model(tmp_path):
    rows = token_rows(BATCH * ACCUMULATION * 2)
    gns = GNSCallback()
    trainer(tmp_path / "first", rows, gns, steps=2).train()
    alone = trainer(tmp_path / "alone", rows, GNSCallback(), steps=2, model=tiny_hf("gpt2", seed=5))
    alone.train()
    second = trainer(tmp_path / "second", rows, gns, steps=2, model=tiny_hf("gpt2", seed=5))
    second.train()
    assert buffered.find_sqgradnorm_buffers(second.model)
    assert largest_difference(gns_columns(str(tmp_path / "alone")), gns_columns(str(tmp_path / "second"))) < 1e-5
    last = [entry["gns/total"] for entry in second.state.log_history if "gns/total" in entry]
    expected = [entry["gns/total"] for entry in alone.state.log_history if "gns/total" in entry]
    assert last == pytest.approx(expected, rel=1e-5)


def test_each_trial_of_a_hyperparameter_search_measures_its_own_model_into_its_own_log(tmp_path, monkeypatch):
    # Trainer.hyperparameter_search calls train(trial=...) once per trial, model_init building each
    # trial's model; the search backends (optuna, ray) are not needed to run that loop
    import transformers.integrations
    monkeypatch.setattr(transformers.integrations, "hp_params", lambda trial: dict(trial))
    rows = token_rows(BATCH * ACCUMULATION * 2)
    models = []

    def model_init(trial=None):
        models.append(tiny_hf("gpt2", seed=3))
        models[-1].loss_type = "ForCausalLM"
        return models[-1]

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "search"), per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUMULATION, max_steps=2, learning_rate=LR, lr_scheduler_type="constant",
        optim="adamw_torch", max_grad_norm=MAX_GRAD_NORM, logging_steps=1, report_to="none", use_cpu=True,
        disable_tqdm=True, seed=0, save_strategy="no")
    hf = transformers.Trainer(model_init=model_init, args=args, train_dataset=Rows(rows))
    GNSCallback().attach(hf)
    hf.train(trial={"trial": 0})
    hf.train(trial={"trial": 1})
    assert models[-1] is hf.model and all(buffered.find_sqgradnorm_buffers(model) for model in models[-2:])
    first, second = (gns_columns(str(tmp_path / "search" / f"trial-{n}")) for n in (0, 1))
    assert sorted(first) == sorted(second) == [0, 1]
    assert largest_difference(first, second) < 1e-5  # the same initialisation and batches


def test_micro_steps_outside_the_trainers_steps_are_not_counted(tmp_path):
    rows = token_rows(BATCH * ACCUMULATION * STEPS)

    class GradientProbe(transformers.TrainerCallback):
        """A diagnostic between steps: a backward on two rows, its gradient then dropped."""

        def on_step_end(self, args, state, control, model=None, **kwargs):
            model(input_ids=rows[:2], labels=rows[:2]).loss.backward()
            model.zero_grad(set_to_none=True)

    ours, _, _ = own_loop(str(tmp_path / "ours"), rows, BATCH, ACCUMULATION, STEPS, MAX_GRAD_NORM)
    trainer(tmp_path / "hf", rows, GNSCallback(), callbacks=[GradientProbe()]).train()
    measured = gns_columns(str(tmp_path / "hf"))
    assert {value for cells in measured.values() for column, value in cells.items()
            if column.endswith("/batch_size")} == {BATCH * ACCUMULATION}
    assert largest_difference(gns_columns(str(tmp_path / "ours")), measured) < 1e-5


def test_train_again_after_an_interrupt_drops_the_abandoned_micro_step(tmp_path):
    rows = token_rows(BATCH * ACCUMULATION * STEPS)
    trainer(tmp_path / "whole", rows, GNSCallback()).train()
    interrupt = Interrupt(step=2)
    hf = trainer(tmp_path / "cut", rows, GNSCallback(), callbacks=[interrupt], save_strategy="steps", save_steps=1)
    with pytest.raises(KeyboardInterrupt):
        hf.train()
    interrupt.step = None
    hf.train(resume_from_checkpoint=str(tmp_path / "cut" / "checkpoint-2"))
    assert sorted(gns_columns(str(tmp_path / "cut"))) == list(range(STEPS))
    assert largest_difference(gns_columns(str(tmp_path / "whole")), gns_columns(str(tmp_path / "cut"))) < 1e-5


def test_a_new_trainer_resumes_in_the_process_of_an_interrupted_one(tmp_path):
    rows = token_rows(BATCH * ACCUMULATION * STEPS)
    trainer(tmp_path / "whole", rows, GNSCallback()).train()
    cut = trainer(tmp_path / "cut", rows, GNSCallback(), callbacks=[Interrupt(step=2)], save_strategy="steps",
                  save_steps=1)
    with pytest.raises(KeyboardInterrupt):
        cut.train()
    resumed = trainer(tmp_path / "cut", rows, GNSCallback())  # the out_dir is not held by the interrupted run
    resumed.train(resume_from_checkpoint=str(tmp_path / "cut" / "checkpoint-2"))
    assert largest_difference(gns_columns(str(tmp_path / "whole")), gns_columns(str(tmp_path / "cut"))) < 1e-5


def test_a_subclass_of_the_callback_resumes_from_its_checkpoint(tmp_path):
    class MyGNSCallback(GNSCallback):
        pass

    rows = token_rows(BATCH * ACCUMULATION * 2)
    trainer(tmp_path / "whole", rows, MyGNSCallback(), steps=2).train()
    trainer(tmp_path / "cut", rows, MyGNSCallback(), steps=1, save_strategy="steps", save_steps=1).train()
    state = json.load(open(tmp_path / "cut" / "checkpoint-1" / "trainer_state.json"))
    assert "MyGNSCallback" in state["stateful_callbacks"]  # the Trainer's key: the class's own name
    resumed = trainer(tmp_path / "cut", rows, MyGNSCallback(), steps=2)
    resumed.train(resume_from_checkpoint=str(tmp_path / "cut" / "checkpoint-1"))
    assert largest_difference(gns_columns(str(tmp_path / "whole")), gns_columns(str(tmp_path / "cut"))) < 1e-5


# -- the README's model; DataParallel -----------------------------------------------------------------------

def test_the_readme_model_gets_its_own_mean_loss_from_the_trainer(tmp_path):
    """The README's Trainer example builds its model as written (with its advice on the loss); the
    Trainer's gradient of the first step must be that of the model's mean loss over the step's rows."""
    from loop_fixtures import readme_examples
    example = readme_examples()[1]
    namespace = {}
    exec(example[:example.index("\nrows = ")], namespace)  # imports, config and model, as the README has them
    model = namespace["model"]
    for module in model.modules():  # no dropout: the two gradients are compared on the same forward
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    vocab, width = model.config.vocab_size, model.config.n_positions
    rows = torch.randint(0, vocab, (BATCH * ACCUMULATION, width), generator=torch.Generator().manual_seed(2))
    by_hand = copy.deepcopy(model).train()
    for x in rows.split(BATCH):
        (by_hand(input_ids=x, labels=x).loss / ACCUMULATION).backward()
    expected = torch.cat([p.grad.flatten() for p in by_hand.parameters()]).norm().item()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), per_device_train_batch_size=BATCH, gradient_accumulation_steps=ACCUMULATION,
        max_steps=1, max_grad_norm=0.0, logging_steps=1, report_to="none", use_cpu=True, disable_tqdm=True,
        save_strategy="no")
    hf = transformers.Trainer(model=model, args=args, train_dataset=Rows(rows))
    hf.train()
    logged = [entry["grad_norm"] for entry in hf.state.log_history if "grad_norm" in entry]
    assert logged[0] == pytest.approx(expected, rel=1e-5)


def test_data_parallel_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(transformers.TrainingArguments, "n_gpu", property(lambda self: 2))  # DataParallel's count
    hf = trainer(tmp_path / "dp", token_rows(BATCH * ACCUMULATION * 2), GNSCallback(), steps=1)
    assert hf.args.n_gpu == 2
    with pytest.raises(ValueError, match="DataParallel") as error:
        hf.train()
    assert "\n" not in str(error.value)
