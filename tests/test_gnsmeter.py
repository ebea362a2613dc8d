"""
gnsmeter.GNSMeter, the GNS of any loop in one object: its numbers against one backward per
example, its log against gns-analysis.py, a resume through state_dict(), and its one-line refusals.
"""
import json
import os
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn as nn

from gns_fixtures import one_thread, tiny_hf  # noqa: F401  (one_thread: autouse)
from gnsmeter import GNSMeter
from loop_fixtures import (gns_columns, largest_difference, own_loop, run_readme_example, token_rows,
                           torchrun_two_ranks)

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
    assert all(sq.item() == 0 for _, _, sq, _ in __import__("buffered").find_sqgradnorm_buffers(model))


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
    from gnsmeter import GNSMeter as Meter
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

    x = token_rows(2)
    model(input_ids=x, labels=x).loss.backward()
    GNSMeter(model).step()  # a meter that steps...
    meter = GNSMeter(model)
    meter.step()
    with pytest.raises(ValueError, match="before the first step"):
        meter.load_state_dict({"step": 3, "gns_estimators": {}})  # ...cannot be resumed after
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
            "print(sorted(m for m in ('transformers', 'lightning') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_readme_example_runs_as_written(tmp_path):
    output = run_readme_example(0, tmp_path, "out-my-loop")
    assert output.count("step ") == 20 and "gns " in output


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
