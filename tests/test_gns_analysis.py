import csv
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn as nn

from nanogns.logread import load_log
from gns_fixtures import (ToyGPT, example_sqnorms, measure, mse, per_example_grads, regression_loss, train_step,
                         with_rmsnorms)
from nanogns.maths import WRITER, WRITER_KEY
from nanogns.estimators.exact import AccumulateMeasurements, MeasurementTracker
from nanogns.runlog import LogWrapper

from conftest import peak_rss, write_long_log  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "gns-analysis.py")
spec = importlib.util.spec_from_file_location("gns_analysis", SCRIPT)
gns_analysis = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gns_analysis)


def run_tool(*args, cwd=ROOT):
    return subprocess.run([sys.executable, SCRIPT, *map(str, args)], capture_output=True, text=True, cwd=cwd)


class LinearRegression(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, 1, bias=False)

    def forward(self, x):
        return self.fc(x).squeeze(-1)


def linear_regression_grads(model, loss, x, y):
    """Per-example gradients of 0.5 (w.x - y)^2 in closed form, (w.x - y) x (the vmap oracle is slow here)."""
    return {"fc.weight": ((model(x) - y)[:, None] * x)[:, None, :]}


def test_closed_form_per_example_gradients_match_vmap():
    model = LinearRegression(3)
    x, y = torch.randn(5, 3), torch.randn(5)
    assert torch.allclose(linear_regression_grads(model, regression_loss, x, y)["fc.weight"],
                          per_example_grads(model, regression_loss, x, y)["fc.weight"], atol=1e-6)


def log_training(out_dir, model, make_batch, steps, batch_sizes, update=None, per_example=per_example_grads):
    """The training-loop wiring: micro-steps, tracker.step, logging; returns the LogWrapper's out_dir."""
    logs = AccumulateMeasurements()
    tracker = MeasurementTracker.from_model(model, callback=logs)
    log = LogWrapper(out_dir=out_dir, config={"seed": 0, "batch_sizes": list(batch_sizes)})  # as train.py's: a seed
    tokens = 0
    for step in range(steps):
        B = batch_sizes[step % len(batch_sizes)]
        x, y = make_batch(B)
        train_step(model, [(x[:B // 2], y[:B // 2]), (x[B // 2:], y[B // 2:])], per_example=per_example)
        tracker.step(batch_size=B)
        if update is not None:
            update(model)
        model.zero_grad(set_to_none=True)
        tokens += B
        log.log({"iter_num": step, "tokens_processed": tokens, **logs.pop()})
        log.step()
    log.close()
    return out_dir


def test_gns_of_linear_regression_matches_closed_form(tmp_path):
    """
    Loss 0.5 (w.x - y)^2 with x ~ N(0, I_d), y = w*.x + sigma e, at fixed w = w* + u. The
    per-example gradient is g = (u.x - sigma e) x, so (Isserlis' theorem for the fourth moments)
        E[g] = u,   E|g|^2 = (d + 2)|u|^2 + d sigma^2,   tr(Cov g) = (d + 1)|u|^2 + d sigma^2.
    Through the whole pipeline (buffers -> tracker -> log.csv -> analysis) with a batch size that
    changes every step. With these settings the estimate's spread over seeds is about 0.7% (checked
    by simulation), so 3% is a loose bound that still rejects e.g. the biased |G_B|^2 (6% off).
    """
    d, sigma = 4, 0.5
    g = torch.Generator().manual_seed(0)
    u = torch.full((d,), 0.5)
    w_star = torch.randn(d, generator=g)
    model = measure(LinearRegression(d))
    with torch.no_grad():
        model.fc.weight.copy_((w_star + u)[None])

    def make_batch(B):
        x = torch.randn(B, d, generator=g)
        return x, x @ w_star + sigma * torch.randn(B, generator=g)

    log_training(tmp_path, model, make_batch, steps=1000, batch_sizes=(64, 128), per_example=linear_regression_grads)
    results, info = gns_analysis.analyze(load_log(tmp_path)[0], alpha=0.998)
    true_sq_norm = u.pow(2).sum().item()
    true_trace = (d + 1) * true_sq_norm + d * sigma ** 2
    last = results.iloc[-1]
    assert last["total/ema_steps"] == 1000 and set(results["batch_size"]) == {64, 128}
    assert last["total/gns"] == pytest.approx(true_trace / true_sq_norm, rel=0.03)
    assert last["total/trace_ema"] == pytest.approx(true_trace, rel=0.03)
    assert last["total/sq_norm_ema"] == pytest.approx(true_sq_norm, rel=0.03)
    assert list(info["groups"]) == ["total", "Linear"]


def test_cli_summary_without_layernorm(tmp_path, capsys):
    g = torch.Generator().manual_seed(0)
    model = measure(LinearRegression(3))
    log_training(tmp_path, model, lambda B: (torch.randn(B, 3, generator=g), torch.randn(B, generator=g)),
                 steps=5, batch_sizes=(4,), per_example=linear_regression_grads)
    assert gns_analysis.main([str(tmp_path), "--no-plots", "--alpha", "0"]) == 0
    out = capsys.readouterr().out
    assert "has seen 5 measured steps" in out and "no LayerNorm parameters" in out and "fc.weight" not in out
    assert "Linear" in out and (tmp_path / "gns_analysis.csv").exists()


def toy_gpt_log(out_dir, steps=16, rmsnorm=False):
    """A ToyGPT's log (rmsnorm: with RMSNorms, which have no bias, for its LayerNorms)."""
    torch.manual_seed(0)
    model = ToyGPT(n_layer=2)
    model = measure(with_rmsnorms(model) if rmsnorm else model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)

    def make_batch(B):
        ids = torch.randint(0, 11, (B, 5), generator=g)
        return ids, (ids % 3).float().mean(1)

    return log_training(out_dir, model, make_batch, steps, (8, 12), update=lambda m: opt.step())


def test_groups_partition_and_sums_come_before_the_estimators(tmp_path):
    df, _ = load_log(toy_gpt_log(tmp_path))
    results, info = gns_analysis.analyze(df, alpha=0.9)
    groups = info["groups"]
    assert list(groups)[:4] == ["total", "LayerNorm", "Linear", "Embedding"] and list(groups)[4:] == ["h.0", "h.1"]
    assert groups["Embedding"] == ["transformer.wte.weight"]
    assert "transformer.ln_f.weight" in groups["LayerNorm"] and "transformer.h.1.ln_1.bias" in groups["LayerNorm"]
    assert "head.weight" in groups["Linear"] and "transformer.h.0.mlp.c_fc.bias" in groups["Linear"]
    assert sorted(sum((groups[k] for k in ("LayerNorm", "Linear", "Embedding")), [])) == sorted(groups["total"])
    assert all(gns_analysis.block_of(n) == "h.1" for n in groups["h.1"]) and len(groups["h.1"]) == 6
    # the group estimate from the summed squared norms, computed here from the raw columns
    for group in ("total", "LayerNorm", "h.0"):
        big = sum(df[f"train/gns/{n}/norm"] ** 2 for n in groups[group])
        small = sum(df[f"train/gns/{n}/pegn"] ** 2 for n in groups[group])
        B = df[f"train/gns/{groups[group][0]}/batch_size"]
        assert np.allclose(results[f"{group}/sq_norm"], (B * big - small) / (B - 1), rtol=1e-12)
        assert np.allclose(results[f"{group}/trace"], (small - big) / (1 - 1 / B), rtol=1e-12)
        # GNS is the ratio of the two EMAs, each its own debiased EMA
        assert np.allclose(results[f"{group}/gns"], results[f"{group}/trace_ema"] / results[f"{group}/sq_norm_ema"])
    # the type groups add up to the total (the estimators are linear at fixed B)
    parts = sum(results[f"{k}/trace"] for k in ("LayerNorm", "Linear", "Embedding"))
    assert np.allclose(parts, results["total/trace"], rtol=1e-10)


def test_rmsnorm_gains_are_in_the_normalisation_group(tmp_path):
    """A model with RMSNorm (modules ln_1, ln_f as nanoGPT names them, a gain and no bias): its
    gains count in the normalisation group, still called LayerNorm for the reference's readers."""
    df, _ = load_log(toy_gpt_log(tmp_path, rmsnorm=True))
    results, info = gns_analysis.analyze(df, alpha=0.9)
    groups = info["groups"]
    assert list(groups)[:4] == ["total", "LayerNorm", "Linear", "Embedding"]
    assert groups["LayerNorm"] == [f"transformer.{n}.weight" for n in ("h.0.ln_1", "h.1.ln_1", "ln_f")]
    assert np.isfinite(results["LayerNorm/gns"]).any()
    parts = sum(results[f"{k}/trace"] for k in ("LayerNorm", "Linear", "Embedding"))
    assert np.allclose(parts, results["total/trace"], rtol=1e-10)


def test_debiased_ema_against_its_definition():
    x = np.array([np.nan, 2.0, 4.0, np.nan, -1.0, 3.0, np.inf])
    alpha = 0.7
    got, seen = gns_analysis.debiased_ema(x, alpha)
    ema, n, expected = 0.0, 0, []
    for v in x:
        if np.isfinite(v):
            ema, n = alpha * ema + (1 - alpha) * v, n + 1
        expected.append(ema / (1 - alpha ** n) if n else np.nan)
    assert np.allclose(got, expected, equal_nan=True) and seen.tolist() == [0, 1, 2, 2, 3, 4, 4]
    assert got[1] == 2.0, "the first measurement is not dragged towards zero"
    no_smoothing, _ = gns_analysis.debiased_ema(x, 0.0)
    assert np.allclose(no_smoothing, [np.nan, 2, 4, 4, -1, 3, 3], equal_nan=True)


def test_unbiased_estimates_on_exact_sample_moments():
    rng = np.random.default_rng(0)
    for B in (2, 3, 17):
        g = rng.standard_normal((B, 5)) + 0.3
        big, small = (g.mean(0) ** 2).sum(), (g ** 2).sum(1).mean()
        sq_norm, trace = gns_analysis.unbiased_estimates(big, small, B)
        assert trace == pytest.approx(g.var(0, ddof=1).sum())
        assert sq_norm == pytest.approx((g.mean(0) ** 2).sum() - g.var(0, ddof=1).sum() / B)
    assert np.isnan(gns_analysis.unbiased_estimates(1.0, 1.0, 1)[0])


def test_cli_on_a_killed_run_with_plots_and_ddp_column(tmp_path):
    toy_gpt_log(tmp_path, steps=12)
    with open(tmp_path / "log.csv") as f:
        lines = f.read().splitlines(keepends=True)
    cut = lines[-1][: len(lines[-1]) // 2]  # the last step's row, cut short by a kill
    df = pd.read_csv(tmp_path / "log.csv")
    df.insert(3, "ddp/gns", np.linspace(1, 2, len(df)))
    df.to_csv(tmp_path / "log.csv", index=False)
    with open(tmp_path / "log.csv") as f:
        whole = f.read().splitlines(keepends=True)
    with open(tmp_path / "log.csv", "w") as f:
        f.writelines(whole[:-1])
        f.write(cut)
    r = run_tool(tmp_path, "--alpha", "0.5")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    assert "has seen 11 measured steps" in r.stdout and "ddp/gns" in r.stdout and "LayerNorm vs total GNS" in r.stdout
    assert "⠀" in r.stdout, "braille plots"
    out = pd.read_csv(tmp_path / "gns_analysis.csv")
    assert len(out) == 11 and {"total/gns", "LayerNorm/gns", "h.1/trace_ema", "Embedding/ema_steps"} <= set(out.columns)
    r = run_tool(tmp_path, "--no-plots")
    assert r.returncode == 0 and "⠀" not in r.stdout and len(r.stdout.splitlines()) < 25


def test_help_states_the_defaults():
    r = run_tool("--help")
    assert r.returncode == 0 and "default: 0.99" in r.stdout and "default: train/gns" in r.stdout


BAD_INPUTS = [
    (None, [], "no such directory"),
    ("", [], "empty"),
    ("step,a\n0,1,2,3\n1,2\n", [], "malformed"),
    ("step,iter_num,train/loss\n0,0,1.5\n", [], "no GNS columns"),
    ("step,train/gns/w/norm,train/gns/w/pegn,train/gns/w/batch_size\n0,,,\n", [], "hold no numbers"),
    ("step,a\n0,1\n", ["--alpha", "1"], "outside [0, 1)"),
    ("step,a\n0,1\n", ["--alpha", "x"], "not a number"),
    ("step,a\n0,1\n", ["--bogus"], "unrecognized arguments"),
    ("step,a\n0,1\n", ["--tied", "maybe"], "invalid choice: 'maybe'"),
    ("\udcff\udcfebinary\n", [], "not a text CSV"),
]


def test_bad_inputs_one_line_and_nonzero_exit(tmp_path):
    children = []
    for i, (content, args, message) in enumerate(BAD_INPUTS):  # all at once: interpreter start-up dominates
        out = tmp_path / f"out{i}"
        if content is not None:
            out.mkdir()
            (out / "log.csv").write_text(content, errors="surrogateescape")
        children.append(subprocess.Popen([sys.executable, SCRIPT, str(out), *args], cwd=ROOT, text=True,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    for child, (_, _, message) in zip(children, BAD_INPUTS):
        stdout, stderr = child.communicate()
        assert child.returncode == 2 and "Traceback" not in stderr, (message, stderr)
        assert message in stderr and len(stderr.strip().splitlines()) == 1, (message, stderr)


# -- several estimators in one log ----------------------------------------------------------------

def hand_ema(x, alpha):
    """The debiased EMA of the module docstring, step by step, over the finite entries."""
    ema, n, out = 0.0, 0, []
    for v in x:
        if np.isfinite(v):
            ema, n = alpha * ema + (1 - alpha) * v, n + 1
        out.append(ema / (1 - alpha ** n) if n else np.nan)
    return np.array(out)


def test_small_batch_estimator_against_hand_computation():
    """b > 1 (micro-batch GNS): sums over parameters first, B == b rows and mixed-b rows skipped."""
    rng = np.random.default_rng(0)
    n = 9
    B = np.array([64, 64, 8, 32, 64, 16, 64, 64, 32], dtype=float)  # row 2: B == b, nothing to estimate
    b = np.full(n, 8.0)
    b_other = b.copy()
    b_other[5] = 4  # row 5: the two parameters disagree on b, left out
    cols = {"step": np.arange(n)}
    norms = {}
    for name, small in (("fc.weight", b), ("fc.bias", b_other)):
        big_norm, small_norm = rng.uniform(0.5, 1, n), rng.uniform(1, 3, n)
        norms[name] = big_norm, small_norm
        cols.update({f"train/microbatch_gns/{name}/norm": big_norm, f"train/microbatch_gns/{name}/pegn": small_norm,
                     f"train/microbatch_gns/{name}/batch_size": B, f"train/microbatch_gns/{name}/small_batch_size": small})
    results, info = gns_analysis.analyze(pd.DataFrame(cols), alpha=0.6, prefix="train/microbatch_gns")
    assert info["main"] == "train/microbatch_gns" and info["note"] is None and info["mixed_batch_rows"] == 1

    big = sum(v[0] ** 2 for v in norms.values())
    small = sum(v[1] ** 2 for v in norms.values())
    want_sq, want_tr = [], []
    for i in range(n):
        if B[i] == b[i] or i == 5:
            want_sq.append(np.nan), want_tr.append(np.nan)
        else:  # E|G_n|^2 = |G|^2 + tr(S)/n at n = b and n = B, solved by hand
            tr = (small[i] - big[i]) / (1 / b[i] - 1 / B[i])
            want_tr.append(tr), want_sq.append(big[i] - tr / B[i])
    assert np.allclose(results["total/sq_norm"], want_sq, equal_nan=True, rtol=1e-12)
    assert np.allclose(results["total/trace"], want_tr, equal_nan=True, rtol=1e-12)
    assert np.allclose(results["total/gns"], hand_ema(want_tr, 0.6) / hand_ema(want_sq, 0.6), rtol=1e-12)
    assert results["total/ema_steps"].tolist() == [1, 2, 2, 3, 4, 4, 5, 6, 7]
    # one parameter alone: its own b everywhere, so row 5 counts for fc.bias (b = 4, B = 16)
    assert np.isfinite(results["Linear/trace"]).sum() == 7
    sq, tr = gns_analysis.unbiased_estimates(norms["fc.bias"][0][5] ** 2, norms["fc.bias"][1][5] ** 2, 16, 4)
    assert tr == pytest.approx((norms["fc.bias"][1][5] ** 2 - norms["fc.bias"][0][5] ** 2) / (1 / 4 - 1 / 16))
    assert np.isnan(gns_analysis.unbiased_estimates(1.0, 2.0, 8, 8)[0])


def ddp_columns(rng, n):
    """Noisy norms around E|G_n|^2 = |G|^2 + tr(S)/n with |G|^2 = 1, tr(S) = 30, W = 2 then 4 ranks of 12."""
    W = np.where(np.arange(n) < n // 2, 2, 4)
    return {"ddp/big_batch_norm": np.sqrt(1 + 30 / (12 * W) * rng.uniform(0.8, 1.2, n)),
            "ddp/small_batch_norm": np.sqrt(1 + 30 / 12 * rng.uniform(0.8, 1.2, n)),
            "ddp/big_batch_size": 12 * W, "ddp/small_batch_size": np.full(n, 12),
            "ddp/gtg": np.full(n, -7.0), "ddp/trsigma": np.full(n, -7.0), "ddp/gns": np.full(n, -7.0)}


def test_ddp_estimator_recomputed_offline():
    rng = np.random.default_rng(1)
    n = 8
    ddp = ddp_columns(rng, n)
    ddp["ddp/small_batch_norm"][3] = np.nan  # a step without the DDP measurement
    df = pd.DataFrame({"step": np.arange(n), "train/gns/w/norm": rng.uniform(0.5, 1, n),
                       "train/gns/w/pegn": rng.uniform(2, 3, n), "train/gns/w/batch_size": np.full(n, 24), **ddp})
    results, info = gns_analysis.analyze(df, alpha=0.7)
    assert info["main"] == "train/gns" and list(info["estimators"]) == ["ddp"]
    big, small = ddp["ddp/big_batch_norm"] ** 2, ddp["ddp/small_batch_norm"] ** 2
    B, b = ddp["ddp/big_batch_size"], 12
    sq = (B * big - b * small) / (B - b)  # McCandlish App. A, small batch = one rank's 12 examples
    tr = (small - big) / (1 / b - 1 / B)
    assert np.allclose(results["ddp/total/sq_norm"], sq, equal_nan=True, rtol=1e-12)
    assert np.allclose(results["ddp/total/trace"], tr, equal_nan=True, rtol=1e-12)
    assert np.allclose(results["ddp/total/gns"], hand_ema(tr, 0.7) / hand_ema(sq, 0.7), rtol=1e-12)
    assert results["ddp/total/ema_steps"].iloc[-1] == 7 and (results["ddp/total/gns"] > 0).all()
    assert results["ddp/batch_size"].tolist()[-1] == 48 and results["ddp/small_batch_size"].tolist()[0] == 12
    # the DDP estimator as the main one: one group, the totals over the whole model
    main_ddp, info = gns_analysis.analyze(df, alpha=0.7, prefix="ddp")
    assert list(info["groups"]) == ["total"] and list(info["estimators"]) == ["train/gns"]
    assert np.allclose(main_ddp["total/gns"], results["ddp/total/gns"], rtol=1e-12)
    text = gns_analysis.summary(main_ddp, info, "log.csv", 0.7)
    assert "totals over the whole model" in text and "ddp (main)" in text


def test_missing_main_estimator_falls_back_with_a_note(tmp_path, capsys):
    rng = np.random.default_rng(2)
    n = 6
    df = pd.DataFrame({"step": np.arange(n), "train/sogns/fc.weight/norm": rng.uniform(0.5, 1, n),
                       "train/sogns/fc.weight/pegn": rng.uniform(2, 3, n), "train/sogns/fc.weight/batch_size": 8,
                       **ddp_columns(rng, n)})
    df.to_csv(tmp_path / "log.csv", index=False)
    assert gns_analysis.main([str(tmp_path), "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert "note: no GNS columns 'train/gns/<parameter>/norm" in out and "showing 'train/sogns' instead" in out
    assert "train/sogns (main)" in out and "\n  ddp " in out
    _, info = gns_analysis.analyze(df, 0.9, prefix="train/gnshooks")
    assert info["main"] == "train/sogns" and "train/gnshooks" in info["note"]
    # exact norms of the LayerNorm only beside the Linear hooks (nothing to compare parameter by parameter)
    df = df.assign(**{"train/gns/ln_1.weight/norm": 1.0, "train/gns/ln_1.weight/pegn": 3.0, "train/gns/ln_1.weight/batch_size": 8})
    results, info = gns_analysis.analyze(df, 0.9)
    assert info["main"] == "train/gns" and info["note"] is None and info["estimators"]["train/sogns"]["common"] is None
    assert "train/sogns/common/gns" not in results
    assert "(no parameter in common)" in gns_analysis.summary(results, info, "log.csv", 0.9)


class LinearLayerNormNet(nn.Module):
    """Linear -> LayerNorm -> Linear on [B, T, K] inputs (T > 1, so SOGNS differs from exact)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.ln_1, self.fc2 = nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 1)

    def forward(self, x):
        return self.fc2(torch.tanh(self.ln_1(self.fc1(x)))).mean((1, 2))


def multi_estimator_log(out_dir, steps=30, m=4, b=4, ranks=2, lr=0.2):
    """
    A log from the real estimators on one model: gnshooks (exact and SOGNS Linear hooks) and
    microbatch_gns during nanoGPT's micro-step loop, the exact per-example train/gns columns
    from vmap, and the DDP columns of `ranks` simulated ranks (each rank's gradient the mean over
    its share of the batch) through ddpgns' own logging. Returns the per-step brute-force numbers.
    """
    from nanogns.estimators.ddp import GradientNoiseScale, ddp_gns_log
    from nanogns.estimators.hooks import add_exact_hooks, add_hooks_to_model, add_sogns_hooks, hook_measurements, zero_hook_results
    from nanogns.estimators.microbatch import MicrobatchGNS

    torch.manual_seed(0)
    model, oracle = LinearLayerNormNet(), LinearLayerNormNet()  # the oracle: no hooks inside vmap
    add_hooks_to_model(model, add_exact_hooks)
    add_hooks_to_model(model, add_sogns_hooks)
    mb = MicrobatchGNS(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    ddp_gns = GradientNoiseScale(beta=0.9)
    log = LogWrapper(out_dir=out_dir, config={})
    g = torch.Generator().manual_seed(3)
    B = m * b
    target = torch.randn(4, generator=g)
    brute = []
    for step in range(steps):
        x = torch.randn(B, 3, 4, generator=g)
        y = torch.tanh(x @ target).mean(1) + 0.3 * torch.randn(B, generator=g)
        for k in range(m):
            (mse(model(x[k * b:(k + 1) * b]), y[k * b:(k + 1) * b]) / m).backward()
        oracle.load_state_dict(model.state_dict())
        per_example = per_example_grads(oracle, regression_loss, x, y)
        sq = example_sqnorms(per_example)
        row = {"iter_num": step, "tokens_processed": (step + 1) * B * 3}
        for name, ge in per_example.items():
            assert torch.allclose(ge.mean(0), dict(model.named_parameters())[name].grad, atol=1e-6)
            row[f"train/gns/{name}/norm"] = ge.mean(0).norm().item()
            row[f"train/gns/{name}/pegn"] = sq[name].mean().sqrt().item()
            row[f"train/gns/{name}/batch_size"] = B
        flat = torch.cat([ge.flatten(1) for ge in per_example.values()], 1).double()  # [B, all parameters]
        sq_big = flat.mean(0).square().sum().item()
        sq_micro = flat.reshape(m, b, -1).mean(1).square().sum(1).mean().item()
        sq_rank = flat.reshape(ranks, B // ranks, -1).mean(1).square().sum(1).mean().item()
        ddp_gns.update(sq_rank, sq_big, B // ranks, B)
        row.update(ddp_gns_log(ddp_gns, sq_rank, sq_big, B // ranks, B))
        row.update(hook_measurements(model, "exact"))
        row.update(hook_measurements(model, "sogns"))
        row.update(mb.measurements(micro_batch_size=b))
        brute.append(dict(sq_big=sq_big, sq_micro=sq_micro, sq_rank=sq_rank))
        opt.step()
        opt.zero_grad(set_to_none=True)
        zero_hook_results(model)
        mb.zero()
        log.log(row)
        log.step()
    log.close()
    return pd.DataFrame(brute), B


def test_comparison_of_every_estimator_in_a_real_log(tmp_path, capsys):
    brute, B = multi_estimator_log(tmp_path)
    df, _ = load_log(tmp_path)
    alpha = 0.9
    results, info = gns_analysis.analyze(df, alpha)
    others = info["estimators"]
    assert info["main"] == "train/gns" and list(others) == ["train/hooks_gns", "train/sogns", "train/microbatch_gns", "ddp"]
    assert len(info["groups"]["total"]) == 6 and others["train/hooks_gns"]["params"] == 4

    # the exact Linear hooks match the exact per-example norms on the parameters both cover
    linear = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert others["train/hooks_gns"]["common"] == linear and others["train/microbatch_gns"]["common"] is None
    assert np.allclose(results["train/hooks_gns/common/gns"], results["train/hooks_gns/main_common/gns"], rtol=1e-4)
    assert np.allclose(results["train/hooks_gns/total/gns"], results["Linear/gns"], rtol=1e-4)
    same = others["train/hooks_gns"]["common_comparison"]
    assert same["ratio_median"] == pytest.approx(1, abs=1e-4) and same["pearson"] == pytest.approx(1, abs=1e-6)
    assert same["steps"] == 30 - 9, "compared after the EMA warm-up of 1/(1 - alpha) = 10 estimates"
    total_vs_linear = others["train/hooks_gns"]["comparison"]["ratio_median"]
    assert abs(total_vs_linear - 1) > 1e-3, "the hooks miss the LayerNorm: not the total GNS"

    # micro-batch (b = 4) and DDP (b = one rank's 8) against the brute-force totals over all parameters
    for p, small_sq, b in (("train/microbatch_gns", brute["sq_micro"], 4), ("ddp", brute["sq_rank"], B // 2)):
        sq, tr = (B * brute["sq_big"] - b * small_sq) / (B - b), (small_sq - brute["sq_big"]) / (1 / b - 1 / B)
        assert np.allclose(results[f"{p}/total/sq_norm"], sq, rtol=1e-4, atol=1e-7)
        assert np.allclose(results[f"{p}/total/trace"], tr, rtol=1e-4)
        assert (results[f"{p}/small_batch_size"] == b).all() and (results[f"{p}/batch_size"] == B).all()
    # every approximation is in the same range as the exact GNS and moves with it
    for p, o in others.items():
        c = o["comparison"]
        assert 0.5 < c["ratio_median"] < 2 and 0.5 < c["pearson"] <= 1 and c["steps"] == 21, (p, c)
        assert (results[f"{p}/total/gns"] > 0).all() and (results[f"{p}/total/trace_ema"] > 0).all()
    assert others["train/sogns"]["comparison"]["ratio_median"] != pytest.approx(total_vs_linear, rel=1e-3)

    assert gns_analysis.main([str(tmp_path), "--alpha", str(alpha)]) == 0
    out = capsys.readouterr().out
    table = out[out.index("every estimator in the log"):]
    for p in ("train/gns (main)", "train/hooks_gns", "train/sogns", "train/microbatch_gns", "\n  ddp "):
        assert p in table
    assert "on the 4 shared params: ratio 1.000, r 1.000" in table
    assert "train/microbatch_gns total" in out and "ddp total" in out, "every estimator in the GNS plot"
    written = pd.read_csv(tmp_path / "gns_analysis.csv")
    assert len(written) == 30 and {"total/gns", "ddp/total/gns", "train/sogns/total/trace_ema",
                                   "train/hooks_gns/main_common/gns", "ddp/small_batch_size"} <= set(written.columns)


def test_micro_batch_estimator_recovers_the_true_gns_of_linear_regression():
    """
    The linear regression of test_gns_of_linear_regression_matches_closed_form (true |G|^2 = |u|^2,
    tr(S) = (d + 1)|u|^2 + d sigma^2), simulated directly: per step B = 64 per-example gradients,
    the 8 micro-batch means of b = 8 and the full mean. Over seeds the micro-batch estimate's spread
    is 0.8% (checked by simulation), so 3% is 4 sigma; reading the small batch as b = 1 would be off
    8x in tr(S), and the biased |G_B|^2 for |G|^2 off by 9%.
    """
    d, sigma, B, b, steps = 4, 0.5, 64, 8, 3000
    rng = np.random.default_rng(0)
    u = np.full(d, 0.5)
    x = rng.standard_normal((steps, B, d))
    per_example = ((x @ u) - sigma * rng.standard_normal((steps, B)))[..., None] * x  # (u.x - sigma e) x
    micro = per_example.reshape(steps, B // b, b, d).mean(2)
    cols = {"step": np.arange(steps)}
    for prefix, small_norm, small_b in (("train/gns", np.sqrt((per_example ** 2).sum(-1).mean(1)), 1),
                                        ("train/microbatch_gns", np.sqrt((micro ** 2).sum(-1).mean(1)), b)):
        cols.update({f"{prefix}/fc.weight/norm": np.linalg.norm(per_example.mean(1), axis=-1),
                     f"{prefix}/fc.weight/pegn": small_norm, f"{prefix}/fc.weight/batch_size": B})
        if small_b > 1:
            cols[f"{prefix}/fc.weight/small_batch_size"] = small_b
    results, info = gns_analysis.analyze(pd.DataFrame(cols), alpha=0.999)
    true_sq_norm = u @ u
    true_trace = (d + 1) * true_sq_norm + d * sigma ** 2
    last = results.iloc[-1]
    assert last["train/microbatch_gns/total/ema_steps"] == steps
    assert last["train/microbatch_gns/total/gns"] == pytest.approx(true_trace / true_sq_norm, rel=0.03)
    assert last["train/microbatch_gns/total/trace_ema"] == pytest.approx(true_trace, rel=0.03)
    assert last["train/microbatch_gns/total/sq_norm_ema"] == pytest.approx(true_sq_norm, rel=0.03)
    assert info["estimators"]["train/microbatch_gns"]["comparison"]["ratio_median"] == pytest.approx(1, abs=0.03)


# -- edge cases: incomplete and partly measured rows, fallbacks, warm-up of comparisons, the CLI -----------

def gns_cols(prefix, name, norm, pegn, B, b=None):
    """The raw columns of one parameter of a per-parameter estimator."""
    cols = {f"{prefix}/{name}/norm": norm, f"{prefix}/{name}/pegn": pegn, f"{prefix}/{name}/batch_size": B}
    if b is not None:
        cols[f"{prefix}/{name}/small_batch_size"] = b
    return cols


def test_unbiased_estimates_nan_for_small_batch_below_one():
    assert np.isnan(gns_analysis.unbiased_estimates(1.0, 2.0, 8, 0)).all()
    assert np.isnan(gns_analysis.unbiased_estimates(1.0, 2.0, 8, -4)).all()


def test_incomplete_parameter_is_left_out_and_reported():
    n = 5
    df = pd.DataFrame({"step": np.arange(n), **gns_cols("train/gns", "a", np.full(n, 1.0), np.full(n, 2.0), 8),
                       "train/gns/b/norm": np.full(n, 1.0)})
    results, info = gns_analysis.analyze(df, 0.9)
    assert info["main"] == "train/gns" and info["note"] is None
    assert info["incomplete"] == ["b"] and info["groups"]["total"] == ["a"]
    assert "incomplete columns, left out: b (1)" in gns_analysis.summary(results, info, "log.csv", 0.9)


def test_fallback_main_follows_the_known_order_and_prefix_may_end_in_slash():
    rng = np.random.default_rng(3)
    n = 5
    df = pd.DataFrame({"step": np.arange(n),  # micro-batch columns first in the log
                       **gns_cols("train/microbatch_gns", "w", rng.uniform(0.5, 1, n), rng.uniform(2, 3, n), 32, 4),
                       **gns_cols("train/sogns", "w", rng.uniform(0.5, 1, n), rng.uniform(2, 3, n), 32)})
    _, info = gns_analysis.analyze(df, 0.9)
    assert info["main"] == "train/sogns" and list(info["estimators"]) == ["train/microbatch_gns"]
    _, info = gns_analysis.analyze(df, 0.9, prefix="train/microbatch_gns/")
    assert info["main"] == "train/microbatch_gns" and info["note"] is None


def test_rows_with_partly_or_not_measured_parameters():
    """Row 2: the Linear parameter unmeasured; row 3: its batch_size cell empty; row 4: no GNS at all."""
    n = 6
    ln, fc = "transformer.h.0.ln_1.weight", "transformer.h.0.mlp.c_fc.weight"
    fc_norm, fc_B = np.full(n, 1.0), np.full(n, 8.0)
    fc_norm[[2, 4]], fc_B[[2, 3, 4]] = np.nan, np.nan
    ln_norm = np.full(n, 0.5)
    ln_norm[4] = np.nan
    df = pd.DataFrame({"step": np.arange(n), **gns_cols("train/gns", ln, ln_norm, np.full(n, 1.5), np.full(n, 8.0)),
                       **gns_cols("train/gns", fc, fc_norm, np.full(n, 2.0), fc_B)})
    results, info = gns_analysis.analyze(df, 0.9)
    assert results["step"].tolist() == [0, 1, 2, 3, 5], "rows without any measurement dropped, partial ones kept"
    assert info["main_rows"] == 5 and info["mixed_batch_rows"] == 0
    assert np.isfinite(results["LayerNorm/sq_norm"]).all()
    assert np.isnan(results["total/sq_norm"][[2, 3]]).all() and np.isnan(results["batch_size"][[2, 3]]).all()
    assert results["total/ema_steps"].tolist() == [1, 2, 2, 2, 3]


def test_layer_types_and_block_order():
    assert gns_analysis.layer_type("transformer.wpe.weight") == "Embedding"
    names = ["transformer.h.10.mlp.c_fc.weight", "transformer.h.2.mlp.c_fc.weight", "transformer.h.1.ln_1.weight"]
    assert list(gns_analysis.main_groups(names, "train/gns"))[-3:] == ["h.1", "h.2", "h.10"]


def test_each_expert_is_a_group_of_its_weights_and_an_expert_few_examples_reach_is_named():
    """A mixture of experts' columns: <experts>.<weight>[e] per expert and <experts>[e]/reached. The experts
    kind groups them all; --experts adds a group per expert (its weights' sums before the estimators);
    an expert fewer than FEW_REACHED examples reach per step on average is named as noisy."""
    rng = np.random.default_rng(0)
    n, B = 6, 16
    experts = "transformer.h.0.mlp.experts"
    cols = {"step": np.arange(n)}
    for e in range(2):
        for w in ("c_fc", "c_proj"):
            cols.update(gns_cols("train/gns", f"{experts}.{w}[{e}]", rng.uniform(0.5, 1, n), rng.uniform(2, 3, n), B))
    cols.update(gns_cols("train/gns", "transformer.h.0.mlp.router.weight", rng.uniform(0.5, 1, n), rng.uniform(2, 3, n), B))
    cols[f"train/gns/{experts}[0]/reached"] = np.full(n, 16)
    cols[f"train/gns/{experts}[1]/reached"] = np.array([2, 3, 4, 2, 3, 4])
    df = pd.DataFrame(cols)
    results, info = gns_analysis.analyze(df, 0.9, experts=True)
    assert info["type_groups"] == ["experts", "router"] and len(info["groups"]["experts"]) == 4
    assert info["experts"]["groups"][f"{experts}[1]"] == [f"{experts}.c_fc[1]", f"{experts}.c_proj[1]"]
    big = sum(df[f"train/gns/{experts}.{w}[1]/norm"] ** 2 for w in ("c_fc", "c_proj"))
    small = sum(df[f"train/gns/{experts}.{w}[1]/pegn"] ** 2 for w in ("c_fc", "c_proj"))
    sq_norm, trace = gns_analysis.unbiased_estimates(big, small, B)
    np.testing.assert_allclose(results[f"{experts}[1]/sq_norm"], sq_norm)
    np.testing.assert_allclose(results[f"{experts}[1]/trace"], trace)
    assert results[f"{experts}[1]/reached"].tolist() == [2, 3, 4, 2, 3, 4]
    text = gns_analysis.summary(results, info, "log.csv", 0.9)
    assert f"experts: 2 in 1 layer; examples that reached an expert per step, on average: 3 ({experts}[1]) to 16" in text
    assert f"note: 1 expert was reached by fewer than 8 examples a step on average, so its GNS is noisy: {experts}[1]" in text
    assert re.search(rf"^  {re.escape(experts)}\[0\] +\S+ +\S+ +\S+ +16$", text, re.M)
    results, info = gns_analysis.analyze(df, 0.9)  # without --experts: the note, no per-expert groups
    assert f"{experts}[0]/gns" not in results and "its GNS is noisy" in gns_analysis.summary(results, info, "log.csv", 0.9)


def test_experts_written_as_linears_are_grouped_by_their_index_where_the_kinds_say_experts():
    names = ["moe.experts.0.w1.weight", "moe.experts.0.w2.weight", "moe.experts.1.w1.weight", "blocks.0.fc.weight",
             "moe.gate.weight"]
    kinds = {n: "experts" for n in names[:3]}
    assert gns_analysis.expert_groups(names, kinds) == {"moe.experts[0]": names[:2], "moe.experts[1]": names[2:3]}
    assert gns_analysis.expert_groups(names) == {}  # without the record, a list is not taken for experts


def test_compare_ratio_median_pearson_and_short_runs():
    a, d = [2.0, 3.0, 12.0, 5.0], [1.0, 1.0, 2.0, 0.0]  # the last step: denominator GNS 0, left out
    c = gns_analysis.compare(a, d, [1, 2, 3, 4], alpha=0.9)  # shorter than the window of 10
    assert c["steps"] == 3 and c["min_ema_steps"] == 1
    assert c["ratio_median"] == 3.0 and c["ratio_mean"] == pytest.approx(11 / 3)
    assert c["pearson"] == pytest.approx(np.corrcoef(a[:3], d[:3])[0, 1])


def test_comparisons_start_when_both_emas_are_warm():
    """LayerNorm measured from row 0, the Linear parameter (so the total) from row 10, train/sogns from row 15."""
    rng = np.random.default_rng(4)
    n, late = 30, np.arange(30) < 10
    fc_norm = np.where(late, np.nan, rng.uniform(0.5, 1, n))
    df = pd.DataFrame({"step": np.arange(n),
                       **gns_cols("train/gns", "ln_1.weight", rng.uniform(0.5, 1, n), rng.uniform(2, 3, n), 16),
                       **gns_cols("train/gns", "fc.weight", fc_norm, rng.uniform(2, 3, n), 16),
                       **gns_cols("train/sogns", "fc.weight", np.where(np.arange(n) < 15, np.nan, rng.uniform(0.5, 1, n)),
                                  rng.uniform(2, 3, n), 16)})
    results, info = gns_analysis.analyze(df, 0.9)
    ln = info["comparison"]
    assert ln["steps"] == 11 and ln["min_ema_steps"] == 10  # total's EMA has 10 estimates from row 19
    want = (results["LayerNorm/gns"] / results["total/gns"])[-11:]
    assert ln["ratio_median"] == pytest.approx(np.median(want)) and ln["ratio_mean"] == pytest.approx(np.mean(want))
    assert info["estimators"]["train/sogns"]["comparison"]["steps"] == 6  # sogns' EMA has 10 from row 24


def test_other_estimator_covering_more_parameters_is_compared_on_the_shared_ones():
    rng = np.random.default_rng(5)
    n = 12
    df = pd.DataFrame({"step": np.arange(n),
                       **gns_cols("train/gns", "fc.weight", rng.uniform(0.5, 1, n), rng.uniform(2, 3, n), 16),
                       **gns_cols("train/sogns", "fc.weight", rng.uniform(0.5, 1, n), rng.uniform(2, 3, n), 16),
                       **gns_cols("train/sogns", "fc.bias", rng.uniform(0.5, 1, n), rng.uniform(2, 3, n), 16)})
    results, info = gns_analysis.analyze(df, 0.9)
    assert info["estimators"]["train/sogns"]["common"] == ["fc.weight"]
    # the main estimator's side is the main estimator's own numbers; the other side the other's
    assert np.allclose(results["train/sogns/main_common/gns"], results["total/gns"], rtol=1e-12)
    big, small = df["train/sogns/fc.weight/norm"] ** 2, df["train/sogns/fc.weight/pegn"] ** 2
    sq, tr = (16 * big - small) / 15, (small - big) / (1 - 1 / 16)
    assert np.allclose(results["train/sogns/common/gns"], hand_ema(tr, 0.9) / hand_ema(sq, 0.9), rtol=1e-12)


def test_summary_reports_mixed_batch_rows():
    n = 3
    df = pd.DataFrame({"step": np.arange(n), **gns_cols("train/gns", "a", np.full(n, 1.0), np.full(n, 2.0), 8),
                       **gns_cols("train/gns", "b", np.full(n, 1.0), np.full(n, 2.0), [8, 16, 8])})
    results, info = gns_analysis.analyze(df, 0.9)
    assert info["mixed_batch_rows"] == 1
    assert "1 steps with different batch sizes across parameters were left out" in \
        gns_analysis.summary(results, info, "log.csv", 0.9)


def test_cli_cannot_write_the_result(tmp_path, capsys):
    n = 3
    pd.DataFrame({"step": np.arange(n), **gns_cols("train/gns", "a", np.full(n, 1.0), np.full(n, 2.0), 8)}
                 ).to_csv(tmp_path / "log.csv", index=False)
    (tmp_path / "gns_analysis.csv").mkdir()  # writing it fails even as root
    assert gns_analysis.main([str(tmp_path), "--no-plots"]) == 1
    assert "cannot write" in capsys.readouterr().err


# -- the reference implementation's logs and output columns -------------------------------------------

REFERENCE_PARAMS = ["transformer.wte.weight", "transformer.wpe.weight", "transformer.h.0.ln_1.weight",
                    "transformer.h.0.attn.c_attn.weight", "transformer.ln_f.weight"]


def reference_run(out_dir, steps=12, config=None, finish=True, ddp=False):
    """
    A log written the way the reference implementation's tracker writes one: config.json (its
    settings, never a 'seed'), the header and the rows in log_header.csv.tmp and log_data.csv.tmp
    while it runs, joined into log.csv at the end; keys in order of first appearance, a row per
    step, evaluation losses as 'tensor(...)' (an old bug) every 5th step. Its tied weight
    transformer.wte.weight has the whole gradient's norm but only the embedding's per-example
    norm, far too small a pegn. Returns the per-step numbers {name: (norm, pegn)} and B.
    """
    rng = np.random.default_rng(7)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config if config is not None else {"batch_size": 8, "dtype": "bfloat16"}, f, indent=2)
    keys, rows, norms = [], [], []
    B = 16
    for step in range(steps):
        row = {}
        if step % 5 == 0:
            row.update({"train/loss": f"tensor({4 - 0.1 * step:.4f})", "val/loss": f"tensor({4.1 - 0.1 * step:.4f})"})
        row.update({"dt": 0.1, "lr": 1e-3, "train/lossf": 4 - 0.1 * step})
        if ddp:
            row.update({"ddp/big_batch_norm": 1.0, "ddp/small_batch_norm": 2.0, "ddp/big_batch_size": B,
                        "ddp/small_batch_size": B // 2, "ddp/gtg": 0.5, "ddp/trsigma": 9.0, "ddp/gns": 18.0})
        step_norms = {}
        for name in REFERENCE_PARAMS:
            norm = rng.uniform(0.5, 1)
            pegn = rng.uniform(0.6, 0.9) if "wte" in name else rng.uniform(2, 4)
            step_norms[name] = (norm, pegn)
            row.update({f"train/gns/{name}/norm": norm, f"train/gns/{name}/pegn": pegn, f"train/gns/{name}/batch_size": B})
        row.update({"iter_num": step, "tokens_processed": (step + 1) * B * 64})
        norms.append(step_norms)
        keys += [k for k in row if k not in keys]
        rows.append([step] + [row.get(k, "") for k in keys])
    with open(os.path.join(out_dir, "log_header.csv.tmp"), "w", newline="") as f:
        csv.writer(f).writerow(["step"] + keys)
    with open(os.path.join(out_dir, "log_data.csv.tmp"), "w", newline="") as f:
        csv.writer(f).writerows(rows)
    if finish:
        with open(os.path.join(out_dir, "log.csv"), "w") as f:
            for name in ("log_header.csv.tmp", "log_data.csv.tmp"):
                with open(os.path.join(out_dir, name)) as part:
                    f.write(part.read())
                os.remove(os.path.join(out_dir, name))
    return norms, B


def reference_estimates(norms, B, params):
    """The per-step sums and estimates as the reference's analysis defines them (B_small = 1)."""
    sgn = np.array([sum(n[p][0] ** 2 for p in params) for n in norms])
    spegn = np.array([sum(n[p][1] ** 2 for p in params) for n in norms])
    return sgn, spegn, (B * sgn - spegn) / (B - 1), (spegn - sgn) / (1 - 1 / B)


def analysis(capsys, *args):
    """gns-analysis.py's command line, in this process: (exit status, stdout, stderr)."""
    code = gns_analysis.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_reference_log_leaves_out_its_tied_weight(tmp_path):
    norms, B = reference_run(tmp_path)
    # a finished reference log says nothing of whose it is: asked for, in one line
    r = run_tool(tmp_path, "--no-plots", "--alpha", "0.8")  # as users run it
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1
    assert "pass --origin fork or --origin reference" in r.stderr
    r = run_tool(tmp_path, "--no-plots", "--alpha", "0.8", "--origin", "reference")
    assert r.returncode == 0, r.stderr
    assert ("note: a log of the reference implementation (--origin reference): its tied weight "
            "transformer.wte.weight is measured wrong there") in r.stdout
    assert "12 steps with GNS measurements under 'train/gns', 4 parameters (LayerNorm 2, Linear 1, Embedding 1)" in r.stdout
    out = pd.read_csv(tmp_path / "gns_analysis.csv")
    sgn, spegn, gtg, trsigma = reference_estimates(norms, B, REFERENCE_PARAMS[1:])
    assert np.allclose(out["sgn"], sgn, rtol=1e-12) and np.allclose(out["spegn"], spegn, rtol=1e-12)
    assert np.allclose(out["gtg"], gtg, rtol=1e-10) and np.allclose(out["trsigma"], trsigma, rtol=1e-10)
    assert np.allclose(out["gns"], hand_ema(trsigma, 0.8) / hand_ema(gtg, 0.8), rtol=1e-10)
    # kept, the tied weight's too-small per-example norms would have moved the GNS
    _, _, gtg_all, trsigma_all = reference_estimates(norms, B, REFERENCE_PARAMS)
    assert abs(hand_ema(trsigma_all, 0.8)[-1] / hand_ema(gtg_all, 0.8)[-1] / out["gns"].iloc[-1] - 1) > 0.05
    # its losses, written as tensors, are numbers
    assert load_log(tmp_path)[0]["val/loss"].tolist()[:6:5] == [4.1, 3.6]


def test_whose_log_it_is(tmp_path, capsys):
    # the reference's run still going: no log.csv yet, its in-progress pair, and no config.json
    going = tmp_path / "going"
    reference_run(going, finish=False)
    os.remove(going / "config.json")
    code, out, err = analysis(capsys, going, "--no-plots")
    assert code == 0 and "4 parameters" in out, err
    assert "(written as log_header.csv.tmp + log_data.csv.tmp)" in out
    assert (going / "gns_analysis.csv").is_file()
    # this fork's tracker says so in config.json: the tied weight, measured exactly here, is kept
    ours = tmp_path / "ours"
    reference_run(ours, config={"seed": 1337, "batch_size": 8, WRITER_KEY: WRITER})
    code, out, err = analysis(capsys, ours, "--no-plots")
    assert code == 0 and "5 parameters" in out and "note" not in out
    # a 'seed' alone says nothing: that was a guess, which could keep or drop the tied weight wrongly
    seeded = tmp_path / "seeded"
    reference_run(seeded, config={"seed": 1337, "batch_size": 8})
    code, out, err = analysis(capsys, seeded, "--no-plots")
    assert code == 2 and "cannot tell whether this log is this fork's" in err
    code, out, err = analysis(capsys, seeded, "--no-plots", "--origin", "fork")
    assert code == 0 and "5 parameters" in out and "note" not in out
    # no config.json: auto cannot tell, the flag says
    unknown = tmp_path / "unknown"
    reference_run(unknown)
    os.remove(unknown / "config.json")
    code, out, err = analysis(capsys, unknown, "--no-plots")
    assert code == 2 and out == "" and len(err.splitlines()) == 1
    assert "cannot tell whether this log is this fork's" in err and "(or --tied keep or drop)" in err
    code, out, err = analysis(capsys, unknown, "--no-plots", "--tied", "keep")
    assert code == 0 and "5 parameters" in out and "note" not in out
    code, out, err = analysis(capsys, unknown, "--no-plots", "--tied", "drop")
    assert code == 0 and "4 parameters" in out
    assert "note: the tied weight transformer.wte.weight is left out (--tied drop)" in out
    # a reference log kept on purpose says so
    code, out, err = analysis(capsys, going, "--no-plots", "--tied", "keep")
    assert code == 0 and "5 parameters" in out and "kept (--tied keep), though" in out


def test_log_origin():
    assert gns_analysis.log_origin("/nonexistent/log.csv")[0] is None
    assert gns_analysis.log_origin("/nonexistent/log_data.csv.tmp")[0] == "reference"


def test_a_float16_reference_log_leaves_out_its_ddp_estimator(tmp_path, capsys):
    half, bf16 = tmp_path / "half", tmp_path / "bf16"
    reference_run(half, config={"dtype": "float16"}, ddp=True)
    reference_run(bf16, config={"dtype": "bfloat16"}, ddp=True)
    code, out, err = analysis(capsys, half, "--no-plots", "--origin", "reference")
    assert code == 0, err
    assert "note: the reference implementation's DDP estimator under float16" in out
    assert "estimators in the log: train/gns only" in out
    assert "ddp_gns" not in pd.read_csv(half / "gns_analysis.csv").columns
    code, out, err = analysis(capsys, bf16, "--no-plots", "--origin", "reference")
    assert code == 0 and "DDP estimator" not in out and "\n  ddp " in out
    # nothing says whose it is: the columns stay, and a note says what they would be if it were the reference's
    code, out, err = analysis(capsys, half, "--no-plots", "--tied", "drop")
    assert code == 0 and "if this is a log of the reference implementation, its ddp/ columns are wrong" in out
    assert "ddp_gns" in pd.read_csv(half / "gns_analysis.csv").columns
    assert (pd.read_csv(bf16 / "gns_analysis.csv")["ddp_gns"] == 18.0).all()


def test_the_reference_output_columns():
    """gns_analysis.csv's columns of the reference, from the main estimator's total, beside ours."""
    n = 8
    rng = np.random.default_rng(11)
    ln, fc = "transformer.h.0.ln_1.weight", "transformer.h.0.mlp.c_fc.weight"
    fc_norm = rng.uniform(0.5, 1, n)
    fc_norm[2] = np.nan  # the total is not measured at row 2; LayerNorm is
    df = pd.DataFrame({"step": np.arange(n), "tokens_processed": 100 * np.arange(1, n + 1),
                       "ddp/gns": np.linspace(5, 6, n),
                       **gns_cols("train/gns", ln, rng.uniform(0.5, 1, n), rng.uniform(2, 3, n), 16),
                       **gns_cols("train/gns", fc, fc_norm, rng.uniform(2, 3, n), 16)})
    results, _ = gns_analysis.analyze(df, 0.7)
    assert list(results.columns[:13]) == ["step", "tokens_processed", "batch_size", "small_batch_size", "gtg", "trsigma",
                                          "gtg_ema", "trsigma_ema", "gns", "sgn", "spegn", "ddp_gns", "total/sq_norm"]
    for ref, ours in [("gtg", "total/sq_norm"), ("trsigma", "total/trace"), ("gtg_ema", "total/sq_norm_ema"),
                      ("trsigma_ema", "total/trace_ema"), ("gns", "total/gns")]:
        assert np.array_equal(results[ref], results[ours], equal_nan=True), ref
    sgn = df[f"train/gns/{ln}/norm"] ** 2 + df[f"train/gns/{fc}/norm"] ** 2
    spegn = (df[f"train/gns/{ln}/pegn"] ** 2 + df[f"train/gns/{fc}/pegn"] ** 2).where(df.step != 2)
    assert np.allclose(results["sgn"], sgn, equal_nan=True, rtol=1e-12) and np.isnan(results["sgn"][2])
    assert np.allclose(results["spegn"], spegn, equal_nan=True, rtol=1e-12) and np.isnan(results["spegn"][2])
    assert np.allclose(results["gtg"], (16 * sgn - spegn) / 15, equal_nan=True, rtol=1e-12)
    # the EMA: pandas' adjusted ewm over the measured steps (the reference's was ewm(adjust=False))
    measured = results["gtg"].dropna()
    assert np.allclose(results["gtg_ema"][measured.index], measured.ewm(alpha=0.3, adjust=True).mean(), rtol=1e-12)
    assert np.allclose(results["ddp_gns"], df["ddp/gns"]) and "ddp_gns" not in \
        gns_analysis.analyze(df.drop(columns="ddp/gns"), 0.7)[0]


def test_help_names_the_reference_columns_and_why_they_differ():
    r = run_tool("--help")
    assert r.returncode == 0
    for words in ("gtg_ema", "trsigma_ema", "sgn and spegn", "ddp_gns", "bias-corrected", "skipped, not zeros",
                  "tied weight wte = lm_head is included", "--tied {auto,keep,drop}", "Exit status"):
        assert words in r.stdout, words


def test_the_reference_names_not_kept_are_refused():
    from nanogns.refusals import ReferenceNameError
    for name, hint in (("analyze_gns", "use analyze(load_log(out_dir)[0]"), ("compute_ema", "use debiased_ema"),
                       ("compute_total_norms", "sgn and spegn"), ("get_aligned_columns", "use find_estimators"),
                       ("unbiased_stats", "use unbiased_estimates"), ("create_plots", "use plots(")):
        with pytest.raises(ReferenceNameError, match=re.escape(hint)):
            getattr(gns_analysis, name)
    with pytest.raises(AttributeError):
        gns_analysis.no_such_name


# -- cells that are not finite numbers ----------------------------------------------------------------

def test_cells_that_are_not_finite_numbers_are_counted_and_left_out(tmp_path):
    """
    Row 2: the Linear norm empty (not measured: silent). Row 3: every norm inf, B real (train.py's
    float16 overflow). Row 5: a norm 'nan'; row 7: a pegn 1e400 (non-finite norms too). Rows 6
    and 8: a batch size 'abc' and 1e400 (other cells). train/sogns: an inf norm at row 4.
    """
    ln, fc = "transformer.h.0.ln_1.weight", "transformer.h.0.mlp.c_fc.weight"
    n = 10
    rng = np.random.default_rng(3)
    cells = {f"train/gns/{p}/{k}": [f"{v:.6f}" for v in rng.uniform(*span, n)]
             for p in (ln, fc) for k, span in (("norm", (0.5, 1)), ("pegn", (2, 3)))}
    cells.update({f"train/gns/{p}/batch_size": ["16"] * n for p in (ln, fc)})
    cells.update({f"train/sogns/{fc}/{k}": list(cells[f"train/gns/{fc}/{k}"]) for k in ("norm", "pegn", "batch_size")})
    cells[f"train/gns/{fc}/norm"][2] = ""
    for p in (ln, fc):
        cells[f"train/gns/{p}/norm"][3] = cells[f"train/gns/{p}/pegn"][3] = "inf"
    cells[f"train/gns/{fc}/norm"][5] = "nan"
    cells[f"train/gns/{ln}/pegn"][7] = "1e400"
    cells[f"train/gns/{fc}/batch_size"][6] = "abc"
    cells[f"train/gns/{fc}/batch_size"][8] = "1e400"
    cells[f"train/sogns/{fc}/norm"][4] = "inf"
    with open(tmp_path / "log.csv", "w") as f:
        f.write(",".join(["step", *cells]) + "\n")
        f.writelines(",".join([str(i), *(c[i] for c in cells.values())]) + "\n" for i in range(n))

    df, _, _ = gns_analysis.read_log(tmp_path)  # as the command line reads it: a 'nan' is not an empty cell
    results, info = gns_analysis.analyze(df, 0.9)
    assert info["overflow_steps"] == [3, 5, 7] and info["bad_cells"] == 2
    assert info["bad_examples"] == [f"step 6 {fc}/batch_size ('abc')", f"step 8 {fc}/batch_size ('1e400')"]
    assert info["estimators"]["train/sogns"]["overflow_steps"] == [4]
    # each left out of the groups holding its parameter, and of those only
    trace = results.set_index("step")
    assert trace["total/trace"].isna().tolist() == [i in (2, 3, 5, 6, 7, 8) for i in range(n)]
    assert trace["LayerNorm/trace"].isna().tolist() == [i in (3, 7) for i in range(n)]
    assert trace["Linear/trace"].isna().tolist() == [i in (2, 3, 5, 6, 8) for i in range(n)]
    assert trace["total/ema_steps"].tolist() == [1, 2, 2, 2, 3, 3, 3, 3, 3, 4]

    r = run_tool(tmp_path, "--no-plots")
    assert r.returncode == 0, r.stderr
    assert ("\n  3 steps with non-finite norms (e.g. float16 overflow; the optimizer skipped them), left out: "
            "steps 3, 5, 7\n") in r.stdout
    assert (f"\n  2 cells that are not finite numbers, left out with their steps: step 6 {fc}/batch_size ('abc'); "
            f"step 8 {fc}/batch_size ('1e400')\n") in r.stdout
    assert ("\n    train/sogns: 1 steps with non-finite norms (e.g. float16 overflow; the optimizer skipped them), "
            "left out: steps 4\n") in r.stdout
    assert "step 2" not in r.stdout, "an empty cell is a step without a measurement"


def rewrite_cells(log, changes):
    """A copy of the log's CSV text with cells replaced: changes {(step, column): new text}."""
    with open(log, newline="") as f:
        rows = list(csv.reader(f))
    header = rows[0]
    for (step, col), text in changes.items():
        [row] = [r for r in rows[1:] if r[0] == str(step)]
        row[header.index(col)] = text
    return "".join(",".join(r) + "\n" for r in rows)


def test_cells_out_of_range_are_left_out_with_their_steps_and_named(tmp_path):
    """A negative norm or pegn, a batch size below 1 or not whole: no measurement gives them, so each is
    left out with its step, as an empty cell is, and named; taken as numbers they changed the GNS (a
    negative norm squared reads as a positive one)."""
    out = toy_gpt_log(tmp_path / "log", steps=16)
    log = os.path.join(out, "log.csv")
    df, _, _ = gns_analysis.read_log(out)
    ln, fc, wte = "transformer.h.0.ln_1.weight", "transformer.h.1.mlp.c_fc.weight", "transformer.wte.weight"
    cells = {(5, f"train/gns/{fc}/norm"): f"-{df[f'train/gns/{fc}/norm'][5]}",
             (7, f"train/gns/{ln}/pegn"): f"-{df[f'train/gns/{ln}/pegn'][7]}",
             (9, f"train/gns/{wte}/batch_size"): "0", (11, f"train/gns/{fc}/batch_size"): "12.5"}
    variants = {"wrong": cells, "empty": {key: "" for key in cells}}
    results = {}
    for name, changes in variants.items():
        os.makedirs(tmp_path / name)
        (tmp_path / name / "log.csv").write_text(rewrite_cells(log, changes))
        shutil.copy(os.path.join(out, "config.json"), tmp_path / name)  # this fork's log: its tied weight kept
        results[name], info = gns_analysis.analyze(gns_analysis.read_log(tmp_path / name)[0], 0.9)
        if name == "wrong":
            wrong_info = info
    original = gns_analysis.analyze(df, 0.9)[0]
    for col in ("total/gns", "LayerNorm/gns", "Linear/gns", "Embedding/gns", "h.1/gns"):
        assert np.allclose(results["wrong"][col], results["empty"][col], equal_nan=True, rtol=1e-12), col
    assert not np.allclose(results["wrong"]["total/gns"], original["total/gns"], equal_nan=True)
    assert results["wrong"]["total/trace"].isna().sum() == 4
    assert wrong_info["out_of_range"] == 4 and wrong_info["bad_cells"] == 0 and wrong_info["overflow_steps"] == []

    r = run_tool(tmp_path / "wrong", "--no-plots")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    [line] = [line for line in r.stdout.splitlines() if "out of range" in line]
    assert line.startswith("  4 cells out of range (a negative norm, a batch size below 1 or not whole, a small "
                           "batch above the batch), left out with their steps: ")
    named = line.split(": ", 1)[1].split("; ")
    assert sorted(named) == sorted(f"step {step} {col[len('train/gns/'):]} ({text})"
                                   for (step, col), text in cells.items())


def test_out_of_range_cells_of_every_kind_and_estimator():
    """small_batch_size as batch_size, and the DDP estimator's totals; a whole number written 8.0 is one."""
    n = 6
    cols = gns_cols("train/microbatch_gns", "w", np.full(n, 1.0), np.full(n, 2.0), np.full(n, 16.0), np.full(n, 4.0))
    cols["train/microbatch_gns/w/small_batch_size"][1] = 0.5
    cols["train/microbatch_gns/w/batch_size"][2] = -16
    cols["train/microbatch_gns/w/small_batch_size"][5] = 32  # above the batch
    cols.update({"ddp/big_batch_norm": np.full(n, 1.0), "ddp/small_batch_norm": np.full(n, 2.0),
                 "ddp/big_batch_size": np.full(n, 16.0), "ddp/small_batch_size": np.full(n, 8.0)})
    cols["ddp/small_batch_norm"][3] = -2.0
    cols["ddp/small_batch_size"][4] = 7.5
    results, info = gns_analysis.analyze(pd.DataFrame({"step": np.arange(n), **cols}), 0.5)
    assert info["main"] == "train/microbatch_gns" and info["out_of_range"] == 3
    assert info["out_of_range_examples"] == ["step 2 w/batch_size (-16.0)", "step 1 w/small_batch_size (0.5)",
                                             "step 5 w/small_batch_size (32.0 > batch_size 16.0)"]
    assert results["total/trace"].isna().tolist() == [False, True, True, False, False, True]
    ddp = info["estimators"]["ddp"]
    assert ddp["out_of_range"] == 2 and results["ddp/total/trace"].isna().tolist() == [False] * 3 + [True] * 2 + [False]
    text = gns_analysis.summary(results, info, "log.csv", 0.5)
    assert "    ddp: 2 cells out of range (a negative norm, a batch size below 1 or not whole, a small batch above " \
           "the batch), left out with their steps: step 3 (whole model)/pegn (-2.0); step 4 (whole model)/small_batch_size (7.5)" in text.splitlines()


def test_steps_logged_twice_with_different_values_are_named_and_the_later_copy_kept(tmp_path):
    n = 16
    rng = np.random.default_rng(5)
    df = pd.DataFrame({"step": np.arange(n), **gns_cols("train/gns", "w", rng.uniform(0.5, 1, n),
                                                        rng.uniform(2, 3, n), np.full(n, 8))})
    redone = df[df["step"].between(10, 12)].assign(**{"train/gns/w/pegn": rng.uniform(2, 3, 3)})
    same = df[df["step"] == 14]  # a copy that repeats its row says nothing new
    (tmp_path / "twice").mkdir()
    pd.concat([df, redone, same]).to_csv(tmp_path / "twice" / "log.csv", index=False)
    (tmp_path / "later").mkdir()
    pd.concat([df[~df["step"].between(10, 12)], redone]).sort_values("step").to_csv(
        tmp_path / "later" / "log.csv", index=False)
    r = run_tool(tmp_path / "twice", "--no-plots")
    assert r.returncode == 0, r.stderr
    assert r.stderr == (f"gns-analysis.py: warning: {tmp_path / 'twice' / 'log.csv'}: steps 10-12 appear twice with "
                        f"different values: the later copy is kept\n")
    later = run_tool(tmp_path / "later", "--no-plots")
    assert later.returncode == 0 and later.stderr == "", later.stderr
    assert pd.read_csv(tmp_path / "twice" / "gns_analysis.csv").equals(pd.read_csv(tmp_path / "later" / "gns_analysis.csv"))


def test_every_step_overflowed():
    df = pd.DataFrame({"step": [0, 1], **gns_cols("train/gns", "w", [np.inf, np.inf], [np.inf, 1.0], 8)})
    with pytest.raises(gns_analysis.AnalysisError, match="hold no numbers yet \\(2 steps with non-finite norms\\)"):
        gns_analysis.analyze(df, 0.9)


# -- exit status and memory -------------------------------------------------------------------------

def test_exit_status(tmp_path):
    n = 3
    pd.DataFrame({"step": np.arange(n), **gns_cols("train/gns", "a", np.full(n, 1.0), np.full(n, 2.0), 8)}
                 ).to_csv(tmp_path / "log.csv", index=False)
    r = run_tool(tmp_path, "--no-plots", "--prefix", "train/sogns")  # asked for, not there: bad input
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no GNS columns 'train/sogns/" in r.stderr
    assert "estimators in the log: train/gns" in r.stderr
    if os.path.exists("/dev/full"):
        with open("/dev/full", "w") as full:
            r = subprocess.run([sys.executable, SCRIPT, str(tmp_path)], stdout=full, stderr=subprocess.PIPE,
                               text=True, cwd=ROOT)
        assert r.returncode == 1 and r.stderr.splitlines() == [
            "gns-analysis.py: error: cannot write the output (No space left on device)"]


@pytest.mark.slow
def test_memory_is_about_the_size_of_the_log(tmp_path):
    """
    A 16 MB log takes less than 3x its size beyond what a 20-step one of the same shape takes
    (1.9x measured; 7.2x when the whole file was read as one string and every column parsed).
    """
    (tmp_path / "long").mkdir(), (tmp_path / "short").mkdir()
    size = write_long_log(tmp_path / "long" / "log.csv", rows=8000, params=48)
    write_long_log(tmp_path / "short" / "log.csv", rows=20, params=48)
    baseline = peak_rss(sys.executable, SCRIPT, tmp_path / "short", "--no-plots")
    peak = peak_rss(sys.executable, SCRIPT, tmp_path / "long", "--no-plots")
    assert size > 12e6 and peak - baseline < 3 * size, (peak - baseline) / size


def test_normalisation_group_is_named_after_the_kinds_recorded(tmp_path, capsys):
    out = toy_gpt_log(tmp_path / "log", steps=6)
    names = list(load_log(out)[0].columns)
    params = sorted({c.split("/")[2] for c in names if c.startswith("train/gns/")})
    norms = [n for n in params if ".ln_" in n]
    # no record: by name, LayerNorm
    assert gns_analysis.main([str(out), "--no-plots"]) == 0
    assert "LayerNorm vs total GNS" in capsys.readouterr().out
    # recorded RMSNorms (and a Linear recorded as a norm: the record, not the name, decides)
    kinds = {n: "rmsnorm" if n in norms or n.endswith("c_fc.weight") else "linear" for n in params}
    with open(os.path.join(out, "layer_kinds.json"), "w") as f:
        json.dump(kinds, f)
    assert gns_analysis.main([str(out), "--no-plots"]) == 0
    text = capsys.readouterr().out
    assert "RMSNorm vs total GNS" in text and f"RMSNorm {len(norms) + 2}," in text and "LayerNorm" not in text
    results = pd.read_csv(os.path.join(out, "gns_analysis.csv"))
    assert "RMSNorm/gns" in results.columns and "LayerNorm/gns" not in results.columns
    # both kinds: one group named after both
    kinds[norms[0]] = "layernorm"
    with open(os.path.join(out, "layer_kinds.json"), "w") as f:
        json.dump(kinds, f)
    assert gns_analysis.main([str(out), "--no-plots"]) == 0
    assert "LayerNorm+RMSNorm vs total GNS" in capsys.readouterr().out
    # an older log of an RMSNorm GPT: no record, its config.json says norm=rmsnorm
    os.remove(os.path.join(out, "layer_kinds.json"))
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump({**config, "norm": "rmsnorm"}, f)
    assert gns_analysis.main([str(out), "--no-plots"]) == 0
    assert "RMSNorm vs total GNS" in capsys.readouterr().out


# -- without the analysis extra ---------------------------------------------------------------------

def without(folder, *modules):
    """The environment of a run where `modules` cannot be imported (as without the analysis extra): a
    folder first on the path whose module of each name raises the ImportError a missing one does."""
    shim = folder / "without"
    shim.mkdir(parents=True)
    for name in modules:
        (shim / f"{name}.py").write_text(f"raise ModuleNotFoundError(\"No module named '{name}'\", name={name!r})\n")
    return dict(os.environ, PYTHONPATH=str(shim))


def test_without_the_analysis_extra_one_line_names_it(tmp_path):
    n = 3
    pd.DataFrame({"step": np.arange(n), **gns_cols("train/gns", "a", np.full(n, 1.0), np.full(n, 2.0), 8)}
                 ).to_csv(tmp_path / "log.csv", index=False)
    for missing, args, needs in (("pandas", ["--no-plots"], "the analysis needs"),
                                 ("plotille", [], "the terminal plots (--no-plots leaves them out) need")):
        r = subprocess.run([sys.executable, SCRIPT, str(tmp_path), *args], cwd=ROOT, capture_output=True, text=True,
                           env=without(tmp_path / missing, missing), timeout=60)
        assert (r.returncode, r.stdout) == (2, ""), r.stderr
        assert r.stderr == (f"gns-analysis.py: error: No module named '{missing}': {needs} {missing}, in the "
                            f"'analysis' extra: pip install 'nanogns[analysis]'\n")
    assert not (tmp_path / "gns_analysis.csv").exists()
    r = run_tool(tmp_path, "--no-plots")  # plotille is only the plots'
    assert r.returncode == 0 and (tmp_path / "gns_analysis.csv").exists(), r.stderr


# -- the figures as PNG files (--figures DIR) ---------------------------------------------------------

def png_size(path):
    """(width, height) from a PNG file's header: the signature, then the IHDR chunk."""
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", head
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def test_figures_are_written_as_pngs_of_the_size_help_states(tmp_path, capsys):
    out = toy_gpt_log(tmp_path / "run", steps=12)
    folder = tmp_path / "figures" / "new"  # made, with its parent
    assert gns_analysis.main([str(out), "--no-plots", "--alpha", "0.8", "--figures", str(folder)]) == 0
    stdout = capsys.readouterr().out
    names = ["gns_over_tokens.png", "norm_vs_total.png"]
    assert sorted(os.listdir(folder)) == names  # no .tmp left: written through atomic_write
    for name in names:
        assert f"\nwrote {folder / name}\n" in stdout
        assert png_size(folder / name) == (900, 500)
        assert os.path.getsize(folder / name) > 10_000  # drawn, not blank
    assert "900 x 500 PNG files" in " ".join(run_tool("--help").stdout.split())
    # a model without normalisation layers: that figure says so
    g = torch.Generator().manual_seed(0)
    linear = log_training(tmp_path / "linear", measure(LinearRegression(3)),
                          lambda B: (torch.randn(B, 3, generator=g), torch.randn(B, generator=g)),
                          steps=5, batch_sizes=(4,), per_example=linear_regression_grads)
    assert gns_analysis.main([str(linear), "--no-plots", "--figures", str(tmp_path / "linear")]) == 0
    assert png_size(tmp_path / "linear" / "norm_vs_total.png") == (900, 500)


def test_figures_refused_in_one_line_before_anything_is_written(tmp_path):
    n = 3
    pd.DataFrame({"step": np.arange(n), **gns_cols("train/gns", "a", np.full(n, 1.0), np.full(n, 2.0), 8)}
                 ).to_csv(tmp_path / "log.csv", index=False)
    (tmp_path / "a-file").write_text("")
    r = subprocess.run([sys.executable, SCRIPT, str(tmp_path), "--no-plots", "--figures", str(tmp_path / "figs")],
                       cwd=ROOT, capture_output=True, text=True, env=without(tmp_path, "matplotlib"), timeout=60)
    assert (r.returncode, r.stdout) == (2, "") and r.stderr == (
        "gns-analysis.py: error: No module named 'matplotlib': --figures needs matplotlib, in the 'figures' extra: "
        "pip install 'nanogns[figures]'\n")
    for folder in ("a-file", "a-file/figs"):
        r = run_tool(tmp_path, "--no-plots", "--figures", tmp_path / folder)
        assert (r.returncode, r.stdout) == (2, "") and r.stderr == (
            f"gns-analysis.py: error: --figures {tmp_path / folder}: {tmp_path / 'a-file'} is not a directory\n")
    assert sorted(os.listdir(tmp_path)) == ["a-file", "log.csv", "without"]  # no gns_analysis.csv, no figs
