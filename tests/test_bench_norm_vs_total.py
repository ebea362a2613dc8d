"""bench/norm_vs_total.py: both model families trained on the tiny dataset, and its table is
what gns-analysis.py reports of each run's normalisation-only and total GNS."""
import os
import re
import subprocess
import sys

import pandas as pd
import pytest

from conftest import REPO


@pytest.mark.slow
def test_both_families_end_to_end(bench_runs):
    out, _ = bench_runs["norm_vs_total.py"]
    runs = pd.read_csv(out / "results.csv")
    assert runs.family.tolist() == ["gpt2", "llama"]
    # the Llama-style run is what its flags ask for: RMSNorm gains, untied head, no positions table
    columns = pd.read_csv(out / "llama-s1" / "log.csv", nrows=0).columns
    assert "train/gns/transformer.h.0.ln_1.weight/norm" in columns and "train/gns/lm_head.weight/norm" in columns
    assert not any("wpe" in c or "ln_1.bias" in c for c in columns)
    # the numbers are what gns-analysis.py prints for that run
    for row in runs.itertuples():
        analysis = subprocess.run([sys.executable, os.path.join(REPO, "gns-analysis.py"), str(out / f"{row.family}-s1"),
                                   "--alpha=0.5", "--no-plots"], capture_output=True, text=True, cwd=REPO, timeout=120)
        norm = "LayerNorm" if row.family == "gpt2" else "RMSNorm"  # the group named after the model's
        found = re.search(rf"{norm} vs total GNS over (\d+) steps .*median ([\d.]+), .*Pearson r ([-\d.na]+)",
                          analysis.stdout)
        assert found, analysis.stdout + analysis.stderr
        assert row.steps == int(found.group(1)) > 0
        assert f"{row.ratio_median:.3f}" == found.group(2) and f"{row.pearson:.3f}" == found.group(3)
    assert "| llama | 1 |" in (out / "results.md").read_text()


def test_bad_input_is_one_line_exit_2():
    p = subprocess.run([sys.executable, os.path.join(REPO, "bench", "norm_vs_total.py"), "--seeds=0"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--seeds and --max_tokens must be >= 1" in p.stderr.strip().splitlines()[-1]
