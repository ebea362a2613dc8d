"""train.py end to end on CPU, as a user runs it: training lowers the loss, resume continues
exactly, the LR follows the token schedule, bad input fails cleanly, DDP on gloo runs."""
import os
import re
import subprocess
import sys

import pandas as pd
import pytest
import torch

from conftest import REPO, TINY, run_train


def load_log_rows(out_dir):
    return len(pd.read_csv(os.path.join(out_dir, "log.csv")))


def val_losses(stdout):
    return [(int(s), float(v)) for s, v in re.findall(r"step (\d+): train loss [\d.]+, val loss ([\d.]+)", stdout)]


def test_short_run_lowers_val_loss_and_checkpoints(tiny_dataset, tmp_path):
    out = tmp_path / "out"
    p = run_train(*TINY, f"--dataset={tiny_dataset}", f"--out_dir={out}", "--max_iters=60",
                  "--eval_interval=30", "--learning_rate=3e-3", "--warmup_tokens=640",
                  "--lr_decay_tokens=3840", "--min_lr=3e-4")
    losses = val_losses(p.stdout)
    assert [s for s, _ in losses] == [0, 30, 60]  # evals at 0, 30 and the final one
    assert losses[-1][1] < losses[0][1] - 0.5
    ckpt = torch.load(out / "ckpt.pt", weights_only=False)
    assert ckpt['iter_num'] == 60
    assert ckpt['model']['tokens_processed'].item() == 60 * 4 * 16


def test_resume_continues_iter_num_and_tokens_exactly(tiny_dataset, tmp_path):
    out = tmp_path / "out"
    common = [*TINY, f"--dataset={tiny_dataset}", f"--out_dir={out}", "--eval_interval=5",
              "--gradient_accumulation_steps=2",
              "--linearclass=gns", "--embeddingclass=gns", "--lnclass=fused"]
    run_train(*common, "--max_iters=5")
    assert load_log_rows(out) == 5  # the final evaluation is on step 4's row
    ckpt = torch.load(out / "ckpt.pt", weights_only=False)
    assert ckpt['iter_num'] == 5 and ckpt['model']['tokens_processed'].item() == 5 * 2 * 4 * 16
    p = run_train(*common, "--max_iters=8", "--init_from=resume")
    iters = [int(i) for i in re.findall(r"^iter (\d+):", p.stdout, re.M)]
    assert iters == [6, 7, 8]
    toks = [int(t.replace(',', '')) for t in re.findall(r"tokens ([\d,]+),", p.stdout)]
    assert toks == [i * 2 * 4 * 16 for i in (6, 7, 8)]
    ckpt = torch.load(out / "ckpt.pt", weights_only=False)
    assert ckpt['iter_num'] == 8 and ckpt['model']['tokens_processed'].item() == 8 * 2 * 4 * 16
    # log.csv holds both runs, once each: steps 0-7, each with its GNS; the final evaluations of
    # both runs sit on their last steps' rows (4 and 7) and the one at 5 on step 5's
    from csv_tools import load_log
    df = load_log(out)[0]
    assert df.step.tolist() == list(range(8)) and (df.iter_num == df.step).all()
    assert df.tokens_processed.tolist() == [i * 2 * 4 * 16 for i in range(1, 9)]
    assert df["train/gns/transformer.ln_f.weight/batch_size"].tolist() == [8] * 8
    assert df["val/loss"].notna().tolist() == [True, False, False, False, True, True, False, True]
    # the status line's GNS, carried across the resume, is gns-analysis.py's total over both runs
    printed = float(re.findall(r", gns ([\d.e+-]+)$", p.stdout, re.M)[-1])
    subprocess.run([sys.executable, os.path.join(REPO, "gns-analysis.py"), str(out), "--no-plots"],
                   check=True, capture_output=True)
    last = pd.read_csv(out / "gns_analysis.csv").dropna(subset=["total/gns"]).iloc[-1]
    assert last["step"] == 7
    eps = 1e-8  # what the status line's estimator clamps each average to (ddpgns.GradientNoiseScale)
    expected = max(last["total/trace_ema"], eps) / max(last["total/sq_norm_ema"], eps)
    assert printed == pytest.approx(expected, rel=1e-3)  # printed to 4 significant digits


def test_lr_follows_the_token_schedule(tiny_dataset, tmp_path):
    # 64 tokens per step: warmup over 256 tokens (4 steps), linear decay to min_lr at 640 (10 steps)
    p = run_train(*TINY, f"--dataset={tiny_dataset}", f"--out_dir={tmp_path}", "--max_tokens=768",
                  "--eval_interval=1000", "--learning_rate=1e-3", "--min_lr=1e-4",
                  "--warmup_tokens=256", "--lr_decay_tokens=640")
    lrs = [float(x) for x in re.findall(r"lr ([\d.e+-]+),", p.stdout)]
    assert len(lrs) == 12  # stops on max_tokens: 768 / 64
    expected = [1e-3 * min(1, 64 * i / 256) if 64 * i <= 256 else
                max(1e-4, 1e-3 + (64 * i - 256) / (640 - 256) * (1e-4 - 1e-3)) for i in range(1, 13)]
    assert lrs == pytest.approx(expected, rel=1e-3)


@pytest.mark.parametrize("args, words", [
    (["--no_such_key=1"], "unknown config key"),
    (["--batch_size=big"], "--batch_size expects int"),
    (["--linearclass=fast"], "--linearclass='fast' is not one of nn, gns, shim"),
    (["--lnclass=gns"], "--lnclass='gns' is not one of nn, shim, fused"),
    (["--init_from=resume"], "no checkpoint"),
    (["--dataset=not_prepared_anywhere"], "python data/not_prepared_anywhere/prepare.py"),
    (["--init_from=gpt5"], "--init_from='gpt5' is not one of"),
])
def test_bad_input_is_one_line_and_nonzero(tiny_dataset, tmp_path, args, words):
    p = run_train(*TINY, f"--dataset={tiny_dataset}", f"--out_dir={tmp_path / 'empty'}", *args, check=False)
    assert p.returncode != 0
    assert "Traceback" not in p.stderr
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and words in err[0], p.stderr


@pytest.mark.slow
def test_ddp_on_cpu_with_gloo(tiny_dataset, tmp_path):
    out = tmp_path / "out"
    p = run_train(*TINY, f"--dataset={tiny_dataset}", f"--out_dir={out}", "--max_iters=4",
                  "--eval_interval=2", "--gradient_accumulation_steps=2", "--backend=gloo",
                  torchrun_procs=2)
    # two ranks of one micro-step each: 2 * 4 * 16 tokens per iteration
    toks = [int(t.replace(',', '')) for t in re.findall(r"tokens ([\d,]+),", p.stdout)]
    assert toks == [128, 256, 384, 512]
    assert torch.load(out / "ckpt.pt", weights_only=False)['iter_num'] == 4


@pytest.mark.slow
def test_ddp_accumulation_not_divisible_by_processes_says_what_to_use(tiny_dataset, tmp_path):
    p = run_train(*TINY, f"--dataset={tiny_dataset}", f"--out_dir={tmp_path}", "--backend=gloo",
                  torchrun_procs=2, check=False)  # TINY has gradient_accumulation_steps=1
    assert p.returncode != 0
    assert "use --gradient_accumulation_steps=2 or a multiple" in p.stderr


def test_default_dtype_follows_cuda():
    """nanoGPT's default where CUDA is (bfloat16 if supported, else float16); float32 without it,
    where autocast would emulate float16 on the CPU, many times slower."""
    if torch.cuda.is_available():
        want = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    else:
        want = "float32"
    assert f"--dtype={want!r}" in run_train("--help").stdout


def read_log(out_dir):
    import pandas as pd
    return pd.read_csv(os.path.join(out_dir, "log.csv"))


GNS_OPTIONS = [
    # every value of every option at least once; all-layer measurement in several forms
    dict(linearclass="gns", embeddingclass="gns", lnclass="shim"),
    dict(linearclass="shim", embeddingclass="shim", lnclass="fused"),
    dict(linearclass="gns", embeddingclass="shim", lnclass="nn", gns_hooks="sogns", microbatch_gns=True),
    dict(linearclass="nn", embeddingclass="gns", lnclass="fused", gns_hooks="exact"),
]


@pytest.mark.slow
@pytest.mark.parametrize("opts", GNS_OPTIONS, ids=lambda o: "-".join(str(v) for v in o.values()))
def test_every_gns_option_trains_and_logs_its_columns(tiny_dataset, tmp_path, opts):
    out = tmp_path / "out"
    flags = [f"--{k}={v}" for k, v in opts.items()]
    run_train(*TINY, f"--dataset={tiny_dataset}", f"--out_dir={out}", "--max_iters=4", "--eval_interval=2",
              "--gradient_accumulation_steps=2", *flags)
    df = read_log(out)
    assert list(df["iter_num"]) == [0, 1, 2, 3]  # four steps, the final evaluation on the last one's row
    cols = set(df.columns)
    measured = {c.split("/")[2] for c in cols if c.startswith("train/gns/")}
    if opts["lnclass"] != "nn":
        assert "transformer.ln_f.weight" in measured
    if opts["linearclass"] != "nn":
        assert "transformer.h.0.mlp.c_fc.weight" in measured
    if opts["embeddingclass"] != "nn":
        assert "transformer.wpe.weight" in measured
    if opts["linearclass"] != "nn" and opts["embeddingclass"] != "nn":
        assert "transformer.wte.weight" in measured  # the tied weight, measured exactly
    for prefix in {"sogns": ["train/sogns/"], "exact": ["train/gnshooks/"]}.get(opts.get("gns_hooks"), []):
        assert any(c.startswith(prefix) for c in cols)
    if opts.get("microbatch_gns"):
        assert any(c.startswith("train/microbatch_gns/") and c.endswith("/small_batch_size") for c in cols)
    gns_cols = [c for c in cols if c.startswith("train/") and c.count("/") >= 3]  # train/<estimator>/<param>/<what>
    steps = df  # every row is a training step with its GNS: readers that check each row's batch size rely on it
    assert steps[gns_cols].notna().all().all() and (steps[gns_cols].abs() < float("inf")).all().all()
    assert (steps["train/gns/transformer.h.0.ln_1.weight/batch_size" if opts["lnclass"] != "nn"
                  else "train/gns/transformer.wpe.weight/batch_size"] == 8).all()  # 2 micro-steps x 4


def test_no_clipping_still_logs_grad_norm(tiny_dataset, tmp_path):
    out = tmp_path / "out"
    run_train(*TINY, f"--dataset={tiny_dataset}", f"--out_dir={out}", "--max_iters=3", "--eval_interval=100",
              "--grad_clip=0.0", "--lnclass=shim")
    df = read_log(out)
    steps = df[df["iter_num"] < 3]
    assert len(steps) == 3 and (steps["grad_norm"] > 0).all()


@pytest.mark.slow
def test_ddp_per_example_gns_equals_one_process_on_the_same_global_batch(tiny_dataset, tmp_path):
    """Each rank's buffers hold norms of its own slice of the global batch; after the all-reduce
    and the B_rank^2/B rescaling, 2 ranks x 2 examples log what 1 process x 4 examples logs."""
    common = [*TINY, f"--dataset={tiny_dataset}", "--max_iters=3", "--eval_interval=100",
              "--linearclass=gns", "--embeddingclass=gns", "--lnclass=shim",
              "--backend=gloo"]
    # gradient_accumulation_steps is global (nanoGPT): 2 micro-steps per process in both runs
    run_train(*common, f"--out_dir={tmp_path / 'one'}", "--batch_size=4", "--gradient_accumulation_steps=2")
    p = run_train(*common, f"--out_dir={tmp_path / 'two'}", "--batch_size=2", "--gradient_accumulation_steps=4",
                  torchrun_procs=2)
    one, two = read_log(tmp_path / "one"), read_log(tmp_path / "two")
    gns_cols = [c for c in one.columns if c.startswith("train/gns/")]
    assert len(gns_cols) == 3 * 15  # every parameter (bias=False): 6 per block x 2, ln_f, wte (tied), wpe
    assert set(gns_cols) <= set(two.columns)
    steps = one["iter_num"] < 3
    for c in gns_cols:
        assert two.loc[steps, c].to_numpy() == pytest.approx(one.loc[steps, c].to_numpy(), rel=1e-4), c
    # the DDP estimator is logged beside it, finite
    assert (two.loc[steps, "ddp/small_batch_size"] == 4).all() and (two.loc[steps, "ddp/big_batch_size"] == 8).all()
    assert two.loc[steps, "ddp/gns"].notna().all()
    assert "ddp gns" in p.stdout
