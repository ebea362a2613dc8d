"""bench/critical_batch.py --quick: the whole pipeline on a tiny model (base run, branches, fit),
its CSVs' columns, summary's B_crit the fit of branches.csv's best rows, a line per base run and
branch, and a run that is started again keeping every finished branch; a run of another setting
(or from another checkpoint, or with other train.py flags or data than its base runs or branches
had) refused before it changes anything; --report's tables, one set per setting, naming censored
batch sizes, fits on two points and extrapolations both ways; bad input as one line."""
import contextlib
import io
import os
import shutil

import numpy as np
import pandas as pd
import pytest
import torch

from conftest import REPO
from nanogns.maths import fit_critical_batch

SCRIPT = os.path.join(REPO, "bench", "critical_batch.py")


def critical_batch(capsys, *args, script=None):
    """(exit code, stdout, stderr) of the script (a fresh load_script() unless given) run in this process
    until it exits: for the runs that train nothing, without paying a fresh interpreter's import of
    torch each time."""
    try:
        code = (script or load_script()).main(list(args))
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
                                     "b_simple_norm", "b_simple_norm_adam", "b_crit_low", "b_crit_high", "fit_points",
                                     "censored", "setting"]
    # the branches' setting, then the base runs': the dataset's content (--dataset gave its place), no other flag
    content = load_script().dataset_content(tiny_dataset)
    assert (summary.setting == f"delta 0.2 max_steps 150 eval 4x16 dataset_content {content}").all()
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
        # the batch sizes no rate brought to the target are named: right-censored, not in the fit
        never = sorted(set(here.batch_size) - set(here[here.reached].batch_size))
        assert (row.censored.split() if isinstance(row.censored, str) else []) == [str(b) for b in never]
        try:
            s_min, e_min = fit_critical_batch(best.batch_size.tolist(), best.steps.tolist())
        except ValueError:
            assert np.isnan(row.b_crit)
            continue
        fitted += 1
        assert (row.s_min, row.e_min, row.b_crit) == pytest.approx((s_min, e_min, e_min / s_min))
        assert row.fit_points == len(best)
        if len(best) > 2:
            assert 0 <= row.b_crit_low <= row.b_crit_high
        else:
            assert np.isnan(row.b_crit_low) and np.isnan(row.b_crit_high)
        assert row.b_simple_total > 0 and row.b_simple_norm > 0
    assert fitted >= 1
    gns = pd.read_csv(out / "gns_gpt2-s1.csv")
    assert list(gns.columns) == ["tokens", "b_simple_total", "b_simple_norm", "b_simple_norm_adam"]
    # a line as each base run and each branch starts: what runs, how many of how many
    lines = bench_runs["critical_batch.py"][1].splitlines()
    for k, step in enumerate((20, 40, 60), 1):
        assert f"  gpt2 seed 1: base run to step {step} ({k} of 3 checkpoints) ..." in lines
    started = [line for line in lines if line.startswith("  [") and " tokens: B=" in line]
    assert [int(line[3:].split("/")[0].split(",")[0]) for line in started] == list(range(1, 46))
    assert all(line.split("/")[1].startswith("45,") for line in started)
    for row in branches.itertuples():  # each line names its branch, and ends with what it took
        name = f"at {row.branch_tokens:,} tokens: B={row.batch_size} lr={row.learning_rate:g} ..."
        line = next(x for x in started if name in x)
        assert line.endswith(" s)")
        assert f" {row.steps:.1f} steps (" in line if row.reached else " not reached (" in line
    # started again, on the same data moved elsewhere: every branch is kept, nothing is run twice, the results
    # are the same
    moved = shutil.copytree(tiny_dataset, tmp_path / "moved" / "renamed")
    code, stdout, stderr = critical_batch(capsys, "--quick", f"--out_dir={out}", f"--dataset={moved}")
    assert code == 0, stderr[-2000:]
    assert "45 branches were kept from an earlier run, 0 run now" in stdout
    last = branches.branch_tokens.max()
    assert f"  [45/45] gpt2 seed 1 at {last:,} tokens: 15 branches kept from an earlier run" in stdout
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
    # exact points: no scatter about the curve, so the bootstrap interval is the point itself
    assert "| gpt2 | 1 | 100 | 15 of 15 | – | 10 | 300 | 30 | 30–30 | 15 | 10 | 30 |" in lines
    # (an EMA of |G|^2 still negative: < 0)
    assert "| gpt2 | 2 | 100 | 12 of 15 | – | – | – | – | – | 30 | 10 | < 0 |" in lines
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
    assert (f"| gpt2 | 1 | 150 | 15 of 15 | – | 1 | 3e+03 | 3e+03 (> {largest}: extrapolated) | 3e+03–3e+03 | "
            f"100 | 50 | 80 |") in lines
    assert f"B_crit 3e+03 lies beyond the largest batch tried ({largest})" in stderr
    assert pd.read_csv(out / "summary.csv").b_crit.tolist() == pytest.approx([30, 3000])  # the fit, as it is
    assert not any(line.startswith("| gpt2 | 150 |") for line in lines)  # no ratio at that point
    assert "| B_simple total | 1 | 2 | – |" in lines  # only the point within the batches tried


def test_report_needs_the_experiments_csvs(tmp_path, capsys):
    code, _, stderr = critical_batch(capsys, "--report", f"--out_dir={tmp_path}")
    assert code == 2 and "has no branches.csv" in stderr.strip().splitlines()[-1]


# -- nothing finished is lost, no setting mixed ----------------------------------------------------

QUICK_SETTING = "delta 0.2 max_steps 150 eval 4x16"  # --quick's, as checkpoints.csv records it


def trains_nothing():
    """The script with its training replaced by a failure: for the runs that must stop before any."""
    script = load_script()

    def trained(*args, **kwargs):
        raise AssertionError("it went on to train")
    script.base_run = script.run_branch = script.train_once = trained
    return script


def finished_out_dir(out, setting=QUICK_SETTING, weights="0123456789abcdef"):
    """An OUT_DIR with one finished branch point (100 tokens) of --quick's grid, recorded for `setting`."""
    out.mkdir()
    grid, sizes = load_script().QUICK["learning_rates"], load_script().QUICK["batch_sizes"]
    rows(*[(b, lr, 10 + 300 / b + (0 if lr == grid[1] else 50)) for b in sizes for lr in grid]
         ).to_csv(out / "branches.csv", index=False)
    pd.DataFrame(dict(family=["gpt2"], seed=[1], branch_tokens=[100], fingerprint=[f"{weights} {setting}"])
                 ).to_csv(out / "checkpoints.csv", index=False)
    return {name: (out / name).read_bytes() for name in ("branches.csv", "checkpoints.csv")}


@pytest.mark.parametrize("args, named", [
    (["--quick", "--delta=0.35"], ["delta 0.2, not 0.35"]),
    ([], ["delta 0.2, not 0.05", "max_steps 150, not 2000", "eval 4x16, not 8x16"]),  # the full experiment's
])
def test_another_setting_on_an_out_dir_is_refused_in_one_line_and_deletes_nothing(tmp_path, tiny_dataset, capsys,
                                                                                    args, named):
    out = tmp_path / "cb"
    before = finished_out_dir(out)
    code, _, stderr = critical_batch(capsys, *args, f"--out_dir={out}", f"--dataset={tiny_dataset}",
                                     script=trains_nothing())
    assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr
    assert all(words in stderr for words in named) and "another --out_dir" in stderr
    assert f"--work_dir={out / 'base'} reuses the base runs" in stderr
    assert {name: (out / name).read_bytes() for name in before} == before


def test_the_same_setting_on_an_out_dir_goes_on(tmp_path, tiny_dataset, capsys):
    out = tmp_path / "cb"
    finished_out_dir(out)
    with pytest.raises(AssertionError, match="it went on to train"):
        critical_batch(capsys, "--quick", f"--out_dir={out}", f"--dataset={tiny_dataset}", script=trains_nothing())


def test_branches_with_no_recorded_setting_are_refused(tmp_path, tiny_dataset, capsys):
    out = tmp_path / "cb"
    finished_out_dir(out)
    (out / "checkpoints.csv").unlink()
    code, _, stderr = critical_batch(capsys, "--quick", f"--out_dir={out}", f"--dataset={tiny_dataset}",
                                     script=trains_nothing())
    assert code == 2 and "no record in checkpoints.csv" in stderr.strip().splitlines()[-1]


def test_a_checkpoint_that_is_not_the_branches_one_is_refused_and_deletes_nothing(tmp_path, tiny_dataset, capsys):
    """A base run rebuilt (or trained by other code) gives other weights at a branch point: its branches
    are kept, and the run stops before running any again."""
    out = tmp_path / "cb"
    before = finished_out_dir(out)
    script = trains_nothing()
    script.base_run = lambda *args: (str(tmp_path), {20: str(tmp_path / "ckpt-20.pt")})
    script.b_simple_at = lambda run, alpha: pd.DataFrame(dict(tokens=[100], b_simple_total=[1.0], b_simple_norm=[1.0],
                                                              b_simple_norm_adam=[1.0]))
    script.read_checkpoint = lambda path: {"model": {"tokens_processed": 100}}
    script.fingerprint = lambda path: "fedcba9876543210"
    code, _, stderr = critical_batch(capsys, "--quick", f"--out_dir={out}", f"--dataset={tiny_dataset}", script=script)
    assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr
    assert "fingerprint fedcba9876543210, recorded 0123456789abcdef" in stderr and "another --out_dir" in stderr
    assert {name: (out / name).read_bytes() for name in before} == before
    assert not (out / "gns_gpt2-s1.csv").exists()  # nor the other base run's B_simple beside these branches


def report_out_dir(out, points):
    """An OUT_DIR of finished --quick grids: points [(tokens, S_min, E_min, setting or None)], each batch size's
    best rate (the middle one) on S = S_min + E_min / B exactly, the others 50 steps slower; steps None:
    not reached. B_simple 10 everywhere."""
    out.mkdir()
    script = load_script()
    grid, sizes = script.QUICK["learning_rates"], script.QUICK["batch_sizes"]
    frames, records = [], []
    for tokens, steps, setting in points:
        frames.append(rows(*[(b, lr, None if steps(b) is None else steps(b) + (0 if lr == grid[1] else 50))
                             for b in sizes for lr in grid]).assign(branch_tokens=tokens))
        if setting:
            records.append(dict(family="gpt2", seed=1, branch_tokens=tokens, fingerprint=f"0123456789abcdef {setting}"))
    pd.concat(frames).to_csv(out / "branches.csv", index=False)
    if records:
        pd.DataFrame(records).to_csv(out / "checkpoints.csv", index=False)
    pd.DataFrame(dict(tokens=[0], b_simple_total=[10.0], b_simple_norm=[10.0], b_simple_norm_adam=[10.0])
                 ).to_csv(out / "gns_gpt2-s1.csv", index=False)


def test_report_gives_each_setting_its_own_tables_and_says_so(tmp_path, capsys):
    """Branch points of two deltas (a run for another delta, stopped midway, by earlier versions that
    replaced rows): never one table, one fit or one ratio across them."""
    out = tmp_path / "cb"
    other = QUICK_SETTING.replace("delta 0.2", "delta 0.3")
    report_out_dir(out, [(100, lambda b: 10 + 300 / b, QUICK_SETTING), (200, lambda b: 10 + 100 / b, other),
                         (300, lambda b: 10 + 200 / b, QUICK_SETTING)])
    code, stdout, stderr = critical_batch(capsys, "--report", "--quick", f"--out_dir={out}")
    assert code == 0, stderr
    assert f"holds branches of 2 settings ({QUICK_SETTING}: 2 branch point(s); {other}: 1 branch point(s))" in stderr
    first, second = stdout.split(f"#### {other}")
    assert first.startswith(f"#### {QUICK_SETTING}\n")
    tables = {"first": first, "second": second}
    for name, tokens in (("first", [100, 300]), ("second", [200])):
        rows_here = [line for line in tables[name].splitlines() if line.startswith("| gpt2 | 1 |")]
        assert [int(line.split(" | ")[2].replace(",", "")) for line in rows_here] == tokens
        # the last table: the ratios over that setting's points alone (B_crit 30 and 20 at delta 0.2, 10 at 0.3)
        ratios = [line for line in tables[name].splitlines() if line.startswith("| B_simple total |")][0]
        assert ratios.split(" | ")[1:3] == (["2", f"{np.sqrt(3.0 * 2.0):.3g}"] if name == "first" else ["1", "1"])
    summary = pd.read_csv(out / "summary.csv")
    assert dict(zip(summary.branch_tokens, summary.setting)) == {100: QUICK_SETTING, 200: other, 300: QUICK_SETTING}
    # one setting: said once, above the tables
    report_out_dir(tmp_path / "one", [(100, lambda b: 10 + 300 / b, QUICK_SETTING)])
    code, stdout, stderr = critical_batch(capsys, "--report", "--quick", f"--out_dir={tmp_path / 'one'}")
    assert stdout.startswith(f"1 branch point(s), all run for {QUICK_SETTING}.\n") and "settings" not in stderr


def test_report_names_censored_batch_sizes_two_point_fits_and_extrapolations_below(tmp_path, capsys):
    out = tmp_path / "cb"
    report_out_dir(out, [
        (100, lambda b: None if b <= 4 else 10 + 300 / b, QUICK_SETTING),  # B = 2, 4 never reach the target
        (200, lambda b: 10 + 300 / b if b in (8, 32) else None, QUICK_SETTING),  # two batch sizes reach it
        (300, lambda b: 100 + 50 / b, QUICK_SETTING),  # B_crit 0.5, below the smallest batch tried (2)
    ])
    code, stdout, stderr = critical_batch(capsys, "--report", "--quick", f"--out_dir={out}")
    assert code == 0, stderr
    lines = stdout.splitlines()
    # right-censored: named in the output and the table, and the fit is that of the other batch sizes alone
    assert "seed 1 at 100 tokens: B = 2, 4 reached the target at no rate (right-censored: more than 150 steps" in stderr
    s_min, e_min = fit_critical_batch([8, 16, 32], [10 + 300 / b for b in (8, 16, 32)])
    assert f"| gpt2 | 1 | 100 | 15 of 15 | 2, 4 | {s_min:.3g} | {e_min:.3g} | {e_min / s_min:.3g} |" in stdout
    # two points: marked, no interval
    assert "seed 1 at 200 tokens: the fit rests on 2 batch sizes only (8, 32)" in stderr
    assert "| gpt2 | 1 | 200 | 15 of 15 | 2, 4, 16 | 10 | 300 | 30 (2 points) | – |" in stdout
    # below the smallest batch: an extrapolation as one above the largest is, and in no ratio
    assert "seed 1 at 300 tokens: B_crit 0.5 lies below the smallest batch tried (2)" in stderr
    assert "| gpt2 | 1 | 300 | 15 of 15 | – | 100 | 50 | 0.5 (< 2: extrapolated) | 0.5–0.5 | 10 | 10 | 10 |" \
        in lines
    assert not any(line.startswith("| gpt2 | 300 |") for line in lines)
    assert "| B_simple total | 2 | 3 |" in stdout  # B_crit 30 at 100 and 200 tokens, B_simple 10
    summary = pd.read_csv(out / "summary.csv")
    assert summary.censored.tolist()[:2] == ["2 4", "2 4 16"] and summary.fit_points.tolist() == [3, 2, 5]


def test_report_refuses_the_other_modes_branches(tmp_path, capsys):
    """--report judges the branches on --quick's grid or the full one: the recorded max_steps says which."""
    out = tmp_path / "cb"
    report_out_dir(out, [(100, lambda b: 10 + 300 / b, QUICK_SETTING)])
    code, _, stderr = critical_batch(capsys, "--report", f"--out_dir={out}")
    assert code == 2 and "add --quick" in stderr.strip().splitlines()[-1]
    code, _, stderr = critical_batch(capsys, "--report", "--quick", "--delta=0.3", f"--out_dir={out}")
    assert code == 2 and "--delta has no effect" in stderr.strip().splitlines()[-1]


# -- bad input: one line, exit 2, before anything runs ---------------------------------------------

@pytest.mark.parametrize("args, words", [
    (["--out_dir=/proc/x"], "--out_dir=/proc/x: cannot write there"),
    (["--out_dir={file}"], "is a file, not a folder"),
    (["--work_dir={file}"], "--work_dir={file} is a file, not a folder"),
    (["--batch_size=abc"], "--batch_size expects int"),
    (["--n_layer=0"], "--n_layer=0 must be a whole number >= 1"),
    (["--learning_rate=-1"], "--learning_rate=-1.0 must be a number > 0"),
    (["--bogus=1"], "unknown config key 'bogus'"),
    (["--seed=3"], "--seed is set by bench/critical_batch.py itself"),
    (["--max_tokens=100"], "--max_tokens is set by bench/critical_batch.py itself"),
    (["--seeds=abc"], "--seeds: invalid int value"),
    (["--delta=abc"], "--delta: invalid float value"),
    (["--delta=nan"], "--delta > 0"),
    (["--delta=inf"], "--delta > 0"),
    (["--alpha=1"], "--alpha in [0, 1)"),
    (["--dataset={missing}"], "is not prepared"),
    (["--device=nodevice"], "is not a device"),
])
def test_bad_values_are_one_line_exit_2_before_anything_runs(tmp_path, tiny_dataset, capsys, args, words):
    (tmp_path / "file").write_text("not a folder")
    names = dict(file=tmp_path / "file", missing=tmp_path / "missing")
    args = [a.format(**names) for a in args]
    where = [] if any(a.startswith("--out_dir") for a in args) else [f"--out_dir={tmp_path / 'cb'}"]
    code, _, stderr = critical_batch(capsys, "--quick", f"--dataset={tiny_dataset}", *where, *args,
                                     script=trains_nothing())
    assert code == 2 and len(stderr.strip().splitlines()) == 1 and words.format(**names) in stderr, stderr


# -- the base runs kept, and the branches recorded, are of this run's train.py flags and data ---------------

def kept_base_run(work_dir, dataset):
    """work_dir/gpt2-s1/ckpt-20.pt as a --quick base run on `dataset` keeps it: train.py's config of its
    command line, as train.py saves it, and the dataset's fingerprint (no weights: nothing loads them)."""
    from checkpoint import dataset_fingerprint
    from configurator import check_train_config, configure
    script = load_script()
    config, places = script.train_defaults(), {}
    flags = script.base_flags(str(work_dir), "gpt2", 1, script.QUICK)
    with contextlib.redirect_stdout(io.StringIO()):
        configure([script.CONFIG, *(f"--{k}={v!r}" for k, v in flags.items()), f"--dataset={dataset}"], config,
                  places=places)
        check_train_config(config, places)
    path = work_dir / "gpt2-s1" / "ckpt-20.pt"
    path.parent.mkdir(parents=True)
    model_args = {k: config[k] for k in ("n_layer", "n_head", "n_embd", "block_size")}
    torch.save({"model": {}, "model_args": {**model_args, "vocab_size": 28}, "dataset_fingerprint":
                dataset_fingerprint(dataset), "config": {**config, "max_tokens": 20 * 64, "vocab_size": 28}}, path)
    return path


def shuffled_copy(dataset, folder):
    """The dataset with its train tokens shuffled: the same size, other data."""
    shutil.copytree(dataset, folder)
    tokens = np.fromfile(folder / "train.bin", dtype=np.uint16)
    np.random.default_rng(0).permutation(tokens).tofile(folder / "train.bin")
    return folder


@pytest.mark.parametrize("flag, named", [
    ("--n_embd=48", "n_embd 32, not 48"),
    ("--dropout=0.2", "dropout 0.0, not 0.2"),
    ("--learning_rate=0.02", "learning_rate 0.01, not 0.02"),
    ("--dataset={shuffled}", "train.bin of the same size, other content"),
])
def test_a_base_run_kept_for_other_train_flags_is_refused_before_anything_runs(tmp_path, tiny_dataset, capsys, flag,
                                                                                named):
    out = tmp_path / "cb"
    kept = kept_base_run(out / "base", tiny_dataset)
    before = kept.read_bytes()
    flag = flag.format(shuffled=shuffled_copy(tiny_dataset, tmp_path / "shuffled"))
    code, _, stderr = critical_batch(capsys, "--quick", f"--out_dir={out}", f"--dataset={tiny_dataset}", flag,
                                     script=trains_nothing())
    assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr
    assert f"{kept} was trained with " in stderr and named in stderr and "another --work_dir" in stderr, stderr
    assert kept.read_bytes() == before and sorted(p.name for p in out.iterdir()) == ["base"]


@pytest.mark.parametrize("flag", [None, "--dataset={moved}", "--log_interval=5"])
def test_a_base_run_kept_for_the_same_flags_and_data_goes_on(tmp_path, tiny_dataset, capsys, flag):
    out = tmp_path / "cb"
    kept_base_run(out / "base", tiny_dataset)
    moved = shutil.copytree(tiny_dataset, tmp_path / "moved" / "renamed")  # the same data elsewhere
    with pytest.raises(AssertionError, match="it went on to train"):
        critical_batch(capsys, "--quick", f"--out_dir={out}", f"--dataset={tiny_dataset}",
                       *([flag.format(moved=moved)] if flag else []), script=trains_nothing())


@pytest.mark.parametrize("recorded, flags, named", [
    ("", ["--n_embd=48"], "n_embd (the script's), not 48"),
    (" n_embd 48", [], "n_embd 48, not (the script's)"),
    (" dropout 0.2", ["--dropout=0.1"], "dropout 0.2, not 0.1"),
])
def test_an_out_dir_of_other_train_flags_is_refused_before_its_base_runs_are_made(tmp_path, tiny_dataset, capsys,
                                                                                   recorded, flags, named):
    """Branches recorded with the base runs' part of their setting (a data fingerprint that fits no data here):
    a run with a new --work_dir, which would make the base runs first, stops before it does."""
    out = tmp_path / "cb"
    before = finished_out_dir(out, setting=f"{QUICK_SETTING} dataset_content 0123456789abcdef{recorded}")
    code, _, stderr = critical_batch(capsys, "--quick", f"--out_dir={out}", f"--work_dir={tmp_path / 'new'}",
                                     f"--dataset={tiny_dataset}", *flags, script=trains_nothing())
    assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr
    assert named in stderr and "dataset_content 0123456789abcdef, not " in stderr, stderr
    assert "another --out_dir and --work_dir" in stderr, stderr
    assert {name: (out / name).read_bytes() for name in before} == before
    assert list((tmp_path / "new").iterdir()) == []  # made and tried for writing, no base run begun


@pytest.mark.slow
@pytest.mark.parametrize("flag, kept_named, recorded_named", [
    ("--n_embd=48", "n_embd 32, not 48", "n_embd (the script's), not 48"),
    ("--dropout=0.2", "dropout 0.0, not 0.2", "dropout (the script's), not 0.2"),
    ("--dataset={shuffled}", "train.bin of the same size", "dataset_content "),
])
def test_the_quick_run_started_again_with_another_train_flag_is_refused_and_changes_nothing(
        bench_runs, tiny_dataset, tmp_path, capsys, flag, kept_named, recorded_named):
    out = tmp_path / "cb"
    shutil.copytree(bench_runs["critical_batch.py"][0], out)
    flag = flag.format(shuffled=shuffled_copy(tiny_dataset, tmp_path / "shuffled"))
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    # with the base runs it kept, and with a new --work_dir (the base runs would be made again first)
    for work_dir, named in ((out / "base", kept_named), (tmp_path / "new", recorded_named)):
        code, _, stderr = critical_batch(capsys, "--quick", f"--out_dir={out}", f"--work_dir={work_dir}",
                                         f"--dataset={tiny_dataset}", flag, script=trains_nothing())
        assert code == 2 and len(stderr.strip().splitlines()) == 1 and named in stderr, stderr
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert list((tmp_path / "new").iterdir()) == []
