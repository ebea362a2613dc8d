"""
nanogns.olmo.GNSCallback and the measured layers in OLMo-core's models. In one process: OLMo-core's
llama-like transformer measured by nanogns.measure (its RMSNorm a known class; one with a bias left out
with the reason) against per-example gradients from torch.func; the callback's settings refused in one
line. Then OLMo-core's own Trainer (tests/olmo_worker.py, tests/olmo_harness.py): one process, and 2
and 4 gloo ranks under DDP, FSDP, HSDP, tensor and context parallelism, each run's log.csv equal to the
single process's; a resume from OLMo-core's checkpoint; the batch from the GNS; the refusals.
"""
import csv
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("olmo_core", reason="OLMo-core (ai2-olmo-core, the 'olmo' extra) is not installed")

from olmo_core.nn.layer_norm import RMSNorm as OlmoRMSNorm  # noqa: E402
from olmo_core.nn.transformer import TransformerConfig  # noqa: E402

import nanogns  # noqa: E402
from conftest import REPO, made_once  # noqa: E402
from gns_fixtures import sqgradnorm_sums  # noqa: E402
from nanogns.olmo import GNSCallback, GNSCallbackError  # noqa: E402

VOCAB = 64


def tiny_olmo(seed=0, **kwargs):
    torch.manual_seed(seed)
    model = TransformerConfig.llama_like(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=2,
                                         **kwargs).build(init_device="cpu")
    with torch.no_grad():  # gains away from their init of ones, so that each norm is a real test
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def lm_loss(forward, ids):
    """The mean over the batch of each example's mean next-token loss (OLMo-core's, with equal lengths)."""
    logits = forward(ids[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


@pytest.mark.parametrize("linear", ["gns", "shim"])
def test_an_olmo_core_transformer_is_measured_exactly(linear):
    model = tiny_olmo()
    batches = [torch.randint(0, VOCAB, (3, 9), generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    want = sqgradnorm_sums(model, lm_loss, [(b,) for b in batches])  # the plain model's, per example
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every parameter measured: no coverage warning
        nanogns.measure(model, linear=linear)
    kinds = nanogns.layers.layer_kinds(model)
    assert kinds["blocks.0.attention_norm.weight"] == "rmsnorm" and kinds["lm_head.w_out.weight"] == "linear"
    assert len(kinds) == len(list(model.parameters()))
    for ids in batches:
        (lm_loss(model, ids) / len(batches)).backward()
    got = {name: sq.item() for name, _, sq, _ in nanogns.find_sqgradnorm_buffers(model)}
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert got[name] == pytest.approx(value.item(), rel=1e-5), name


def test_an_olmo_rmsnorm_with_a_bias_is_left_out_with_the_reason():
    model = torch.nn.Sequential(OlmoRMSNorm(size=8, bias=True), torch.nn.Linear(8, 8))
    with pytest.warns(UserWarning, match=r"0.weight \(RMSNorm: an RMSNorm with a bias") as caught:
        nanogns.measure(model)
    assert "\n" not in str(caught[0].message)
    assert "0.weight_sqgradnorm" not in dict(model.named_buffers())


@pytest.mark.parametrize("settings, words", [
    (dict(bs_controller="yes"), "bs_controller='yes' is not one of 'none', 'gns'"),
    (dict(bs_controller="gns"), "bs_max_tokens=None is not valid"),
    (dict(bs_controller="gns", bs_max_tokens=64, bs_gns_fraction=0), "bs_gns_fraction=0 is not valid"),
    (dict(bs_controller="gns", bs_max_tokens=64, bs_gns_group="adam"), "bs_gns_group='adam' is not valid"),
    (dict(bs_controller="gns", bs_max_tokens=64, bs_warmup_steps=0), "bs_warmup_steps=0 is not valid"),
])
def test_the_callbacks_settings_are_checked_in_one_line(settings, words):
    with pytest.raises(GNSCallbackError, match=words.replace("(", r"\(")) as caught:
        GNSCallback(**settings)
    assert "\n" not in str(caught.value)


# ---------------------------------------------------------------- OLMo-core's Trainer (tests/olmo_worker.py)

def run_worker(out, procs, *configs):
    """tests/olmo_worker.py's configurations, in one process (procs 0) or on `procs` gloo ranks; its output."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests")]))
    worker = os.path.join(REPO, "tests", "olmo_worker.py")
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}"]
              if procs else [sys.executable])
    done = subprocess.run([*launch, worker, str(out), *configs], cwd=str(out), capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    oks = [line.split(" {")[0] for line in done.stdout.splitlines() if line.startswith("ok ")]
    assert oks == [f"ok {config}" for config in configs], done.stdout[-3000:]
    return done.stdout


def gns_cells(out, config):
    """{(step, column): value} of the per-parameter columns of OUT/<config>/gns/log.csv."""
    with open(os.path.join(out, config, "gns", "log.csv")) as f:
        rows = list(csv.DictReader(f))
    return {(row["step"], key): float(value) for row in rows for key, value in row.items()
            if key.startswith("train/gns/") and key.rsplit("/", 1)[1] in ("norm", "pegn", "batch_size")}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The single-process run, its resume and batch control and refusals (once for both workers), and its
    log's cells."""
    out = made_once(tmp_path_factory, "olmo-one-process",
                    lambda folder: run_worker(folder, 0, "single", "resume-single", "bs", "refusals"))
    return out, gns_cells(out, "single")


def measured_part(cells, config):
    """The columns a configuration measures: the normalisations' under CP, all of them otherwise."""
    if config.endswith("cp"):
        return {k: v for k, v in cells.items() if "norm." in k[1]}
    return cells


@pytest.mark.slow
@pytest.mark.parametrize("procs, configs", [(2, ("ddp", "fsdp", "hsdp", "tp", "cp", "resume-fsdp", "bs", "refusals")),
                                            (4, ("fsdp_tp", "fsdp_cp"))])
def test_the_callback_logs_under_each_parallelism_what_one_process_logs(one_process, tmp_path, procs, configs):
    """DDP, FSDP, HSDP, TP, Ulysses CP, FSDP x TP and FSDP x CP on gloo ranks: every cell of log.csv (each
    parameter's |G_B|, |G_1| and B at each step) equals the single process's within 1e-5 relative, over
    what each measures; a run resumed from OLMo-core's checkpoint writes the straight run's log; the batch
    from the GNS grows alike on every rank; what cannot be measured is refused in one line."""
    single_dir, single = one_process
    assert len({column for _, column in single}) == 3 * 21 and len({step for step, _ in single}) == 3
    run_worker(tmp_path, procs, *configs)
    for config in [c for c in configs if c not in ("bs", "refusals")]:
        got = gns_cells(tmp_path, config)
        want = measured_part(single, config.removeprefix("resume-"))
        assert got.keys() == want.keys(), (config, sorted(set(got) ^ set(want))[:5])
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-5), (config, key)
    with open(os.path.join(single_dir, "single", "gns", "log.csv")) as a, \
            open(os.path.join(single_dir, "resume-single", "gns", "log.csv")) as b:
        assert a.read() == b.read()  # resumed from step 1's checkpoint: the same log, to the byte


def test_the_log_is_read_by_the_analysis(one_process):
    out, _ = one_process
    done = subprocess.run([sys.executable, os.path.join(REPO, "gns-analysis.py"), os.path.join(out, "single", "gns"),
                           "--no-plots"], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr
    assert "3 steps with GNS measurements under 'train/gns', 21 parameters (RMSNorm 5, Linear 15, Embedding 1)" \
        in done.stdout, done.stdout


def test_the_batch_from_the_gns_grows_by_olmo_cores_rules_and_resumes(one_process):
    """Warm-up 2 steps: the start (4 examples) for the first two rows, then the ceiling (8) once the data
    loader's batches allow it; the row says the target and the batch's tokens. Saved at step 3 (its batch
    doubled) and resumed, the run writes the same log."""
    out, _ = one_process
    with open(os.path.join(out, "bs", "gns", "log.csv")) as f:
        text = f.read()
    rows = list(csv.DictReader(text.splitlines()))
    assert [row["bs_controller/batch_tokens"] for row in rows] == ["64", "64", "128", "128", "128"]
    assert [row["train/gns/lm_head.norm.weight/batch_size"] for row in rows] == ["4", "4", "8", "8", "8"]
    targets = [float(row["bs_controller/target_examples"]) for row in rows]
    assert math.isnan(targets[0]) and math.isnan(targets[1]) and all(t > 8 for t in targets[2:])
    with open(os.path.join(out, "bs-resumed", "gns", "log.csv")) as f:
        assert f.read() == text


@pytest.mark.slow
def test_the_readme_example_runs_as_written(tmp_path, tmp_path_factory):
    """The README's OLMo-core example as a user's script outside the checkout, with the package installed:
    20 rows for gns-analysis.py, and the live GNS on OLMo-core's console."""
    from loop_fixtures import installed_package, run_readme_example
    output = run_readme_example(3, tmp_path, "out-olmo/gns", "21 parameters (RMSNorm 5, Linear 15, Embedding 1)",
                                installed_package(tmp_path_factory))
    assert "gns/total=" in output and "gns/LayerNorm=" in output
