"""bench/critical_batch.py --quick: the whole pipeline on a tiny model (base run, branches, fit),
its CSVs' columns, summary's B_crit the fit of branches.csv's best rows, and a run that is
started again keeping every finished branch."""
import os
import shutil

import numpy as np
import pandas as pd
import pytest

from conftest import REPO
from gnsmath import fit_critical_batch

SCRIPT = os.path.join(REPO, "bench", "critical_batch.py")


def critical_batch(capsys, *args):
    """(exit code, stdout, stderr) of the script run in this process until it exits: for the runs that
    train nothing, without paying a fresh interpreter's import of torch each time."""
    try:
        code = load_script().main(list(args))
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.slow
def test_quick_pipeline_writes_both_csvs_and_keeps_finished_branches(bench_runs, tiny_dataset, tmp_path, capsys):
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
    code, stdout, stderr = critical_batch(capsys, "--quick", f"--out_dir={out}", f"--dataset={tiny_dataset}")
    assert code == 0, stderr[-2000:]
    assert "45 branches were kept from an earlier run, 0 run now" in stdout
    pd.testing.assert_frame_equal(pd.read_csv(out / "branches.csv"), branches)


def test_bad_input_is_one_line_exit_2(capsys):
    code, _, stderr = critical_batch(capsys, "--seeds=0")
    assert code == 2 and "--seeds must be >= 1" in stderr.strip().splitlines()[-1]
    code, _, stderr = critical_batch(capsys, "--families=gpt3")
    assert code == 2 and "--families must name some of gpt2, llama" in stderr.strip().splitlines()[-1]


def load_script():
    import importlib.util
    spec = importlib.util.spec_from_file_location("critical_batch", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rows(*branches):
    """branches.csv rows of one point: (batch_size, learning_rate, steps or None)."""
    return pd.DataFrame([dict(family="gpt2", seed=1, branch_tokens=100, batch_size=b, learning_rate=lr, best=False,
                              steps=s if s is not None else np.nan, examples=b * s if s is not None else np.nan,
                              reached=s is not None) for b, lr, s in branches])


def test_a_rate_no_longer_in_the_grid_is_kept_but_never_best():
    cb = load_script()
    marked = cb.mark_best(rows((4, 1e-3, 50), (4, 3e-3, 20), (8, 1e-3, None), (8, 3e-4, 30)), (3e-4, 1e-3))
    assert marked["best"].tolist() == [True, False, False, True]  # 3e-3 took fewer steps, but is out of the grid
    assert len(marked) == 4


def test_a_best_rate_is_at_the_edge_only_when_no_rate_beyond_it_was_tried():
    cb = load_script()
    branches = cb.mark_best(rows((4, 1e-4, 90), (4, 3e-4, 140), (4, 1e-3, 300),
                                 (32, 1e-4, 40), (32, 3e-4, 30), (32, 1e-3, 20), (32, 3e-3, 45),
                                 (64, 1e-4, 40), (64, 3e-4, 30), (64, 1e-3, 20)), (1e-4, 3e-4, 1e-3))
    best = branches[branches["best"]]
    # B = 4 at the lowest rate, B = 64 at the highest; B = 32's best is the grid's top, but 3e-3 was tried
    assert {r.batch_size: cb.at_edge(r, branches) for r in best.itertuples()} == {4: True, 32: False, 64: True}


def test_report_refits_the_branches_as_they_stand_with_each_ratio_and_its_spread(tmp_path, capsys):
    cb = load_script()
    out = tmp_path / "cb"
    out.mkdir()
    s_min, e_min = 10.0, 300.0  # B_crit 30: exact points of S(B) = S_min + E_min / B at each B's best rate
    grid, sizes = cb.QUICK["learning_rates"], cb.QUICK["batch_sizes"]
    frames = []
    for seed in (1, 2):
        frames.append(rows(*[(b, lr, s_min + e_min / b + (0 if lr == grid[1] else 50)) for b in sizes
                             for lr in grid]).assign(seed=seed))
        # B_simple at the branch point (100 tokens) is the last value at or before it: total 15 or 30
        pd.DataFrame(dict(tokens=[50, 100, 150], b_simple_total=[1.0, 15.0 * seed, 99.0],
                          b_simple_norm=[1.0, 10.0, 99.0], b_simple_norm_adam=[1.0, 30.0 if seed == 1 else -5.0, 99.0])
                     ).to_csv(out / f"gns_gpt2-s{seed}.csv", index=False)
    frames[1] = frames[1][frames[1]["batch_size"] != sizes[0]]  # seed 2 has not finished its grid
    pd.concat(frames).to_csv(out / "branches.csv", index=False)
    code, stdout, stderr = critical_batch(capsys, "--report", "--quick", f"--out_dir={out}")
    assert code == 0, stderr
    lines = stdout.splitlines()
    assert "| gpt2 | 1 | 100 | 15 of 15 | 10 | 300 | 30 | 15 | 10 | 30 |" in lines
    assert "| gpt2 | 2 | 100 | 12 of 15 | – | – | – | 30 | 10 | < 0 |" in lines  # an EMA of |G|^2 still negative
    assert "seed 2 at 100 tokens: 12 of 15 branches run, no fit yet" in stderr
    summary = pd.read_csv(out / "summary.csv")  # rewritten for the notebook
    assert summary.b_crit.tolist()[0] == pytest.approx(30) and np.isnan(summary.b_crit.tolist()[1])
    # the ratios over the fitted seeds (one here), then each estimate over every fitted point
    assert "| gpt2 | 100 | 1 | 30.00 | 2.00 | 3.00 | 1.00 |" in lines
    assert "| B_simple total | 1 | 2 | – |" in lines and "| B_simple norm, Adam | 1 | 1 | – |" in lines
    # both seeds fitted: the mean ratio with its range over seeds, and the spread of the log ratio
    pd.concat([frames[0], frames[0].assign(seed=2)]).to_csv(out / "branches.csv", index=False)
    lines = critical_batch(capsys, "--report", "--quick", f"--out_dir={out}")[1].splitlines()
    # (seed 2's negative Adam B_simple gives no ratio)
    assert "| gpt2 | 100 | 2 | 30.00 (30.00–30.00) | 1.50 (1.00–2.00) | 3.00 (3.00–3.00) | 1.00 |" in lines
    assert f"| B_simple total | 2 | 1.41 | {np.std(np.log([2, 1]), ddof=1):.3g} |" in lines


def test_a_b_crit_beyond_the_largest_batch_tried_is_marked_and_in_no_ratio(tmp_path, capsys):
    """Steps that halve with every doubling of the batch up to the largest tried give a fit whose
    B_crit lies far beyond it: an extrapolation, shown as such, in no ratio."""
    cb = load_script()
    out = tmp_path / "cb"
    out.mkdir()
    grid, sizes = cb.QUICK["learning_rates"], cb.QUICK["batch_sizes"]
    frames = [rows(*[(b, lr, s_min + e_min / b + (0 if lr == grid[1] else 50)) for b in sizes for lr in grid]
                   ).assign(branch_tokens=tokens)
              for tokens, s_min, e_min in ((100, 10.0, 300.0), (150, 1.0, 3000.0))]  # B_crit 30, then 3000
    pd.concat(frames).to_csv(out / "branches.csv", index=False)
    pd.DataFrame(dict(tokens=[100, 150], b_simple_total=[15.0, 100.0], b_simple_norm=[10.0, 50.0],
                      b_simple_norm_adam=[30.0, 80.0])).to_csv(out / "gns_gpt2-s1.csv", index=False)
    code, stdout, stderr = critical_batch(capsys, "--report", "--quick", f"--out_dir={out}")
    assert code == 0, stderr
    lines = stdout.splitlines()
    largest = max(sizes)
    assert f"| gpt2 | 1 | 150 | 15 of 15 | 1 | 3e+03 | 3e+03 (> {largest}: extrapolated) | 100 | 50 | 80 |" in lines
    assert f"B_crit 3e+03 lies beyond the largest batch tried ({largest})" in stderr
    assert pd.read_csv(out / "summary.csv").b_crit.tolist() == pytest.approx([30, 3000])  # the fit, as it is
    assert not any(line.startswith("| gpt2 | 150 |") for line in lines)  # no ratio at that point
    assert "| B_simple total | 1 | 2 | – |" in lines  # only the point within the batches tried


def test_report_needs_the_experiments_csvs(tmp_path, capsys):
    code, _, stderr = critical_batch(capsys, "--report", f"--out_dir={tmp_path}")
    assert code == 2 and "has no branches.csv" in stderr.strip().splitlines()[-1]
