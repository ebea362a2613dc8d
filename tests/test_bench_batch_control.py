"""bench/batch_control.py: the crossing of the target loss, the table, and a short end-to-end run
of two settings on the tiny dataset (every run is train.py's own; the numbers come from its logs)."""
import importlib.util
import math
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from conftest import BATCH_CONTROL, REPO, run_bench

spec = importlib.util.spec_from_file_location("batch_control", os.path.join(REPO, "bench", "batch_control.py"))
batch_control = importlib.util.module_from_spec(spec)
spec.loader.exec_module(batch_control)


def test_first_reaching_interpolates_between_evaluations():
    xs, losses = np.array([0.0, 100.0, 200.0]), np.array([4.0, 3.0, 2.0])
    assert batch_control.first_reaching(xs, losses, 2.5) == pytest.approx(150.0)
    assert batch_control.first_reaching(xs, losses, 4.5) == 0.0  # reached at the first evaluation
    assert math.isnan(batch_control.first_reaching(xs, losses, 1.0))
    # the first crossing counts, not a later one
    assert batch_control.first_reaching(xs, np.array([4.0, 2.0, 3.0]), 3.0) == pytest.approx(50.0)


def test_the_table_says_how_many_seeds_reached_the_target():
    logs = {}
    for seed, losses in ((1, [4.0, 3.0, 2.0]), (2, [4.0, 3.5, 3.0])):
        logs[("fixed-floor", seed)] = pd.DataFrame({"tokens_processed": [100, 200, 300], "val/loss": losses,
                                                   "eval_tokens": [0, 200, 300]})
    runs, table = batch_control.summarise(logs, target=2.5)
    assert runs.tokens_to_target.tolist()[0] == pytest.approx(250.0) and math.isnan(runs.tokens_to_target[1])
    text = batch_control.markdown(table, 2.5, seeds=2)
    assert "| fixed-floor | 250 [250-250] (1 of 2 seeds) | 2 [2-2] (1 of 2 seeds) | 2.5000 [2.0000-3.0000] |" in text


def test_evaluations_count_the_optimizer_steps_before_each_evaluation():
    log = pd.DataFrame({"tokens_processed": [10, 30, 60, 100], "val/loss": [4.0, np.nan, 3.0, 2.0],
                        "eval_tokens": [0, np.nan, 30, 100]})
    tokens, steps, losses = batch_control.evaluations(log)
    assert tokens.tolist() == [0, 30, 100] and steps.tolist() == [0, 2, 4] and losses.tolist() == [4.0, 3.0, 2.0]


@pytest.mark.slow
def test_two_settings_end_to_end(bench_runs, tiny_dataset, tmp_path):
    out, stdout = bench_runs["batch_control.py"]
    runs = pd.read_csv(out / "results.csv")
    assert runs.setting.tolist() == ["fixed-floor", "gns-total"] and (runs.tokens == 4096).all()
    floor = pd.read_csv(out / "fixed-floor-s1" / "log.csv")
    assert (floor["gradient_accumulation_steps"] == 1).all() and len(floor) == runs.steps[0] == 16
    controlled = pd.read_csv(out / "gns-total-s1" / "log.csv")
    assert "bs_controller/target_examples" in controlled and controlled["bs_controller/target_examples"][2:].notna().all()
    # the table's numbers are the logs': the default target is the worse final validation loss
    finals = [pd.read_csv(out / f"{s}-s1" / "log.csv")["val/loss"].dropna().iloc[-1] for s in runs.setting]
    assert runs.final_val_loss.tolist() == pytest.approx(finals)
    assert f"target validation loss {max(finals):.4f}" in (out / "results.md").read_text()
    assert "| fixed-floor |" in stdout and "validation loss vs tokens" in stdout
    # a line when each run starts (which of how many) and one when it ends
    assert "1 torch thread(s) each" in stdout.splitlines()[0]
    assert "[1/2] fixed-floor seed 1: training into" in stdout and "[2/2] gns-total seed 1: training into" in stdout
    assert re.search(r"^  \[2/2\] gns-total seed 1: \d+ s$", stdout, re.MULTILINE)
    # a finished run is not run again (in a copy: the notebook's test reads these runs)
    shutil.copytree(out, tmp_path / "runs")
    again = run_bench("batch_control.py", f"--out_dir={tmp_path / 'runs'}", f"--dataset={tiny_dataset}", *BATCH_CONTROL)
    assert again.returncode == 0 and "[1/2] fixed-floor seed 1: finished earlier, kept" in again.stdout
    assert "training into" not in again.stdout and not re.search(r"seed 1: \d+ s", again.stdout)


@pytest.mark.slow
def test_the_runs_do_not_depend_on_the_thread_count_of_the_environment(bench_runs, tiny_dataset, tmp_path):
    """Every run gets --threads torch threads (1), whatever OMP_NUM_THREADS says, and the Linears' norm
    methods by their shapes, not by a timing: the same runs again give the same logs, bit for bit."""
    out, _ = bench_runs["batch_control.py"]
    env = dict(os.environ, OMP_NUM_THREADS="2", WANDB_MODE="disabled")
    p = subprocess.run([sys.executable, os.path.join(REPO, "bench", "batch_control.py"), f"--out_dir={tmp_path}",
                        f"--dataset={tiny_dataset}", *BATCH_CONTROL], cwd=REPO, capture_output=True, text=True,
                       timeout=300, env=env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    for setting in ("fixed-floor", "gns-total"):
        first, again = (pd.read_csv(d / f"{setting}-s1" / "log.csv").drop(columns=["dt", "tokens_per_sec", "mfu"])
                        for d in (out, tmp_path))
        pd.testing.assert_frame_equal(first, again, check_exact=True)
        assert "per_example_mode = 'shapes'" in (tmp_path / f"{setting}-s1" / "train.out").read_text()


def test_bad_input_is_one_line_exit_2():
    p = subprocess.run([sys.executable, os.path.join(REPO, "bench", "batch_control.py"), "--settings=huge"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "unknown setting(s) huge" in p.stderr.strip().splitlines()[-1]
    p = subprocess.run([sys.executable, os.path.join(REPO, "bench", "batch_control.py"), "--threads=0"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--threads must be >= 1" in p.stderr.strip().splitlines()[-1]
