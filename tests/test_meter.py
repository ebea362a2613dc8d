"""
gnsmeter.GNSMeter, the GNS of any loop in one object: its numbers against one backward per
example, its log against gns-analysis.py, a resume through state_dict(), and its one-line refusals.
"""
import csv
import json
import os
import re
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn as nn

from gns_fixtures import one_thread, shapes_rule, tiny_hf  # noqa: F401  (one_thread, shapes_rule: autouse)
from nanogns.meter import GNSMeter
from loop_fixtures import (gns_columns, installed_package, largest_difference, own_loop, readme_examples,
                           run_readme_example, run_script, token_rows, torchrun_two_ranks)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def brute_force(model, chunks):
    """{name: (|G_B|^2, |G_1|^2)} of one optimizer step over `chunks` (each micro-step's mean loss over the
    number of micro-steps), from one backward per example, in float64."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    B = sum(len(x) for x in chunks)
    small = dict.fromkeys(params, 0.0)
    total = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in params.items()}
    for x in chunks:
        for b in range(len(x)):
            model.zero_grad(set_to_none=True)
            row = x[b:b + 1]
            model(input_ids=row, labels=row).loss.backward()
            for n, p in params.items():
                g = p.grad.double()
                small[n] += g.square().sum().item() / B
                total[n] += g / B
    model.zero_grad(set_to_none=True)
    return {n: (total[n].square().sum().item(), small[n]) for n in params}


def test_a_step_with_accumulation_matches_one_backward_per_example():
    model = tiny_hf("gpt2").train()
    chunks = [token_rows(3, seed=7), token_rows(3, seed=8)]
    expected = brute_force(model, chunks)
    meter = GNSMeter(model)
    for x in chunks:
        (model(input_ids=x, labels=x).loss / len(chunks)).backward()
    values = meter.step()  # the batch size from the layers' own counts: 6
    assert len(expected) == 28  # every parameter of the tiny GPT-2, the tied wte = lm_head included once
    for name, (big, small) in expected.items():
        assert values[f"train/gns/{name}/batch_size"] == 6
        assert values[f"train/gns/{name}/norm"] ** 2 == pytest.approx(big, rel=1e-4, abs=1e-12), name
        assert values[f"train/gns/{name}/pegn"] ** 2 == pytest.approx(small, rel=1e-4, abs=1e-12), name
    assert values["gns/total"] > 0 and values["gns/LayerNorm"] > 0
    # step() zeroed the buffers: the next step starts from nothing
    assert all(sq.item() == 0 for _, _, sq, _ in __import__("nanogns.layers", fromlist=["x"]).find_sqgradnorm_buffers(model))


def test_the_log_is_what_gns_analysis_reads(tmp_path):
    out = tmp_path / "run"
    own_loop(str(out), token_rows(24), batch=4, accumulation=2, steps=3, max_grad_norm=1.0)
    assert {"log.csv", "config.json", "layer_kinds.json"} <= set(os.listdir(out))
    assert sorted(gns_columns(str(out))) == [0, 1, 2]
    result = subprocess.run([sys.executable, os.path.join(REPO, "gns-analysis.py"), str(out)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "3 steps with GNS measurements" in result.stdout and "LayerNorm" in result.stdout


def test_a_resume_through_state_dict_continues_the_run(tmp_path):
    rows = token_rows(48)
    whole = tmp_path / "whole"
    own_loop(str(whole), rows, batch=4, accumulation=2, steps=6, max_grad_norm=0.5)

    # the same run stopped after 3 steps, its checkpoint taken there, then 2 more rows written before a crash
    cut = tmp_path / "cut"
    model, optimizer, meter = own_loop(str(cut), rows, batch=4, accumulation=2, steps=3, max_grad_norm=0.5)
    checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "gns": meter.state_dict()}
    json.dumps(checkpoint["gns"])  # plain numbers and strings
    torch.save(checkpoint, tmp_path / "ckpt.pt")
    own_loop(str(tmp_path / "scratch"), rows, batch=4, accumulation=2, steps=5, max_grad_norm=0.5)
    shutil.copy(tmp_path / "scratch" / "log.csv", cut / "log.csv")  # the crashed run's log reaches step 4

    checkpoint = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    resumed = tiny_hf("gpt2").train()
    resumed.load_state_dict(checkpoint["model"])
    from nanogns.meter import GNSMeter as Meter
    meter = Meter(resumed, out_dir=str(cut))
    meter.load_state_dict(checkpoint["gns"])
    optimizer = torch.optim.AdamW(resumed.parameters(), lr=1e-3, weight_decay=0.0)
    optimizer.load_state_dict(checkpoint["optimizer"])
    chunks = [rows[i:i + 4] for i in range(0, 48, 4)]
    for step in range(3, 6):
        for x in chunks[2 * step:2 * step + 2]:
            (resumed(input_ids=x, labels=x).loss / 2).backward()
        live = meter.step()
        torch.nn.utils.clip_grad_norm_(resumed.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    meter.close()
    assert largest_difference(gns_columns(str(whole)), gns_columns(str(cut))) < 1e-5
    uninterrupted = own_loop(None, rows, batch=4, accumulation=2, steps=6, max_grad_norm=0.5)[2]
    assert live["gns/total"] == pytest.approx(uninterrupted.live()["gns/total"], rel=1e-5)


def test_refusals_are_one_line(tmp_path):
    frozen = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters") as error:
        GNSMeter(frozen)
    assert "\n" not in str(error.value)

    out = tmp_path / "taken"
    own_loop(str(out), token_rows(8), batch=4, accumulation=1, steps=1, max_grad_norm=1.0)
    before = (out / "log.csv").read_bytes()
    model = tiny_hf("gpt2").train()
    meter = GNSMeter(model, out_dir=str(out))
    with pytest.raises(FileExistsError, match="holds another run's log") as error:
        meter.open_log()
    assert "\n" not in str(error.value)
    assert (out / "log.csv").read_bytes() == before  # never written over
    meter.close()

    x = token_rows(2)
    model(input_ids=x, labels=x).loss.backward()
    meter = GNSMeter(model)
    meter.step()  # a meter that steps...
    with pytest.raises(ValueError, match="before the first step"):
        meter.load_state_dict({"step": 3, "gns_estimators": {}})  # ...cannot be resumed after
    meter.close()
    with pytest.raises(ValueError, match="state_dict"):
        GNSMeter(model).load_state_dict({"ema": 1.0})


class Scale(nn.Module):
    """A layer class measure() does not know."""

    def __init__(self, width):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(width))

    def forward(self, x):
        return x * self.gain


def test_a_layer_it_cannot_measure_is_named_and_strict_refuses():
    def model():
        return nn.Sequential(nn.Linear(4, 4), Scale(4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        GNSMeter(model())
    assert any("1.gain (Scale)" in str(w.message) for w in caught)
    with pytest.raises(ValueError, match=r"1\.gain \(Scale\)"):
        GNSMeter(model(), strict=True)


def test_layers_that_counted_different_batches_are_refused():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    meter = GNSMeter(model)
    model(torch.randn(4, 4)).sum().backward()
    model[0](torch.randn(2, 4)).sum().backward()  # one layer alone on two more examples
    with pytest.raises(ValueError, match="counted different numbers of examples"):
        meter.step()


def test_the_training_code_never_imports_the_frameworks():
    code = ("import sys, gnsmeter, gnstracking, buffered, tracker, model, configurator; "
            "print(sorted(m for m in ('transformers', 'lightning', 'olmo_core') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_readme_example_runs_as_written_and_a_second_run_stops_as_the_readme_says(tmp_path,
                                                                                       tmp_path_factory):
    """The README's own loop, a user's script with the package installed (tests/loop_fixtures.py), run
    twice: the second run stops at its first step() with the error the README names."""
    site = installed_package(tmp_path_factory)
    output = run_readme_example(0, tmp_path, "out-my-loop", "11 parameters (LayerNorm 4, Linear 6, Embedding 1)", site)
    assert output.count("step ") == 20 and "gns " in output
    again = run_script(readme_examples()[0], tmp_path, site)
    last = again.stderr.strip().splitlines()[-1]
    assert again.returncode == 1 and "step " not in again.stdout
    error = "nanogns.runlog.OutDirTaken"
    assert last.startswith(f"{error}: GNSMeter: out-my-loop/log.csv holds another run's log"), last
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    before = text[:text.index("```python\n" + readme_examples()[0])]
    assert f"`{error}`" in before[before.rindex("\n\n", 0, len(before) - 2):]  # what the README says happens


def one_step(model, chunks, scaler=None, autocast=False):
    meter = GNSMeter(model)
    for x in chunks:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=x, labels=x).loss / len(chunks)
        (scaler.scale(loss) if scaler is not None else loss).backward()
    values = meter.step(scaler=scaler)
    model.zero_grad(set_to_none=True)
    return {k: v for k, v in values.items() if k.startswith("train/gns/")}


def test_a_grad_scaler_is_divided_out_and_bfloat16_autocast_measures_alike():
    chunks = [token_rows(3, seed=7), token_rows(3, seed=8)]
    model = tiny_hf("gpt2").train()
    plain = one_step(model, chunks)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    scaled = one_step(model, chunks, scaler=scaler)
    assert scaled.keys() == plain.keys()
    for column, value in plain.items():
        assert scaled[column] == pytest.approx(value, rel=1e-4, abs=1e-12), column
    # bfloat16 autocast: the same quantities, within bfloat16's rounding of the activations
    half = one_step(model, chunks, autocast=True)
    total = {kind: sum(v ** 2 for k, v in half.items() if k.endswith(kind)) /
             sum(v ** 2 for k, v in plain.items() if k.endswith(kind)) for kind in ("/norm", "/pegn")}
    assert all(abs(ratio - 1) < 0.05 for ratio in total.values()), total


def test_two_fsdp2_ranks_give_one_process_with_the_doubled_batch(tmp_path):
    from meter_fsdp_worker import train
    rows = torch.randint(0, 64, (24, 17), generator=torch.Generator().manual_seed(3))  # 3 steps of 2 x 4 rows
    torch.save(rows, tmp_path / "rows.pt")
    train(rows, str(tmp_path / "one"))
    torchrun_two_ranks("meter_fsdp_worker.py", tmp_path / "rows.pt", tmp_path / "two", cwd=tmp_path)
    one, two = gns_columns(str(tmp_path / "one")), gns_columns(str(tmp_path / "two"))
    assert sorted(two) == [0, 1, 2]
    # the first step on the same weights; later ones on weights rounded apart by the ranks' averaged gradients
    assert largest_difference({0: one[0]}, {0: two[0]}) < 1e-5 and largest_difference(one, two) < 1e-4


# ---------------------------------------------------------------------------------------------
# What a loop can get wrong, and what the meter then says

def micro_steps(model, chunks):
    for x in chunks:
        (model(input_ids=x, labels=x).loss / len(chunks)).backward()


def abandoned_micro_step(model):
    """A micro-step whose backward ran, then given up as a loop gives up an out-of-memory step: zero_grad()."""
    x = token_rows(4, seed=9)
    model(input_ids=x, labels=x).loss.backward()
    model.zero_grad(set_to_none=True)


def test_discard_drops_an_abandoned_micro_step_and_a_count_other_than_examples_is_named():
    model = tiny_hf("gpt2").train()
    chunks = [token_rows(4, seed=7), token_rows(4, seed=8)]
    expected = brute_force(model, chunks)
    meter = GNSMeter(model)
    abandoned_micro_step(model)
    meter.discard()
    micro_steps(model, chunks)
    values = meter.step(examples=8)
    for name, (big, small) in expected.items():
        assert values[f"train/gns/{name}/batch_size"] == 8
        assert values[f"train/gns/{name}/pegn"] ** 2 == pytest.approx(small, rel=1e-4, abs=1e-12), name
    model.zero_grad(set_to_none=True)
    live = meter.live()

    # the same step without discard(): the layers counted 12 examples, the step says 8
    abandoned_micro_step(model)
    micro_steps(model, chunks)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        values = meter.step(examples=8)
    said = [str(w.message) for w in caught if "discard()" in str(w.message)]
    assert len(said) == 1 and "\n" not in said[0] and "12" in said[0] and "8" in said[0], said
    assert not any(k.startswith("train/gns/") for k in values)  # not measured: no invented row
    assert meter.live() == live  # nor averaged into the live GNS
    assert all(sq.item() == 0 for _, _, sq, _ in __import__("nanogns.layers", fromlist=["x"]).find_sqgradnorm_buffers(model))


def test_the_readme_example_names_discard():
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    start = text.index("### Measuring the GNS in your own training")
    assert "meter.discard()" in text[start:text.index("```python\n" + readme_examples()[0], start)]


def two_linears():
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))


def test_a_meter_on_another_model_or_before_backward_is_refused():
    measured, trained = two_linears(), two_linears()
    meter = GNSMeter(measured)
    for _ in range(2):  # every step: the meter measures one model, the loop trains another
        trained(torch.randn(4, 4)).sum().backward()
        with pytest.raises(ValueError, match="counted no examples") as error:
            meter.step()
        assert "\n" not in str(error.value) and "another model" in str(error.value)
    assert meter.live() == {} or all(v != v for v in meter.live().values())


def test_a_second_live_meter_on_one_model_is_refused_until_the_first_is_closed(tmp_path):
    model = two_linears()
    first = GNSMeter(model, out_dir=str(tmp_path / "first"))
    with pytest.raises(ValueError, match="already measured by a GNSMeter") as error:
        GNSMeter(model)
    assert str(tmp_path / "first") in str(error.value) and "\n" not in str(error.value)
    model(torch.randn(4, 4)).sum().backward()
    first.step()
    first.close()
    second = GNSMeter(model)
    for _ in range(2):
        model(torch.randn(4, 4)).sum().backward()
        values = second.step()
        assert values["gns/total"] == values["gns/total"] and values["train/gns/0.weight/batch_size"] == 4
    model(torch.randn(4, 4)).sum().backward()
    with pytest.raises(ValueError, match="another GNSMeter"):  # the closed one would take the new one's sums
        first.step()


def test_nn_data_parallel_is_refused():
    with pytest.raises(ValueError, match="DataParallel") as error:
        GNSMeter(nn.DataParallel(two_linears()))  # a wrapper without GPUs: device_ids []
    assert "\n" not in str(error.value) and "DistributedDataParallel" in str(error.value)
    assert type(error.value).__name__ == "GNSMeterError"  # the project's own (a ValueError)
    inside = nn.Sequential(nn.DataParallel(two_linears()))
    with pytest.raises(ValueError, match="DataParallel"):
        GNSMeter(inside)


def test_the_state_is_strict_json_after_a_non_finite_step_and_keeps_the_skipped_steps():
    import copy
    model = tiny_hf("gpt2").train()
    meter = GNSMeter(model)
    x = token_rows(3)
    model(input_ids=x, labels=x).loss.backward()
    next(model.parameters()).grad[0, 0] = float("inf")  # a diverged step
    meter.step()
    model.zero_grad(set_to_none=True)
    assert meter.skipped_steps == 1
    state = meter.state_dict()
    text = json.dumps(state, allow_nan=False)  # strict JSON parsers take it
    twin = copy.deepcopy(model)
    resumed = GNSMeter(twin)
    resumed.load_state_dict(json.loads(text))
    assert resumed.skipped_steps == 1 and json.dumps(resumed.state_dict(), allow_nan=False) == text
    for m, meter_of in ((model, meter), (twin, resumed)):
        m(input_ids=x, labels=x).loss.backward()
        meter_of.step()
    assert resumed.live() == meter.live() and resumed.skipped_steps == meter.skipped_steps == 1
    assert json.dumps(resumed.state_dict(), allow_nan=False) == json.dumps(meter.state_dict(), allow_nan=False)


def test_a_used_out_dir_is_refused_with_the_projects_exception(tmp_path):
    from nanogns.runlog import OutDirInUse
    out = tmp_path / "taken"
    own_loop(str(out), token_rows(8), batch=4, accumulation=1, steps=1, max_grad_norm=1.0)
    meter = GNSMeter(tiny_hf("gpt2").train(), out_dir=str(out))
    with pytest.raises(OutDirInUse, match="holds another run's log") as error:
        meter.open_log()
    assert isinstance(error.value, FileExistsError)  # for callers that catch that
    assert "\n" not in str(error.value) and "another out_dir" in str(error.value)


def test_a_resume_while_an_earlier_meter_of_this_process_holds_the_out_dir_says_to_close_it(tmp_path):
    from nanogns.runlog import OutDirInUse
    out = str(tmp_path / "run")
    model = tiny_hf("gpt2").train()
    interrupted = GNSMeter(model, out_dir=out)
    x = token_rows(2)
    model(input_ids=x, labels=x).loss.backward()
    interrupted.step()  # and never closed: the run stopped by an exception
    resumed = GNSMeter(tiny_hf("gpt2").train(), out_dir=out)
    resumed.load_state_dict(interrupted.state_dict())
    with pytest.raises(OutDirInUse) as error:
        resumed.open_log()
    message = str(error.value)
    assert "train.py" not in message and "an earlier GNSMeter in this process" in message and "close()" in message
    interrupted.close()
    resumed.open_log()
    resumed.close()


@pytest.mark.slow
def test_two_ddp_ranks_that_broadcast_buffers_give_one_process_with_the_doubled_batch(tmp_path):
    """DDP's default broadcast_buffers=True copied rank 0's partial sums into rank 1 at every forward."""
    from meter_fsdp_worker import train
    rows = torch.randint(0, 64, (24, 17), generator=torch.Generator().manual_seed(3))  # 3 steps of 2 x 4 rows
    torch.save(rows, tmp_path / "rows.pt")
    train(rows, str(tmp_path / "one"))
    torchrun_two_ranks("meter_fsdp_worker.py", tmp_path / "rows.pt", tmp_path / "two", "ddp", cwd=tmp_path)
    one, two = gns_columns(str(tmp_path / "one")), gns_columns(str(tmp_path / "two"))
    assert sorted(two) == [0, 1, 2]
    assert largest_difference({0: one[0]}, {0: two[0]}) < 1e-5 and largest_difference(one, two) < 1e-4


def test_the_buffers_stay_out_of_ddps_broadcast_and_a_broadcasting_wrapper_is_refused(tmp_path):
    import gc

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import nanogns.layers as buffered
    warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model = tiny_hf("gpt2").train()
        GNSMeter(model)  # on the plain model, before the wrapper
        wrapped = DistributedDataParallel(model)  # broadcast_buffers=True: DDP's default
        ours = {name for name, buf in model.named_buffers()
                if any(buf is b for b in buffered.all_sqgradnorm_buffers(model))}
        assert len(ours) > 28 and not ours & set(wrapped.named_module_buffers)
        GNSMeter(wrapped)  # a wrapper that leaves them alone is taken

        measured = buffered.measure(tiny_hf("gpt2").train())  # measured, then wrapped without the meter:
        wrapped_measured = DistributedDataParallel(measured)  # measure() kept the buffers out of it too
        assert not ours & set(wrapped_measured.named_module_buffers)
        GNSMeter(wrapped_measured).close()
        del wrapped_measured
        measured = buffered.measure(tiny_hf("gpt2").train())
        del measured._ddp_params_and_buffers_to_ignore  # a wrapper that broadcasts them: refused
        with pytest.raises(ValueError, match="broadcast_buffers") as error:
            GNSMeter(DistributedDataParallel(measured))
        assert "\n" not in str(error.value)
        del error
        GNSMeter(DistributedDataParallel(measured, broadcast_buffers=False))
        del wrapped
        gc.collect()  # DDP's reducers released before the process group (see test_layers.py)
    finally:
        dist.destroy_process_group()


class SequenceFirst(nn.Module):
    """Token ids [T, B] in, logits [T, B, V] out: nn.Transformer's default layout (batch_first=False)."""

    def __init__(self, vocab=11, width=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.block = nn.TransformerEncoderLayer(width, 2, dim_feedforward=16, dropout=0.0)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids):
        return self.head(self.norm(self.block(self.embed(ids))))


def sequence_first_loss(model, ids):
    logits = model(ids)
    return nn.functional.cross_entropy(logits.flatten(0, 1), ((ids + 1) % logits.shape[-1]).flatten())


def test_sequence_first_input_is_named_and_batch_dim_1_measures_each_example():
    torch.manual_seed(5)
    ids = torch.randint(0, 11, (6, 3))  # T = 6 positions of B = 3 examples
    model = SequenceFirst()
    params = {n: p for n, p in model.named_parameters()}
    per_example = []
    for b in range(3):
        model.zero_grad(set_to_none=True)
        sequence_first_loss(model, ids[:, b:b + 1]).backward()
        per_example.append({n: p.grad.double().clone() for n, p in params.items()})
    model.zero_grad(set_to_none=True)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        GNSMeter(SequenceFirst())
    named = [str(w.message) for w in caught if "batch_first=False" in str(w.message)]
    assert len(named) == 1 and "batch_dim=1" in named[0] and "\n" not in named[0]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the attention's in_proj is no Linear: unmeasured, named in a warning
        meter = GNSMeter(model, batch_dim=1)
    sequence_first_loss(model, ids).backward()
    values = meter.step()
    checked = 0
    for name in params:
        if f"train/gns/{name}/pegn" not in values:
            continue
        small = sum(g[name].square().sum().item() for g in per_example) / 3
        big = (sum(g[name] for g in per_example) / 3).square().sum().item()
        assert values[f"train/gns/{name}/batch_size"] == 3
        assert values[f"train/gns/{name}/pegn"] ** 2 == pytest.approx(small, rel=1e-4, abs=1e-12), name
        assert values[f"train/gns/{name}/norm"] ** 2 == pytest.approx(big, rel=1e-4, abs=1e-12), name
        checked += 1
    assert checked == 13  # the embedding, the block's two Linears and two LayerNorms, the last norm, the head


class SequenceFirstWithPositions(SequenceFirst):
    def forward(self, ids):  # positions [T]: no dimension for the examples
        return self.head(self.norm(self.embed(ids) + self.position(torch.arange(ids.shape[0]))[:, None]))


def test_batch_dim_refusals_are_one_line():
    import nanogns.layers as buffered
    measured = buffered.measure(two_linears())
    with pytest.raises(ValueError, match="measured with batch_dim=0, not 1") as error:
        GNSMeter(measured, batch_dim=1)
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="batch_dim=2"):
        GNSMeter(two_linears(), batch_dim=2)
    model = SequenceFirstWithPositions()
    model.position = nn.Embedding(6, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        GNSMeter(model, batch_dim=1)
    with pytest.raises(RuntimeError, match=r"position: its input \(6,\) has no dimension 1") as error:
        model(torch.randint(0, 11, (6, 3)))
    assert "\n" not in str(error.value)


# -- a resume's state belongs to its model, and measures as the run it continues ----------------------------

def gpt2(n_embd=32, n_layer=2):
    """tiny_hf('gpt2') at another width or depth."""
    import transformers
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=2, vocab_size=97, n_positions=16,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).train()


def stepped_state(model):
    """The state of a meter on `model` after one step, the meter closed."""
    meter = GNSMeter(model)
    x = token_rows(4)
    model(input_ids=x, labels=x).loss.backward()
    meter.step()
    model.zero_grad(set_to_none=True)
    meter.close()
    return meter.state_dict()


def test_the_state_of_another_model_is_refused_in_one_line_and_an_older_state_still_loads(tmp_path):
    from nanogns.meter import GNSMeterError
    state = stepped_state(gpt2())
    for other, named in ((gpt2(n_embd=64), r"transformer\.wte\.weight is \[97, 32\] there, \[97, 64\] in this"),
                         (gpt2(n_layer=3), r"28 parameters, this GPT2LMHeadModel 40: transformer\.h\.2\.\S+ is not in it")):
        meter = GNSMeter(other, out_dir=str(tmp_path / "other"))
        with pytest.raises(GNSMeterError, match="another model's") as error:
            meter.load_state_dict(state)
        assert re.search(named, str(error.value)) and "\n" not in str(error.value)
        assert meter.step_count == 0 and not meter.resumed and not os.path.exists(tmp_path / "other")
        meter.close()
    # a state saved before the meter kept its parameters: the same model takes it, a shallower one does not
    from nanogns.meter import MEASURED_KEY
    assert state[MEASURED_KEY]["transformer.wte.weight"] == [97, 32]
    older = {key: value for key, value in state.items() if key != MEASURED_KEY}
    deeper = {key: value for key, value in stepped_state(gpt2(n_layer=3)).items() if key != MEASURED_KEY}
    with pytest.raises(GNSMeterError, match=r"the Linear transformer\.h\.2\.\S+, which this GPT2LMHeadModel does not"):
        GNSMeter(gpt2()).load_state_dict(deeper)
    model = gpt2()
    resumed = GNSMeter(model)
    resumed.load_state_dict(older)
    x = token_rows(4, seed=3)
    model(input_ids=x, labels=x).loss.backward()
    assert resumed.step()["train/gns/transformer.wte.weight/batch_size"] == 4 and resumed.step_count == 2


def test_a_resumed_meter_measures_its_first_backward_with_the_restored_methods_unchosen(monkeypatch):
    import nanogns.layers as buffered
    import nanogns.layers.linear as linear
    monkeypatch.setattr(linear._MeasuredLinear, "per_example_mode", "auto")  # each Linear chooses once
    state = stepped_state(gpt2())
    chosen = state["linear_norm_methods"]
    assert len(chosen) == 9  # every measured Linear of the tiny GPT-2 chose
    # the other method everywhere: what a resume then measures with cannot be a fresh choice
    state["linear_norm_methods"] = {name: "ghost" if method == "materialise" else "materialise"
                                    for name, method in chosen.items()}
    fresh = []
    original = linear._auto_method
    monkeypatch.setattr(linear, "_auto_method", lambda *a: fresh.append(a) or original(*a))
    model = gpt2()
    meter = GNSMeter(model)
    meter.load_state_dict(state)
    assert buffered.linear_norm_methods(model) == state["linear_norm_methods"]  # before any backward
    x = token_rows(4, seed=3)
    model(input_ids=x, labels=x).loss.backward()
    assert fresh == []  # the first resumed step chose nothing afresh
    meter.step()
    assert buffered.linear_norm_methods(model) == state["linear_norm_methods"]


def test_a_backward_that_writes_no_grad_is_named_with_the_examples_counted():
    model = gpt2()
    meter = GNSMeter(model)
    x = token_rows(8)
    torch.autograd.grad(model(input_ids=x, labels=x).loss, list(model.parameters()))
    with pytest.raises(ValueError, match=r"counted 8 examples since the last step\(\), but no measured parameter "
                                         r"has a \.grad: .*torch\.autograd\.grad.*loss\.backward\(\)") as error:
        meter.step()
    assert "\n" not in str(error.value)
    model(input_ids=x[:2], labels=x[:2]).loss.backward()  # those 8 examples were dropped: this step counts its own
    assert meter.step()["train/gns/transformer.wte.weight/batch_size"] == 2


def test_a_model_that_is_no_module_is_refused_in_one_line():
    with pytest.raises(TypeError, match=r"^GNSMeter takes an nn\.Module .*not str 'not a model'$"):
        GNSMeter("not a model")


def test_a_value_that_is_no_number_is_refused_in_one_line_and_numbers_stay_numbers_in_the_log(tmp_path):
    import numpy as np
    model = two_linears()
    out = tmp_path / "run"
    meter = GNSMeter(model, out_dir=str(out))
    model(torch.randn(4, 4)).sum().backward()
    for values, named in (({"x": "a string"}, r"values\['x'\] is str 'a string', not a number"),
                          ({"x": torch.ones(2)}, r"values\['x'\] is a torch\.float32 tensor of shape \[2\]"),
                          ({"x": [1.0]}, r"values\['x'\] is list"), (3.0, "values is a dict")):
        with pytest.raises(TypeError, match=named) as error:
            meter.step(values)
        assert "\n" not in str(error.value)
    assert not os.path.exists(out / "log.csv") and meter.step_count == 0  # nothing measured, nothing written
    meter.step({"loss": torch.tensor(0.5), "lr": np.float32(0.25), "tokens": np.int64(7), "skipped": True,
                "nan_loss": float("nan"), "unset": None})
    model(torch.randn(4, 4)).sum().backward()
    meter.step({"loss": torch.tensor([1.5]), "lr": np.array(0.125), "skipped": torch.tensor(False)})
    meter.close()
    with open(out / "log.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["loss"], r["lr"], r["tokens"], r["skipped"], r["nan_loss"], r["unset"]) for r in rows] == [
        ("0.5", "0.25", "7", "1", "nan", ""), ("1.5", "0.125", "", "0", "", "")]
    # a resume keeps those rows: every cell is a number (a row with text would be moved aside)
    state = meter.state_dict()
    from nanogns.meter import MEASURED_KEY
    assert state[MEASURED_KEY] == {"0.weight": [4, 4], "0.bias": [4], "1.weight": [1, 4], "1.bias": [1]}
    resumed = GNSMeter(model, out_dir=str(out))
    resumed.load_state_dict({**state, "step": 2})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no row moved aside, none missing
        resumed.open_log()
    resumed.close()
    assert not os.path.exists(out / "log.csv.rejected")
