"""bench/measure_hf.py: a measured Hugging Face GPT-2 timed against the plain one, beside our GPT, in one run."""
import csv
import importlib.util
import os

import pytest

from conftest import REPO

pytest.importorskip("transformers")
spec = importlib.util.spec_from_file_location("measure_hf", os.path.join(REPO, "bench", "measure_hf.py"))
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

TINY = ["--n_layer=1", "--n_embd=16", "--n_head=2", "--block_size=8", "--batch_size=2", "--vocab_size=50",
        "--iters=2", "--rounds=2", "--warmup=1", "--threads=1"]


def test_every_model_and_setting_timed_against_its_own_baseline(tmp_path, capsys):
    out = tmp_path / "hf.csv"
    bench.main(TINY + [f"--csv={out}"])
    with open(out) as f:
        rows = {(r["model"], r["setting"]): r for r in csv.DictReader(f)}
    assert list(rows) == [(m, s) for m in bench.MODELS for s in bench.SETTINGS]
    for (model, setting), r in rows.items():
        assert float(r["ms_median"]) > 0 and float(r["tokens_per_s"]) > 0
        assert float(r["ratio_min"]) <= float(r["ratio_by_round"]) <= float(r["ratio_max"])
        if setting == "nn":
            assert float(r["ratio"]) == 1.0 and r["measured_params"] == "0"
    # every parameter measured by the all-* settings (one layer: 16 of them, the tied matrix once), and
    # the LayerNorms' 6 by ln-shim, in both models alike
    assert {rows[m, "all-gns"]["measured_params"] for m in bench.MODELS} == {"16"}
    assert {rows[m, "ln-shim"]["measured_params"] for m in bench.MODELS} == {"6"}
    assert "hf-gpt2  all-gns" in capsys.readouterr().out
    assert not os.path.exists(str(out) + ".tmp")


@pytest.mark.parametrize("args", [["--settings=all-gns"], ["--settings=nn,bogus"], ["--iters=0"], ["--n_head=3"],
                                  ["--models=ours,bogus"]])
def test_bad_input_is_one_line_exit_2(args, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(TINY + args)
    assert e.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1


def test_the_mixture_of_experts_models_measure_every_parameter(tmp_path):
    out = tmp_path / "moe.csv"
    models = ["ours-moe", "hf-mixtral", "hf-qwen2-moe"]
    bench.main(TINY + ["--n_embd=32", f"--models={','.join(models)}", "--settings=nn,all-gns", f"--csv={out}"])
    with open(out) as f:
        rows = {(r["model"], r["setting"]): r for r in csv.DictReader(f)}
    assert list(rows) == [(m, s) for m in models for s in ("nn", "all-gns")]
    assert all(int(rows[m, "all-gns"]["measured_params"]) > 0 for m in models)
