"""--fsdp=True (FSDP2) on CPU with gloo: 2 ranks x 2 examples log what 1 process x 4 examples logs
(every per-parameter GNS column, the tied weight's included, grad_norm, the losses), its ckpt.pt is
a single process's, loadable without FSDP and by sample.py, a resumed FSDP run continues (after a
SIGTERM too), and float16 with its GradScaler agrees with one process."""
import os
import shutil
import subprocess
import sys

import pandas as pd
import pytest
import torch

from conftest import REPO, TINY, made_once, run_train
from test_train import train_until_exit

# per-rank batch 2 over 2 ranks against batch 4 in one process; gradient_accumulation_steps is global
ONE, TWO = ["--batch_size=4", "--gradient_accumulation_steps=2"], ["--batch_size=2", "--gradient_accumulation_steps=4"]
# the measured layer classes (the fused LayerNorm runs its CPU path). The gns Linears choose their
# method by shapes, not by timing ("auto"): materialised per-example gradients sum to the weight
# gradient with other rounding than the ghost norm's GEMM, and two runs timing apart may choose apart,
# which the sampled texts compared below would show
LAYERS = {"gns": ["--linearclass=gns", "--embeddingclass=gns", "--lnclass=shim", "--per_example_mode=shapes"],
          "shim": ["--linearclass=shim", "--embeddingclass=shim", "--lnclass=fused"]}


def compared_columns(one):
    return [c for c in one.columns if c.startswith("train/gns/")] + ["grad_norm", "train/loss", "val/loss"]


def assert_same_columns(one, two, rows):
    for c in compared_columns(one):
        assert two.loc[rows, c].to_numpy() == pytest.approx(one.loc[rows, c].to_numpy(), rel=1e-5, nan_ok=True), c


@pytest.fixture(scope="module", params=list(LAYERS))
def fsdp_runs(request, tiny_dataset, tmp_path_factory):
    """(one-process out_dir, FSDP out_dir, flags) after 3 steps each, with the same global batches."""
    common = [*TINY, f"--dataset={tiny_dataset}", "--max_iters=3", "--eval_interval=2", "--backend=gloo",
              *LAYERS[request.param]]

    def make(d):
        run_train(*common, f"--out_dir={d / 'one'}", *ONE)
        run_train(*common, f"--out_dir={d / 'two'}", *TWO, "--fsdp=True", torchrun_procs=2)
    d = made_once(tmp_path_factory, f"fsdp_{request.param}", make)
    return d / "one", d / "two", common


def test_fsdp_without_torchrun_is_one_line_and_exit_2(tiny_dataset, tmp_path):
    code, stderr = train_until_exit(*TINY, f"--dataset={tiny_dataset}", f"--out_dir={tmp_path / 'o'}", "--fsdp=True")
    assert code == 2
    err = stderr.strip().splitlines()
    assert len(err) == 1 and "--fsdp=True shards the model over processes: launch with torchrun" in err[0], stderr


@pytest.mark.parametrize("flag", ["--gns_hooks=exact", "--gns_hooks=sogns", "--microbatch_gns=True"])
def test_fsdp_with_an_estimator_that_reads_whole_gradients_is_one_line_and_exit_2(tiny_dataset, tmp_path, monkeypatch,
                                                                                 flag):
    monkeypatch.setenv("RANK", "0")  # as under torchrun: refused before any process group is made
    monkeypatch.setenv("WORLD_SIZE", "2")
    code, stderr = train_until_exit(*TINY, f"--dataset={tiny_dataset}", f"--out_dir={tmp_path / 'o'}",
                                    "--gradient_accumulation_steps=2", "--fsdp=True", flag)
    assert code == 2
    err = stderr.strip().splitlines()
    assert len(err) == 1 and "--gns_hooks and --microbatch_gns read whole, unsharded gradients" in err[0], stderr


@pytest.mark.slow
def test_fsdp_logs_what_one_process_logs_on_the_same_global_batch(fsdp_runs):
    one_dir, two_dir, _ = fsdp_runs
    one, two = pd.read_csv(one_dir / "log.csv"), pd.read_csv(two_dir / "log.csv")
    gns_cols = [c for c in one.columns if c.startswith("train/gns/")]
    assert len(gns_cols) == 3 * 15  # every parameter: 6 per block x 2, ln_f, wte (tied), wpe
    assert "train/gns/transformer.wte.weight/pegn" in gns_cols
    assert (two["train/gns/transformer.wte.weight/batch_size"] == 8).all()
    assert not any(c.startswith("ddp/") for c in two.columns)  # the DDP estimator is DDP's alone
    assert_same_columns(one, two, slice(None))


@pytest.mark.slow
def test_an_fsdp_checkpoint_is_a_single_process_one(fsdp_runs, tmp_path):
    one_dir, two_dir, common = fsdp_runs
    one, two = (torch.load(d / "ckpt.pt", weights_only=False) for d in (one_dir, two_dir))
    assert list(two["model"]) == list(one["model"])  # the full state dict, tied head included
    for k, v in one["model"].items():
        assert not two["model"][k].is_meta and torch.allclose(two["model"][k].float(), v.float(), atol=1e-6), k
    assert two["optimizer"]["param_groups"] == one["optimizer"]["param_groups"]  # integer ids, as a process writes
    for i, state in one["optimizer"]["state"].items():
        for k, v in state.items():
            # relative to the tensor's scale: near-zero moments carry the gradients' float32 rounding
            assert (two["optimizer"]["state"][i][k] - v).abs().max() <= 1e-5 * v.abs().max(), (i, k)
    # a single process resumes from it (no FSDP), and sample.py loads it
    out = tmp_path / "resumed"
    shutil.copytree(two_dir, out)
    run_train(*[f for f in common if not f.startswith("--max_iters")], f"--out_dir={out}", "--max_iters=4",
              "--init_from=resume", *ONE)
    assert torch.load(out / "ckpt.pt", weights_only=False)["iter_num"] == 4
    sample = [sys.executable, os.path.join(REPO, "sample.py"), "--device=cpu", "--dtype=float32", "--num_samples=1",
              "--max_new_tokens=8", "--seed=3", "--start=the"]
    texts = [subprocess.run([*sample, f"--out_dir={d}"], capture_output=True, text=True, check=True).stdout
             for d in (one_dir, two_dir)]
    one_text, two_text = (t[t.index("number of parameters"):] for t in texts)  # past the echoed --out_dir
    assert two_text == one_text


@pytest.mark.slow
def test_a_resumed_fsdp_run_continues_the_log_like_one_process(fsdp_runs, tmp_path):
    """Resume shards the checkpoint's weights and optimizer state again: steps 3-4 of a resumed FSDP run
    log what a resumed single process logs."""
    one_dir, two_dir, common = fsdp_runs
    resumed = {}
    for name, d, flags, procs in (("one", one_dir, ONE, 0), ("two", two_dir, [*TWO, "--fsdp=True"], 2)):
        out = tmp_path / name
        shutil.copytree(d, out)
        run_train(*[f for f in common if not f.startswith("--max_iters")], f"--out_dir={out}", "--max_iters=5",
                  "--init_from=resume", *flags, torchrun_procs=procs)
        resumed[name] = pd.read_csv(out / "log.csv")
    one, two = resumed["one"], resumed["two"]
    assert two["iter_num"].tolist() == list(range(5))
    assert_same_columns(one, two, slice(None))


@pytest.mark.slow
def test_fsdp_float16_with_its_grad_scaler_logs_what_one_process_logs(tiny_dataset, tmp_path):
    """The GradScaler path (float16, emulated on CPU), with torch's own Linear and Embedding and the
    LayerNorms alone measuring: the scale divides out of the sharded |G_B|^2 as on one process."""
    common = [*TINY, f"--dataset={tiny_dataset}", "--max_iters=3", "--eval_interval=2", "--backend=gloo",
              "--dtype=float16", "--lnclass=shim"]
    run_train(*common, f"--out_dir={tmp_path / 'one'}", *ONE)
    run_train(*common, f"--out_dir={tmp_path / 'two'}", *TWO, "--fsdp=True", torchrun_procs=2)
    one, two = pd.read_csv(tmp_path / "one" / "log.csv"), pd.read_csv(tmp_path / "two" / "log.csv")
    assert len([c for c in one.columns if c.startswith("train/gns/")]) == 3 * 5  # ln_1, ln_2 x 2, ln_f
    for c in compared_columns(one):  # float16 rounding differs with the per-rank batch
        assert two[c].to_numpy() == pytest.approx(one[c].to_numpy(), rel=1e-3, nan_ok=True), c
    assert torch.load(tmp_path / "two" / "ckpt.pt", weights_only=False)["scaler"]["scale"] > 0


@pytest.mark.slow
def test_a_signalled_fsdp_run_checkpoints_on_every_rank_and_resumes(tiny_dataset, tmp_path):
    """A preemption's SIGTERM reaches the ranks: they agree, gather the checkpoint together and stop;
    the resumed FSDP run continues log.csv and tokens_processed from there."""
    import signal
    import time
    out = tmp_path / "out"
    flags = [*TINY, f"--dataset={tiny_dataset}", f"--out_dir={out}", "--eval_interval=1000", "--backend=gloo",
             "--lnclass=shim", "--fsdp=True", *TWO]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                os.path.join(REPO, "train.py")]
    proc = subprocess.Popen([*launcher, *flags, "--max_iters=100000"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
                            start_new_session=True)
    try:
        end = time.time() + 120
        while not ((out / "log.csv").exists() and len((out / "log.csv").read_text().splitlines()) > 3):
            assert proc.poll() is None and time.time() < end, proc.communicate()
            time.sleep(0.1)
        with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:  # the ranks, not the launcher
            ranks = [int(pid) for pid in f.read().split()]
        assert len(ranks) == 2
        for pid in ranks:
            os.kill(pid, signal.SIGTERM)
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:  # the launcher and its ranks: orphaned ranks would hold the pipes open
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    done = torch.load(out / "ckpt.pt", weights_only=False)["iter_num"]
    df = pd.read_csv(out / "log.csv")
    assert done >= 3 and df.step.tolist() == list(range(done))
    run_train(*flags, "--init_from=resume", f"--max_iters={done + 2}", torchrun_procs=2)
    df = pd.read_csv(out / "log.csv")
    assert df.step.tolist() == list(range(done + 2))
    assert df.tokens_processed.tolist() == [(i + 1) * 8 * 16 for i in range(done + 2)]
    assert df["train/gns/transformer.ln_f.weight/pegn"].notna().all() and df["train/lossf"].notna().all()
    assert torch.load(out / "ckpt.pt", weights_only=False)["iter_num"] == done + 2
