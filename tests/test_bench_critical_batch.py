"""bench/critical_batch.py --quick: the whole pipeline on a tiny model (base run, branches, fit),
its CSVs' columns, summary's B_crit the fit of branches.csv's best rows, and a run that is
started again keeping every finished branch."""
import os
import shutil
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from conftest import REPO
from gnsmath import fit_critical_batch

SCRIPT = os.path.join(REPO, "bench", "critical_batch.py")


def critical_batch(*args, timeout=600):
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.mark.slow
def test_quick_pipeline_writes_both_csvs_and_keeps_finished_branches(bench_runs, tiny_dataset, tmp_path):
    out = tmp_path / "cb"  # a copy: the session's run is the notebook's too
    shutil.copytree(bench_runs["critical_batch.py"][0], out)
    branches, summary = pd.read_csv(out / "branches.csv"), pd.read_csv(out / "summary.csv")
    assert list(branches.columns) == ["family", "seed", "branch_tokens", "batch_size", "learning_rate", "best",
                                      "steps", "examples", "reached"]
    assert list(summary.columns) == ["family", "seed", "branch_tokens", "s_min", "e_min", "b_crit", "b_simple_total",
                                     "b_simple_norm", "b_simple_norm_adam"]
    # 3 branch points x 5 batch sizes (x16) x 3 learning rates, the same grid everywhere
    assert len(summary) == 3 and len(branches) == 45
    assert branches.groupby("branch_tokens").size().tolist() == [15, 15, 15]
    assert branches.batch_size.max() / branches.batch_size.min() >= 16 and branches.learning_rate.nunique() == 3
    reached = branches[branches.reached]
    assert (reached.examples == reached.batch_size * reached.steps).all()
    assert branches[~branches.reached].steps.isna().all()
    fitted = 0
    for row in summary.itertuples():
        here = branches[branches.branch_tokens == row.branch_tokens]
        best = here[here.best]
        # one best rate per batch size that reached the target: its fewest steps
        assert best.batch_size.is_unique
        for b, group in here[here.reached].groupby("batch_size"):
            assert best[best.batch_size == b].steps.item() == group.steps.min()
        try:
            s_min, e_min = fit_critical_batch(best.batch_size.tolist(), best.steps.tolist())
        except ValueError:
            assert np.isnan(row.b_crit)
            continue
        fitted += 1
        assert (row.s_min, row.e_min, row.b_crit) == pytest.approx((s_min, e_min, e_min / s_min))
        assert row.b_simple_total > 0 and row.b_simple_norm > 0
    assert fitted >= 1
    gns = pd.read_csv(out / "gns_gpt2-s1.csv")
    assert list(gns.columns) == ["tokens", "b_simple_total", "b_simple_norm", "b_simple_norm_adam"]
    # started again: every branch is kept, nothing is run twice, the results are the same
    again = critical_batch("--quick", f"--out_dir={out}", f"--dataset={tiny_dataset}")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "45 branches were kept from an earlier run, 0 run now" in again.stdout
    pd.testing.assert_frame_equal(pd.read_csv(out / "branches.csv"), branches)


def test_bad_input_is_one_line_exit_2():
    p = critical_batch("--seeds=0", timeout=60)
    assert p.returncode == 2 and "--seeds must be >= 1" in p.stderr.strip().splitlines()[-1]
    p = critical_batch("--families=gpt3", timeout=60)
    assert p.returncode == 2 and "--families must name some of gpt2, llama" in p.stderr.strip().splitlines()[-1]
