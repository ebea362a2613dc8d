"""bench/olmo_batch.py: the three settings on a tiny dataset, the table they write, and its refusals."""
import os

import pytest

from conftest import run_bench

pytest.importorskip("olmo_core", reason="OLMo-core (ai2-olmo-core, the 'olmo' extra) is not installed")


@pytest.mark.slow
def test_three_settings_end_to_end(tiny_dataset, tmp_path):
    out = tmp_path / "runs"
    done = run_bench("olmo_batch.py", f"--out_dir={out}", f"--data_dir={tiny_dataset}", "--seeds=1",
                     "--max_tokens=6144", "--warmup=2")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = (out / "results.md").read_text().splitlines()[2:]
    assert [row.split(" | ")[0].strip("| ") for row in rows] == ["fixed", "schedule", "gns"]
    steps = {row.split(" | ")[0].strip("| "): int(row.split(" | ")[2]) for row in rows}
    assert steps["fixed"] == 12 and steps["schedule"] < 12  # OLMo-core's schedule doubled the batch twice
    assert "16@" in rows[1] and "32@" in rows[1]
    assert (out / "gns-s1" / "gns" / "log.csv").is_file()
    again = run_bench("olmo_batch.py", f"--out_dir={out}", f"--data_dir={tiny_dataset}", "--seeds=1",
                      "--max_tokens=6144", "--settings=fixed")
    assert again.returncode == 2 and "holds a finished or started run" in again.stderr


@pytest.mark.parametrize("flags, words", [(["--settings=big"], "--settings from fixed, schedule, gns (not big)"),
                                          (["--max_tokens=100"], "--max_tokens >= 6144"),
                                          (["--data_dir=/nonexistent"], "train.bin is missing")])
def test_bad_flags_exit_2_with_one_line(flags, words):
    done = run_bench("olmo_batch.py", *flags)
    assert done.returncode == 2 and words in done.stderr, done.stderr
    assert len([line for line in done.stderr.splitlines() if "error:" in line]) == 1
