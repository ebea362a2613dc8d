import importlib.util
import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn as nn

from csv_tools import load_log
from gns_fixtures import ToyGPT, measure, mse, per_example_grads, train_step
from gnstracking import AccumulateMeasurements, MeasurementTracker
from tracker import LogWrapper

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


def linear_regression_grads(model, x, y, loss_fn):
    """Per-example gradients of 0.5 (w.x - y)^2 in closed form, (w.x - y) x (the vmap oracle is slow here)."""
    return {"fc.weight": ((model(x) - y)[:, None] * x)[:, None, :]}


def test_closed_form_per_example_gradients_match_vmap():
    model = LinearRegression(3)
    x, y = torch.randn(5, 3), torch.randn(5)
    assert torch.allclose(linear_regression_grads(model, x, y, mse)["fc.weight"],
                          per_example_grads(model, x, y)["fc.weight"], atol=1e-6)


def log_training(out_dir, model, make_batch, steps, batch_sizes, update=None, per_example=per_example_grads):
    """The training-loop wiring: micro-steps, tracker.step, logging; returns the LogWrapper's out_dir."""
    logs = AccumulateMeasurements()
    tracker = MeasurementTracker.from_model(model, callback=logs)
    log = LogWrapper(out_dir=out_dir, config={"batch_sizes": list(batch_sizes)})
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


def toy_gpt_log(out_dir, steps=16):
    torch.manual_seed(0)
    model = measure(ToyGPT(n_layer=2))
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
]


def test_bad_inputs_one_line_and_nonzero_exit(tmp_path):
    children = []
    for i, (content, args, message) in enumerate(BAD_INPUTS):  # all at once: interpreter start-up dominates
        out = tmp_path / f"out{i}"
        if content is not None:
            out.mkdir()
            (out / "log.csv").write_text(content)
        children.append(subprocess.Popen([sys.executable, SCRIPT, str(out), *args], cwd=ROOT, text=True,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    for child, (_, _, message) in zip(children, BAD_INPUTS):
        stdout, stderr = child.communicate()
        assert child.returncode != 0 and "Traceback" not in stderr, (message, stderr)
        assert message in stderr and len(stderr.strip().splitlines()) == 1, (message, stderr)
