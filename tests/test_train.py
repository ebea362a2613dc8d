"""train.py end to end on CPU, as a user runs it: training lowers the loss, resume continues
exactly, the LR follows the token schedule, bad input fails cleanly, DDP on gloo runs."""
import json
import math
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch

from conftest import REPO, TINY, made_once, run_train


def train_until_exit(*args):
    """(exit code, stderr) of train.py run in this process until it exits: for the checks that
    stop it before any work, without paying a fresh interpreter's import of torch each time."""
    import contextlib
    import io
    import runpy
    import warnings
    import signal
    saved = sys.argv, warnings.formatwarning, signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    sys.argv = [os.path.join(REPO, "train.py"), *args]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(sys.argv[0], run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code
    finally:
        sys.argv, warnings.formatwarning = saved[:2]
        signal.signal(signal.SIGINT, saved[2])
        signal.signal(signal.SIGTERM, saved[3])
    return code, err.getvalue()


def load_log_rows(out_dir):
    return len(pd.read_csv(os.path.join(out_dir, "log.csv")))


def val_losses(stdout):
    return [(int(s), float(v)) for s, v in re.findall(r"step (\d+): train loss [\d.]+, val loss ([\d.]+)", stdout)]


def test_train_py_stays_a_file_read_in_one_sitting():
    # nanoGPT's train.py is 336 lines; ours holds what it adds in other modules and stays within 386
    # (its flags are its own: the mixture of experts' three took it from 382)
    with open(os.path.join(REPO, "train.py")) as f:
        assert len(f.read().splitlines()) <= 386


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


def test_the_same_command_run_twice_keeps_the_first_runs_log_and_checkpoint(tiny_dataset, tmp_path):
    # nanoGPT users rerun the command as it was: the second run trains afresh, the first is kept aside
    out = tmp_path / "out"
    args = (*TINY, f"--dataset={tiny_dataset}", f"--out_dir={out}", "--eval_interval=100")
    run_train(*args, "--max_iters=6")
    first_log, first_ckpt = (out / "log.csv").read_bytes(), (out / "ckpt.pt").read_bytes()
    p = run_train(*args, "--max_iters=3")
    (kept,) = [d for d in out.iterdir() if d.name.startswith("previous-run-")]
    assert (kept / "log.csv").read_bytes() == first_log and (kept / "ckpt.pt").read_bytes() == first_ckpt
    assert load_log_rows(kept) == 6 and load_log_rows(out) == 3
    assert f"moved into {kept}/" in p.stdout


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
    assert iters == [5, 6, 7]  # nanoGPT's numbering: the iteration just done, log.csv's step
    toks = [int(t.replace(',', '')) for t in re.findall(r"tokens ([\d,]+),", p.stdout)]
    assert toks == [i * 2 * 4 * 16 for i in (6, 7, 8)]
    ckpt = torch.load(out / "ckpt.pt", weights_only=False)
    assert ckpt['iter_num'] == 8 and ckpt['model']['tokens_processed'].item() == 8 * 2 * 4 * 16
    # log.csv holds both runs, once each: steps 0-7, each with its GNS; the final evaluations of
    # both runs sit on their last steps' rows (4 and 7) and the one at 5 on step 5's
    from nanogns.logread import load_log
    df = load_log(out)[0]
    assert df.step.tolist() == list(range(8)) and (df.iter_num == df.step).all()
    assert df.tokens_processed.tolist() == [i * 2 * 4 * 16 for i in range(1, 9)]
    assert df["train/gns/transformer.ln_f.weight/batch_size"].tolist() == [8] * 8
    assert df["val/loss"].notna().tolist() == [True, False, False, False, True, True, False, True]
    # the tokens the evaluated models had seen: before the row's step, after it for a final evaluation
    assert df["eval_tokens"].dropna().tolist() == [0, 5 * 128, 5 * 128, 8 * 128]
    # the status line's GNS, carried across the resume, is gns-analysis.py's total over both runs
    printed = float(re.findall(r", gns ([\d.e+-]+)$", p.stdout, re.M)[-1])
    subprocess.run([sys.executable, os.path.join(REPO, "gns-analysis.py"), str(out), "--no-plots"],
                   check=True, capture_output=True)
    last = pd.read_csv(out / "gns_analysis.csv").dropna(subset=["total/gns"]).iloc[-1]
    assert last["step"] == 7
    eps = 1e-8  # what the status line's estimator clamps each average to (ddpgns.GradientNoiseScale)
    expected = max(last["total/trace_ema"], eps) / max(last["total/sq_norm_ema"], eps)
    assert printed == pytest.approx(expected, rel=1e-3)  # printed to 4 significant digits


@pytest.mark.parametrize("shape", ["linear", "cosine"])
def test_lr_follows_the_token_schedule(tiny_dataset, tmp_path, shape):
    # 64 tokens per step: warmup over 256 tokens (4 steps), decay to min_lr at 640 (10 steps)
    p = run_train(*TINY, f"--dataset={tiny_dataset}", f"--out_dir={tmp_path}", "--max_tokens=768",
                  "--eval_interval=1000", "--learning_rate=1e-3", "--min_lr=1e-4",
                  "--warmup_tokens=256", "--lr_decay_tokens=640", f"--lr_decay_shape={shape}")
    lrs = [float(x) for x in re.findall(r"lr ([\d.e+-]+),", p.stdout)]
    assert len(lrs) == 12  # stops on max_tokens: 768 / 64

    def decay(frac):  # linear, or nanoGPT's half cosine
        return frac if shape == "linear" else 0.5 * (1 - math.cos(math.pi * frac))
    expected = [1e-3 * min(1, 64 * i / 256) if 64 * i <= 256 else
                1e-3 + decay(min(1, (64 * i - 256) / (640 - 256))) * (1e-4 - 1e-3) for i in range(1, 13)]
    assert lrs == pytest.approx(expected, rel=1e-3)


@pytest.mark.parametrize("args, words", [
    (["--no_such_key=1"], "unknown config key"),
    (["--batch_size=big"], "--batch_size expects int"),
    (["--linearclass=fast"], "--linearclass='fast' is not one of nn, gns, shim"),
    (["--per_example_mode=sometimes"], "--per_example_mode='sometimes' is not one of auto, shapes, ghost, materialise"),
    (["--lnclass=gns"], "--lnclass='gns' is not one of nn, shim, fused"),
    (["--init_from=resume"], "no checkpoint"),
    (["--dataset=not_prepared_anywhere"], "there is no data/not_prepared_anywhere/prepare.py; prepared datasets: "),
    (["--init_from=gpt5"], "--init_from='gpt5' is not one of"),
    (["--bs_controller=gns", "--bs_schedule=True"], "--bs_controller=gns and --bs_schedule=True both set the batch size"),
    (["--bs_controller=pid"], "--bs_controller='pid' is not one of none, gns"),
    (["--bs_gns_group=Linear"], "--bs_gns_group='Linear' is not one of total, LayerNorm"),
    (["--bs_gns_fraction=0"], "--bs_gns_fraction=0.0 must be a number > 0"),
    (["--bs_min_accum=3"], "--bs_min_accum=3 is above --gradient_accumulation_steps=1"),
    (["--bs_update_tokens=-1"], "--bs_update_tokens=-1 must be a whole number >= 0"),
    (["--bs_controller=gns", "--bs_gns_group=LayerNorm", "--linearclass=gns"],
     "--bs_gns_group=LayerNorm but this run measures the GNS of total only"),
])
def test_bad_input_is_one_line_and_nonzero(tiny_dataset, tmp_path, args, words):
    code, stderr = train_until_exit(*TINY, f"--dataset={tiny_dataset}", f"--out_dir={tmp_path / 'empty'}", *args)
    assert code == 2
    err = stderr.strip().splitlines()
    assert len(err) == 1 and words in err[0], stderr


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
    assert p.returncode != 0  # torchrun's own: 1, with its failure summary (each rank exited 2)
    assert "use --gradient_accumulation_steps=2 or a multiple" in p.stderr
    said = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert len(said) == 1, p.stderr  # once, not once per rank


def test_default_dtype_follows_cuda():
    """nanoGPT's default where CUDA is (bfloat16 if supported, else float16); float32 without it,
    where autocast would emulate float16 on the CPU, many times slower."""
    if torch.cuda.is_available():
        want = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    else:
        want = "float32"
    out = run_train("--help").stdout
    assert f"--dtype={want!r}" in out
    # each key with what its comment in train.py says
    assert any(line.startswith("  --grad_clip=1.0") and line.endswith("clip gradients at this norm, or disable if == 0.0")
               for line in out.splitlines())


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
    for prefix in {"sogns": ["train/sogns/"], "exact": ["train/hooks_gns/"]}.get(opts.get("gns_hooks"), []):
        assert any(c.startswith(prefix) for c in cols)
    # the reference's readers take every column starting with train/gns (and containing it) for its own
    assert all(c.startswith("train/gns/") for c in cols if "train/gns" in c)
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


# -- drop-in for nanoGPT's and the reference implementation's users -------------------------------

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
TINY_MODEL = ["--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=16", "--batch_size=4",
              "--gradient_accumulation_steps=1", "--eval_iters=2", "--log_interval=1", "--dropout=0.0",
              "--device=cpu", "--dtype=float32", "--compile=False", "--device_name='M1_eflops'"]


@pytest.mark.parametrize("config_file", ["nanogpt_train_shakespeare_char.py", "nanogpt_train_gpt2.py"])
def test_nanogpt_config_files_run_with_their_iteration_lengths(tiny_dataset, tmp_path, config_file):
    """nanoGPT's own configs set max_iters, lr_decay_iters and warmup_iters: iterations, converted
    here with one iteration's tokens (they stopped with "unknown key 'lr_decay_iters'")."""
    out = tmp_path / "out"
    p = run_train(os.path.join(FIXTURES, config_file), *TINY_MODEL, f"--dataset={tiny_dataset}",
                  f"--out_dir={out}", "--max_iters=3", "--eval_interval=2")
    iters = [int(i) for i in re.findall(r"^iter (\d+):", p.stdout, re.M)]
    assert iters == [0, 1, 2]  # max_iters counts iterations, as in nanoGPT, and numbers them from 0 as it does
    lrs = [float(x) for x in re.findall(r"lr ([\d.e+-]+),", p.stdout)]
    warmup = 100 if "shakespeare" in config_file else 2000  # warmup_iters there, nanoGPT's default here
    learning_rate = 1e-3 if "shakespeare" in config_file else 6e-4
    # linear warmup over warmup_iters iterations' tokens (64 per iteration), at the end of each step
    assert lrs == pytest.approx([learning_rate * i / warmup for i in (1, 2, 3)], rel=1e-3)
    assert [s for s, _ in val_losses(p.stdout)] == [0, 3]  # the one due at 2 is the last step's: after it


@pytest.mark.parametrize("args, words", [
    (["--max_iters=3", "--max_tokens=1000"], "--max_tokens and --max_iters set the same length twice"),
    (["--max_iters=3", "--warmup_iters=1", "--warmup_tokens=64"], "--warmup_tokens and --warmup_iters"),
    (["--max_iters=3", "--lr_decay_iters=1", "--lr_decay_tokens=64"], "--lr_decay_tokens and --lr_decay_iters"),
])
def test_a_length_in_both_units_is_one_clear_error(tiny_dataset, tmp_path, args, words):
    code, stderr = train_until_exit(*TINY, f"--dataset={tiny_dataset}", f"--out_dir={tmp_path / 'o'}", *args)
    assert code == 2 and len(stderr.strip().splitlines()) == 1 and words in stderr


NANOGPT_CPU_COMMAND = ["--device=cpu", "--compile=False", "--eval_iters=20", "--log_interval=1", "--block_size=64",
                       "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128", "--max_iters=2000",
                       "--lr_decay_iters=2000", "--dropout=0.0"]  # nanoGPT's README, for CPU users


def lrs_and_iters(stdout):
    return ([float(x) for x in re.findall(r"lr ([\d.e+-]+),", stdout)],
            [int(i) for i in re.findall(r"^iter (\d+):", stdout, re.M)])


@pytest.mark.slow
def test_status_lines_reach_a_redirected_file_line_by_line(tiny_dataset, tmp_path):
    """A run whose stdout goes to a file (nohup, a cluster's job log) shows each iteration's line when
    it is printed: a run killed mid-way keeps them (block buffering held them back, then lost them)."""
    import time
    out, stdout = tmp_path / "o", tmp_path / "train.out"
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    with open(stdout, "w") as f:
        p = subprocess.Popen([sys.executable, os.path.join(REPO, "train.py"), *TINY, f"--dataset={tiny_dataset}",
                              f"--out_dir={out}", "--max_iters=100000", "--eval_interval=100000"],
                             stdout=f, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (os.path.exists(out / "log.csv") and load_log_rows(out) >= 3):
            time.sleep(0.2)
        p.kill()
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    iters = [int(i) for i in re.findall(r"^iter (\d+):", stdout.read_text(), re.M)]
    assert len(iters) >= 3 and iters[:3] == [0, 1, 2], stdout.read_text()[-2000:]


def test_nanogpts_readme_command_runs_on_our_shakespeare_config(tiny_dataset, tmp_path):
    """nanoGPT's CPU command line, its --max_iters cut to 3 (appended: a later setting wins), on our
    config file: it stopped with "set the same length twice" when the file set max_tokens."""
    p = run_train(os.path.join(REPO, "config", "train_shakespeare_char.py"), *NANOGPT_CPU_COMMAND,
                  "--max_iters=3", f"--dataset={tiny_dataset}", f"--out_dir={tmp_path / 'o'}")
    lrs, iters = lrs_and_iters(p.stdout)
    assert iters == [0, 1, 2]
    assert lrs == pytest.approx([1e-3 * i / 100 for i in (1, 2, 3)], rel=1e-3)  # the file's 100 warmup iterations


@pytest.mark.parametrize("override, iters, lr_at", [
    (["--max_iters=3"], [0, 1, 2], lambda i: 1e-3 * (i + 1) / 100),  # the file's warmup_tokens: 100 of its iterations
    (["--max_iters=4", "--warmup_iters=2", "--lr_decay_iters=4"], [0, 1, 2, 3],  # warmup, then linear... to min_lr
     lambda i: 1e-3 * (i + 1) / 2 if i < 2 else None),
])
def test_command_line_iterations_replace_the_cpu_configs_tokens(tiny_dataset, tmp_path, override, iters, lr_at):
    p = run_train(os.path.join(REPO, "config", "train_shakespeare_char_cpu.py"), *TINY, *override,
                  "--batch_size=12", "--block_size=64", f"--dataset={tiny_dataset}", f"--out_dir={tmp_path / 'o'}")
    lrs, seen = lrs_and_iters(p.stdout)
    assert seen == iters
    for i, lr in zip(seen, lrs):
        if lr_at(i) is not None:
            assert lr == pytest.approx(lr_at(i), rel=1e-3)
    assert "replaces max_tokens=" in p.stdout
    if "--lr_decay_iters=4" in override:
        assert lrs[-1] == pytest.approx(1e-4, rel=1e-3)  # decayed to min_lr over the 4 iterations given
        assert "replaces warmup_tokens=" in p.stdout and "replaces lr_decay_tokens=" in p.stdout


def test_a_config_file_length_replaces_an_earlier_files_other_unit(tiny_dataset, tmp_path):
    """Places apply in order: a later file's max_iters replaces an earlier file's max_tokens; both in
    one file stays an error."""
    first, second, both = tmp_path / "first.py", tmp_path / "second.py", tmp_path / "both.py"
    first.write_text("max_tokens = 10_000\n")
    second.write_text("max_iters = 2\n")
    both.write_text("max_tokens = 10_000\nmax_iters = 2\n")
    p = run_train(str(first), str(second), *TINY, f"--dataset={tiny_dataset}", f"--out_dir={tmp_path / 'o'}")
    assert lrs_and_iters(p.stdout)[1] == [0, 1]
    code, stderr = train_until_exit(str(both), *TINY, f"--dataset={tiny_dataset}", f"--out_dir={tmp_path / 'x'}")
    assert code == 2 and len(stderr.strip().splitlines()) == 1 and "same length twice" in stderr and "both.py" in stderr


def foreign_checkpoint(ckpt, kind):
    """Our checkpoint dict rewritten the way nanoGPT or the reference implementation writes it."""
    sd = ckpt["model"]
    if kind == "nanogpt":
        # no tokens_processed, torch.compile's prefix, nanoGPT's model_args and config, the loss a tensor
        model = {"_orig_mod." + k: v for k, v in sd.items() if k != "tokens_processed"}
        args = {k: ckpt["model_args"][k] for k in ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size", "dropout")}
        config = {k: ckpt["config"][k] for k in ("gradient_accumulation_steps", "batch_size", "block_size", "dataset")}
        return dict(model=model, optimizer=ckpt["optimizer"], model_args=args, iter_num=ckpt["iter_num"],
                    best_val_loss=torch.tensor(ckpt["best_val_loss"]), config=config)
    # the reference: c_attn inside a FusedQKVLinear, the separated LayerNorm's gain in .affine (and a
    # zero bias buffer when bias=False), [sum, count] buffers, no fp32_attention_layers, no scaler
    model = {}
    for k, v in sd.items():
        k = k.replace(".attn.c_attn.", ".attn.c_attn.qkv.")
        k = re.sub(r"\.(ln_\w+)\.", r".\1.affine.", k)
        model[k] = v
        if k != "tokens_processed":
            model[k + "_upegsqnorm"] = torch.tensor([3.0, 4.0])
    for ln in {k.rsplit(".", 1)[0] for k in model if ".affine.weight" in k and not k.endswith("_upegsqnorm")}:
        model.setdefault(ln + ".bias", torch.zeros_like(model[ln + ".weight"]))
    args = {k: v for k, v in ckpt["model_args"].items() if k != "fp32_attention_layers"}
    config = {k: v for k, v in ckpt["config"].items() if k != "seed"}
    return dict(model=model, optimizer=ckpt["optimizer"], model_args=args, iter_num=ckpt["iter_num"],
                best_val_loss=ckpt["best_val_loss"], config=config)


@pytest.fixture(scope="module")
def three_step_run(tiny_dataset, tmp_path_factory):
    """A run of ours after 3 steps, and what its checkpoint evaluates to."""
    def make(folder):
        common = [*TINY, f"--dataset={tiny_dataset}", "--eval_interval=3", f"--out_dir={folder / 'out'}"]
        run_train(*common, "--max_iters=3", "--lnclass=shim")
        (folder / "eval.txt").write_text(run_train(*common, "--init_from=resume", "--eval_only=True").stdout)
    folder = made_once(tmp_path_factory, "three_steps", make)
    return folder / "out", val_losses((folder / "eval.txt").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["nanogpt", "reference"])
def test_resume_from_a_nanogpt_or_reference_checkpoint(tiny_dataset, three_step_run, tmp_path, kind):
    ours, our_eval = three_step_run
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    torch.save(foreign_checkpoint(torch.load(ours / "ckpt.pt", weights_only=False), kind), theirs / "ckpt.pt")
    common = [*TINY, f"--dataset={tiny_dataset}", "--eval_interval=3", f"--out_dir={theirs}", "--init_from=resume"]
    # the same weights evaluate the same
    assert val_losses(run_train(*common, "--eval_only=True").stdout) == our_eval and our_eval[0][0] == 3
    # and training goes on from there, counting tokens on (nanoGPT's: its 3 iterations of 64 tokens)
    p = run_train(*common, "--max_iters=5", "--lnclass=shim")
    toks = [int(t.replace(',', '')) for t in re.findall(r"tokens ([\d,]+),", p.stdout)]
    assert toks == [4 * 64, 5 * 64]
    assert torch.load(theirs / "ckpt.pt", weights_only=False)["model"]["tokens_processed"].item() == 5 * 64


@pytest.fixture(scope="module")
def one_step_run(tiny_dataset, tmp_path_factory):
    make = lambda folder: run_train(*TINY, f"--dataset={tiny_dataset}", f"--out_dir={folder / 'out'}", "--max_iters=1")
    return made_once(tmp_path_factory, "one_step", make) / "out"


def flipped(data, offset, count=64):
    """data with `count` bytes from `offset` on XORed with 0xFF."""
    return data[:offset] + bytes(b ^ 0xFF for b in data[offset:offset + count]) + data[offset + count:]


@pytest.mark.parametrize("damage", ["truncated", "empty", "random bytes", "not a checkpoint", "wrong model",
                                    "non-finite weights", "64 bytes flipped in the middle", "a moment's bytes flipped"])
def test_resume_on_a_damaged_checkpoint_is_one_line(tiny_dataset, one_step_run, tmp_path, damage):
    out = tmp_path / "out"
    shutil.copytree(one_step_run, out)
    path = out / "ckpt.pt"
    good = path.read_bytes()
    if damage == "64 bytes flipped in the middle":  # trained on from damaged weights, without a word
        path.write_bytes(flipped(good, len(good) // 2))
    elif damage == "a moment's bytes flipped":  # NaN moments: the run diverged, blaming the learning rate
        moments = [s["exp_avg_sq"] for s in torch.load(path, weights_only=False)["optimizer"]["state"].values()]
        path.write_bytes(flipped(good, good.index(max(moments, key=torch.numel).numpy().tobytes())))
    elif damage == "truncated":
        path.write_bytes(good[:len(good) // 2])
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "random bytes":
        path.write_bytes(os.urandom(5000))
    elif damage == "not a checkpoint":
        torch.save({"weights": torch.zeros(3)}, path)
    elif damage == "non-finite weights":  # not to be blamed on the learning rate after max_nonfinite_steps steps
        ckpt = torch.load(path, weights_only=False)
        ckpt["model"]["lm_head.weight"][0, 0] = float("nan")
        torch.save(ckpt, path)
    else:
        ckpt = torch.load(path, weights_only=False)
        ckpt["model"]["transformer.wpe.weight"] = torch.zeros(99, 32)
        torch.save(ckpt, path)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != "train.lock"}
    code, stderr = train_until_exit(*TINY, f"--dataset={tiny_dataset}", f"--out_dir={out}",
                                    "--init_from=resume", "--max_iters=2")
    assert code == 2
    err = stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --init_from=resume:") and "ckpt.pt" in err[0], stderr
    assert damage != "non-finite weights" or "ckpt.pt: the checkpoint holds non-finite weights" in err[0], stderr
    assert "flipped" not in damage or f"{path} is damaged: its record data/" in err[0], stderr
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != "train.lock"} == before


@pytest.mark.parametrize("checkpoint_kind", ["fingerprinted", "older, named only"])
def test_resume_on_another_dataset_of_the_same_shapes_is_one_line(tiny_dataset, one_step_run, tmp_path,
                                                                   checkpoint_kind):
    # the same vocabulary and so the same shapes: only the dataset itself tells the runs apart
    other = tmp_path / "otherdata"
    shutil.copytree(tiny_dataset, other)
    tokens = np.fromfile(other / "train.bin", dtype=np.uint16)
    tokens[: len(tokens) // 2].tofile(other / "train.bin")
    out = tmp_path / "out"
    shutil.copytree(one_step_run, out)
    # the dataset the checkpoint names: one_step_run is made once per test run, by whichever test worker came
    # first, with that worker's own copy of the tiny dataset
    trained_on = torch.load(out / "ckpt.pt", weights_only=False)["config"]["dataset"]
    if checkpoint_kind != "fingerprinted":
        ckpt = torch.load(out / "ckpt.pt", weights_only=False)
        del ckpt["dataset_fingerprint"]
        torch.save(ckpt, out / "ckpt.pt")
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != "train.lock"}
    code, stderr = train_until_exit(*TINY, f"--dataset={other}", f"--out_dir={out}", "--init_from=resume",
                                    "--max_iters=2")
    assert code == 2, stderr
    err = stderr.strip().splitlines()
    assert len(err) == 1 and f"was trained on --dataset={trained_on!r}, this run reads --dataset={str(other)!r}" in err[0]
    assert "nothing was changed" in err[0]
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != "train.lock"} == before


@pytest.mark.parametrize("init_from", ["scratch", "resume"])
def test_a_read_only_out_dir_is_one_line_and_changes_nothing(tiny_dataset, one_step_run, tmp_path, init_from):
    """A fresh run into a read-only out_dir holding a run said it 'could not be moved aside: resume it';
    a resume took the lock (train.lock, left by the run, writable) and failed at the first file it wrote."""
    from test_runlog import unwritable
    out = tmp_path / "out"
    shutil.copytree(one_step_run, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with unwritable(out):
        code, stderr = train_until_exit(*TINY, f"--dataset={tiny_dataset}", f"--out_dir={out}", f"--init_from={init_from}",
                                        "--max_iters=2")
    assert code == 2
    assert stderr.strip().splitlines() == [f"error: --out_dir={out} cannot be written (permission denied): make it "
                                           f"writable, or use another out_dir"], stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_resume_on_the_same_dataset_moved_elsewhere_goes_on(tiny_dataset, one_step_run, tmp_path):
    moved = tmp_path / "moved" / "renamed"
    shutil.copytree(tiny_dataset, moved)
    out = tmp_path / "out"
    shutil.copytree(one_step_run, out)
    code, stderr = train_until_exit(*TINY, f"--dataset={moved}", f"--out_dir={out}", "--init_from=resume",
                                    "--max_iters=2")
    assert code == 0, stderr


def test_eval_only_writes_nothing_into_out_dir(tiny_dataset, tmp_path):
    out = tmp_path / "out"
    common = [*TINY, f"--dataset={tiny_dataset}", f"--out_dir={out}"]
    run_train(*common, "--max_iters=2")
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    p = run_train(*common, "--init_from=resume", "--eval_only=True", "--learning_rate=1.0")
    assert val_losses(p.stdout)[0][0] == 2
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before  # config.json and log.csv untouched


# -- faults a long run meets ----------------------------------------------------------------------

@pytest.mark.parametrize("args, words", [
    (["--batch_size=0"], "--batch_size=0 must be a whole number >= 1"),
    (["--batch_size=-4"], "--batch_size=-4 must be"),
    (["--gradient_accumulation_steps=0"], "--gradient_accumulation_steps=0 must be"),
    (["--gradient_accumulation_steps=-3"], "--gradient_accumulation_steps=-3 must be"),
    (["--eval_interval=0"], "--eval_interval=0 must be"),
    (["--log_interval=0"], "--log_interval=0 must be"),
    (["--eval_iters=-1"], "--eval_iters=-1 must be"),
    (["--eval_iters=0"], "--eval_iters=0 must be"),
    (["--n_head=3", "--n_embd=64"], "--n_embd=64 must be a multiple of --n_head=3"),
    (["--n_embd=0"], "--n_embd=0 must be"),
    (["--block_size=-1"], "--block_size=-1 must be"),
    (["--block_size=0"], "--block_size=0 must be"),
    (["--dropout=1.5"], "--dropout=1.5 must be a number >= 0 and < 1"),
    (["--learning_rate=-1"], "--learning_rate=-1.0 must be a number > 0"),
    (["--beta2=1.0"], "--beta2=1.0 must be"),
    (["--max_iters=0"], "--max_iters=0 must be a whole number >= 1"),
    (["--max_tokens=-5"], "--max_tokens=-5 must be"),
    (["--warmup_iters=2.5"], "--warmup_iters=2.5 must be a whole number"),
    (["--cos_attn=[7]"], "--cos_attn=[7] must list block indices 0..1"),
    (["--device=mps"], "--device=mps but MPS is not available"),
    (["--device=cpu:abc"], "--device='cpu:abc' is not a device"),
    (["--out_dir="], "--out_dir='' must name a directory"),
    (["--out_dir=/dev/null"], "--out_dir='/dev/null' must name a directory"),
    (["--max_nonfinite_steps=0"], "--max_nonfinite_steps=0 must be"),
    (["--norm=batchnorm"], "--norm='batchnorm' is not one of layernorm, rmsnorm"),
    (["--mlp=relu"], "--mlp='relu' is not one of gelu, swiglu"),
    (["--pos_emb=alibi"], "--pos_emb='alibi' is not one of learned, rope"),
    (["--tie_embeddings=maybe"], "--tie_embeddings expects bool"),
    (["--pos_emb=rope", "--n_embd=30"], "--pos_emb='rope' rotates pairs of features, so the head size "
                                        "n_embd / n_head = 30 / 2 must be even"),
])
def test_every_bad_value_is_one_line_and_exit_2(tiny_dataset, tmp_path, args, words):
    code, stderr = train_until_exit(f"--dataset={tiny_dataset}", f"--out_dir={tmp_path / 'o'}", *TINY, *args)
    assert code == 2, stderr
    err = stderr.strip().splitlines()
    assert len(err) == 1 and words in err[0], stderr


LLAMA_CONFIG = os.path.join(REPO, "config", "train_shakespeare_char_llama_cpu.py")


def test_the_llama_style_config_trains_measures_and_resumes_as_itself(tiny_dataset, tmp_path):
    """config/train_shakespeare_char_llama_cpu.py for two iterations (the demo's model, little evaluation),
    then two more from its checkpoint with GPT-2's architecture on the command line: the checkpoint's wins."""
    from gns_fixtures import LLAMA
    from nanogns.layers.config import classes_for_flags
    out = tmp_path / "out"
    step = 12 * 64  # the config's tokens per iteration
    common = [LLAMA_CONFIG, f"--dataset={tiny_dataset}", f"--out_dir={out}", "--eval_iters=1", "--eval_interval=2",
              "--log_interval=1"]
    run_train(*common, f"--max_tokens={2 * step}")
    ckpt = torch.load(out / "ckpt.pt", weights_only=False)
    assert {k: ckpt["model_args"][k] for k in LLAMA} == LLAMA and ckpt["model_args"]["bias"] is False
    sd = ckpt["model"]
    assert "transformer.wpe.weight" not in sd and "transformer.h.3.mlp.c_gate.weight" in sd
    assert not torch.equal(sd["lm_head.weight"], sd["transformer.wte.weight"])  # untied: trained apart
    with open(out / "log.csv") as f:
        header = f.readline().strip().split(",")
    measured = {c.split("/")[2] for c in header if c.startswith("train/gns/") and c.endswith("/norm")}
    assert {"transformer.wte.weight", "lm_head.weight", "transformer.h.0.mlp.c_gate.weight"} <= measured
    assert not any("wpe" in n for n in measured)
    rmsnorm_measured = classes_for_flags(lnclass="shim").get("RMSNorm", torch.nn.RMSNorm) is not torch.nn.RMSNorm
    assert ("transformer.ln_f.weight" in measured) == rmsnorm_measured  # with the table's RMSNorm class, if any
    p = run_train(*common, f"--max_tokens={4 * step}", "--init_from=resume", "--norm=layernorm", "--mlp=gelu",
                  "--pos_emb=learned", "--tie_embeddings=True")
    assert [int(i) for i in re.findall(r"^iter (\d+):", p.stdout, re.M)] == [2, 3]
    assert [line.split(" (")[0] for line in p.stdout.splitlines() if "which this resume uses" in line] == [
        "note: --norm=layernorm", "note: --mlp=gelu", "note: --pos_emb=learned", "note: --tie_embeddings=True"]
    ckpt = torch.load(out / "ckpt.pt", weights_only=False)
    assert {k: ckpt["model_args"][k] for k in LLAMA} == LLAMA and ckpt["iter_num"] == 4
    assert ckpt["model"].keys() == sd.keys()


MOE_CONFIG = os.path.join(REPO, "config", "train_shakespeare_char_moe_cpu.py")


def test_the_moe_config_trains_logs_each_expert_resumes_and_is_analysed(tiny_dataset, tmp_path):
    """config/train_shakespeare_char_moe_cpu.py for two iterations and two more from its checkpoint: every
    expert's weights in log.csv as name[e] with the examples that reached it, the router's, and
    gns-analysis groups them (experts, router) and shows each expert with --experts."""
    out = tmp_path / "out"
    step = 12 * 64
    common = [MOE_CONFIG, f"--dataset={tiny_dataset}", f"--out_dir={out}", "--eval_iters=1", "--eval_interval=2",
              "--log_interval=1", "--n_layer=2"]
    run_train(*common, f"--max_tokens={2 * step}")
    p = run_train(*common, f"--max_tokens={4 * step}", "--init_from=resume")
    assert [int(i) for i in re.findall(r"^iter (\d+):", p.stdout, re.M)] == [2, 3]
    ckpt = torch.load(out / "ckpt.pt", weights_only=False)
    assert ckpt["model_args"]["n_expert"] == 4 and ckpt["model"]["transformer.h.1.mlp.experts.c_fc"].shape[0] == 4
    log = pd.read_csv(out / "log.csv")
    assert list(log["step"]) == [0, 1, 2, 3]
    for e in range(4):
        assert (log[f"train/gns/transformer.h.1.mlp.experts.c_proj[{e}]/batch_size"] == 12).all()
        assert log[f"train/gns/transformer.h.1.mlp.experts[{e}]/reached"].between(0, 12).all()
    assert log["train/gns/transformer.h.0.mlp.router.weight/pegn"].gt(0).all()
    analysed = subprocess.run([sys.executable, os.path.join(REPO, "gns-analysis.py"), str(out), "--no-plots",
                               "--experts"], capture_output=True, text=True)
    assert analysed.returncode == 0, analysed.stderr
    assert re.search(r"^  experts +\S+ +\S+ +\S+ +16$", analysed.stdout, re.M)  # 2 layers x 4 experts x 2 weights
    assert re.search(r"^  router +\S+ +\S+ +\S+ +2$", analysed.stdout, re.M)
    assert "experts: 8 in 2 layers" in analysed.stdout
    results = pd.read_csv(out / "gns_analysis.csv")
    assert {"transformer.h.0.mlp.experts[3]/gns", "transformer.h.0.mlp.experts[3]/reached"} <= set(results.columns)


def test_bad_input_from_the_command_line_exits_2_in_a_real_process(tiny_dataset, tmp_path):
    p = run_train(f"--dataset={tiny_dataset}", f"--out_dir={tmp_path / 'o'}", *TINY, "--batch_size=0", check=False)
    assert p.returncode == 2 and p.stderr == "error: --batch_size=0 must be a whole number >= 1\n"


def wait_for(predicate, proc, timeout=60):
    import time
    end = time.time() + timeout
    while not predicate():
        assert proc.poll() is None, proc.communicate()
        assert time.time() < end, "timed out"
        time.sleep(0.1)


def start_train(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    return subprocess.Popen([sys.executable, os.path.join(REPO, "train.py"), *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def logged_rows(out):
    path = out / "log.csv"
    return len(path.read_text().splitlines()) - 1 if path.exists() else 0


@pytest.mark.slow
def test_a_second_run_on_a_live_out_dir_stops_and_a_dead_runs_lock_is_taken_over(tiny_dataset, tmp_path):
    import signal
    out = tmp_path / "out"
    common = [*TINY, f"--dataset={tiny_dataset}", f"--out_dir={out}", "--eval_interval=1000"]
    first = start_train(*common, "--max_iters=100000")
    try:
        wait_for(lambda: logged_rows(out) >= 1, first)
        p = run_train(*common, "--max_iters=3", check=False)
        assert p.returncode == 2
        err = p.stderr.strip().splitlines()
        assert len(err) == 1 and f"is in use by another train.py (pid {first.pid} on" in err[0], p.stderr
        assert first.poll() is None  # the first one goes on
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate()
    rows = logged_rows(out)
    p = run_train(*common, "--max_iters=2")  # the killed run's lock is taken over
    assert f"taking over {out}/train.lock from pid {first.pid}" in p.stdout
    assert rows >= 1 and logged_rows(out) == 2  # a new run (not a resume) starts a new log
    p = run_train(*common, "--max_iters=1")  # a clean end leaves no holder behind
    assert "taking over" not in p.stdout


@pytest.mark.slow
@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_a_signal_stops_after_the_step_with_a_checkpoint_and_the_resume_command(tiny_dataset, tmp_path, signame):
    import shlex
    import signal
    out = tmp_path / "out"
    common = [*TINY, f"--dataset={tiny_dataset}", f"--out_dir={out}", "--eval_interval=1000"]
    proc = start_train(*common, "--max_iters=100000")
    wait_for(lambda: logged_rows(out) >= 3, proc)
    proc.send_signal(getattr(signal, signame))
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + getattr(signal, signame)
    lines = [line for line in stderr.strip().splitlines() if line]
    assert len(lines) == 2 and lines[0] == f"{signame}: stopping after this step (send it again to stop now)", stderr
    last = int(re.search(r"after iter (\d+) ", lines[1]).group(1))  # the last step it ran
    assert f"ckpt.pt holds the state after iter {last};" in lines[1] and "--init_from=resume" in lines[1]
    # the log holds every finished step once, the last one named, and the checkpoint the state after it
    df = pd.read_csv(out / "log.csv")
    assert df.step.tolist() == list(range(last + 1)) and (out / "log.csv").read_text().endswith("\n")
    assert torch.load(out / "ckpt.pt", weights_only=False)["iter_num"] == last + 1
    # the printed command goes on from there
    command = shlex.split(lines[1].split("to go on: ", 1)[1])
    assert command[0] == "python" and command[-1] == "--init_from=resume"
    p = run_train(*command[2:-1], "--init_from=resume", f"--max_iters={last + 3}")
    assert [int(i) for i in re.findall(r"^iter (\d+):", p.stdout, re.M)] == [last + 1, last + 2]


# rank 0 takes 3 s to write ckpt.pt, as a large model's checkpoint on a slow disk does
SLOW_CHECKPOINT = """
import sys, time
sys.path.insert(0, {root!r})
import checkpoint
write = checkpoint.write_checkpoint
def slow_write(*args, **kwargs):
    time.sleep(3)
    return write(*args, **kwargs)
checkpoint.write_checkpoint = slow_write
"""


@pytest.mark.slow
def test_signalled_ddp_ranks_wait_for_the_masters_checkpoint_before_leaving(tiny_dataset, tmp_path):
    """torchrun stops every rank once one has exited; a rank that left while the master still wrote
    ckpt.pt would have the master killed mid-write (its second signal), the checkpoint lost."""
    import signal
    site, out = tmp_path / "site", tmp_path / "out"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_CHECKPOINT.format(root=REPO))
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                os.path.join(REPO, "train.py")]
    flags = [*TINY, f"--dataset={tiny_dataset}", f"--out_dir={out}", "--eval_interval=1000", "--backend=gloo",
             "--gradient_accumulation_steps=2", "--max_iters=100000"]
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", PYTHONPATH=str(site))
    proc = subprocess.Popen([*launcher, *flags], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        wait_for(lambda: logged_rows(out) >= 3, proc, timeout=120)
        with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:  # the ranks, not the launcher
            ranks = [int(pid) for pid in f.read().split()]
        assert len(ranks) == 2
        for pid in ranks:
            os.kill(pid, signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:  # the launcher and its ranks: orphaned ranks would hold the pipes open
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    stopped = re.search(r"stopped by SIGTERM after iter (\d+) .*ckpt.pt holds the state after iter (\d+)", stderr)
    assert stopped and stopped.group(1) == stopped.group(2), stderr[-3000:]
    assert "again: stopping now" not in stderr, stderr[-3000:]
    assert torch.load(out / "ckpt.pt", weights_only=False)["iter_num"] == int(stopped.group(1)) + 1


@pytest.mark.slow
def test_a_diverging_float32_run_stops_and_keeps_its_last_good_checkpoint(tiny_dataset, tmp_path):
    out = tmp_path / "out"
    common = [*TINY, f"--dataset={tiny_dataset}", f"--out_dir={out}", "--eval_interval=1", "--lnclass=shim"]
    run_train(*common, "--max_iters=2")
    # learning_rate 1e3: the weights blow up, the gradients go to inf; checkpoints every step
    p = run_train(*common, "--init_from=resume", "--max_iters=1000", "--learning_rate=1e3", "--warmup_iters=0",
                  "--max_nonfinite_steps=3", check=False)
    assert p.returncode == 1
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and "the last 3 steps had a non-finite loss or gradient and were skipped" in err[0], p.stderr
    assert "try a lower --learning_rate" in err[0] and "fp16" not in p.stdout + p.stderr
    ckpt = torch.load(out / "ckpt.pt", weights_only=False)
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values() if v.is_floating_point())
    stopped = int(re.search(r"stopping after iter (\d+)", err[0]).group(1))
    assert stopped < 20 and ckpt["iter_num"] <= stopped


def test_a_divergence_read_late_logs_every_step_that_ran_and_names_the_last(tiny_dataset, tmp_path):
    """--log_interval=10: the loop reads the device at iter 0 and iter 10; the steps in between ran
    (skipped, their weights untouched), so each gets its row, and the stop names the step it came after."""
    out = tmp_path / "out"
    p = run_train(*TINY, f"--dataset={tiny_dataset}", f"--out_dir={out}", "--log_interval=10", "--eval_interval=1000",
                  "--learning_rate=1e3", "--warmup_iters=0", "--max_nonfinite_steps=2", "--max_iters=50",
                  "--lnclass=shim", check=False)
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("stopping after iter 10: by iter "), p.stderr
    log = pd.read_csv(out / "log.csv")
    assert log["iter_num"].tolist() == list(range(11))
    skipped = log["step_skipped"].tolist()
    diverged = int(re.search(r"by iter (\d+), 2 steps in a row", err[0]).group(1))
    assert skipped[diverged - 1:] == [1.0] * (11 - diverged + 1) and diverged >= 1


def read_like_the_reference(out_dir):
    """log.csv read as the reference implementation's gns-analysis.py and notebook read it
    (pandas, every row checked for one batch size across the GNS columns, layer groups by name,
    val/loss indexed by tokens_processed); returns the groups' total squared norms per row."""
    df = pd.read_csv(os.path.join(out_dir, "log.csv"))
    gns = [c for c in df.columns if c.startswith("train/gns/")]
    batch_sizes = [c for c in gns if c.endswith("/batch_size")]
    assert (df[batch_sizes].nunique(axis=1) == 1).all(), "a row without one batch size"
    groups = {"LayerNorm": ("ln_1", "ln_2", "ln_f"), "Embedding": ("wpe",), "Linear": ("c_attn", "c_proj", "c_fc")}
    totals = {}
    for group, words in groups.items():
        norms = [c for c in gns if c.endswith("/norm") and any(w in c for w in words)]
        assert norms, f"no {group} columns"
        totals[group] = df[norms].pow(2).sum(axis=1)
        assert np.isfinite(totals[group]).all() and (totals[group] > 0).all()
    loss = df.set_index("tokens_processed")["val/loss"].dropna()
    assert loss.index.is_unique and len(loss) >= 2
    return totals


@pytest.mark.slow
def test_the_references_readers_take_a_finished_a_resumed_and_a_killed_run(tiny_dataset, tmp_path):
    import signal
    out = tmp_path / "out"
    common = [*TINY, f"--dataset={tiny_dataset}", f"--out_dir={out}", "--eval_interval=3",
              "--gradient_accumulation_steps=2", "--linearclass=gns", "--embeddingclass=gns", "--lnclass=shim"]
    run_train(*common, "--max_iters=4")
    assert len(read_like_the_reference(out)["LayerNorm"]) == 4
    run_train(*common, "--max_iters=7", "--init_from=resume")
    assert len(read_like_the_reference(out)["LayerNorm"]) == 7
    proc = start_train(*common, "--max_iters=100000", "--init_from=resume")
    wait_for(lambda: logged_rows(out) >= 10, proc)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert len(read_like_the_reference(out)["LayerNorm"]) >= 10


@pytest.mark.slow
def test_a_full_disk_stops_in_one_line_and_the_run_resumes_in_place(tiny_dataset, tmp_path):
    """On a small tmpfs: the run stops with one line saying the disk is full, leaves no partial
    file, keeps its last checkpoint and a log of complete rows; after the user frees less room
    than log.csv takes (so a resume that copied the log could not), --init_from=resume goes on."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=384k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root (CI has it)")
    try:
        (disk / "ballast").write_bytes(bytes(64 * 1024))
        out = disk / "out"
        common = ["--device=cpu", "--dtype=float32", "--compile=False", "--n_layer=1", "--n_head=2", "--n_embd=16",
                  "--gradient_accumulation_steps=1",
                  "--block_size=16", "--batch_size=4", "--eval_iters=2", "--log_interval=1000", "--device_name='M1_eflops'",
                  f"--dataset={tiny_dataset}", f"--out_dir={out}", "--eval_interval=40",
                  "--linearclass=gns", "--embeddingclass=gns", "--lnclass=shim"]
        p = run_train(*common, "--max_iters=100000", check=False)
        assert p.returncode == 1
        err = p.stderr.strip().splitlines()
        assert len(err) == 1 and "disk is full" in err[0] and str(out) in err[0], p.stderr
        assert sorted(f.name for f in out.iterdir()) == ["ckpt.pt", "config.json", "layer_kinds.json",
                                                         "linear_norm_methods.json", "log.csv", "train.lock"]
        kept = torch.load(out / "ckpt.pt", weights_only=False)["iter_num"]
        text = (out / "log.csv").read_text()
        assert text.endswith("\n") and pd.read_csv(out / "log.csv").step.tolist() == list(range(len(text.splitlines()) - 1))
        (disk / "ballast").unlink()
        assert shutil.disk_usage(disk).free < len(text)  # too little room for a second copy of the log
        p = run_train(*common, f"--max_iters={kept + 3}", "--init_from=resume")
        df = pd.read_csv(out / "log.csv")
        assert df.step.tolist() == list(range(kept + 3))
        assert torch.load(out / "ckpt.pt", weights_only=False)["iter_num"] == kept + 3
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_resume_on_a_log_that_is_not_one_is_one_line_and_leaves_it_alone(tiny_dataset, one_step_run, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(one_step_run, out)
    garbage = os.urandom(3000)
    (out / "log.csv").write_bytes(garbage)
    code, stderr = train_until_exit(*TINY, f"--dataset={tiny_dataset}", f"--out_dir={out}",
                                    "--init_from=resume", "--max_iters=2")
    assert code == 2
    err = stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --init_from=resume:") and "log.csv" in err[0], stderr
    assert (out / "log.csv").read_bytes() == garbage


def test_training_imports_no_analysis_library(tiny_dataset, tmp_path):
    """pandas and the plotting libraries are the offline analysis' (gns-analysis.py, plot.py), not training's."""
    code = ("import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__'); "
            "print([m for m in ('pandas', 'matplotlib', 'plotille', 'csv_tools') if m in sys.modules])")
    p = subprocess.run([sys.executable, "-c", code, os.path.join(REPO, "train.py"), *TINY,
                        f"--dataset={tiny_dataset}", f"--out_dir={tmp_path}", "--max_iters=2",
                        "--linearclass=gns", "--embeddingclass=gns", "--lnclass=fused", "--gns_hooks=exact",
                        "--microbatch_gns=True", "--gradient_accumulation_steps=2"],
                       cwd=REPO, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == "[]"


# ---------------------------------------------------------------------------------------------
# --bs_controller=gns: the batch follows the live GNS (schedules.GNSBatchController). The tests
# drive it with a known GNS, 1 + tokens / 20, through tests/synthetic_gns_train.py.

SYNTHETIC = os.path.join(REPO, "tests", "synthetic_gns_train.py")
CONTROLLER = ["--bs_controller=gns", "--gradient_accumulation_steps=8", "--bs_warmup_steps=3", "--lnclass=shim",
              "--eval_interval=1000"]


def run_synthetic(record, *args, torchrun_procs=0, skew=0, sleep=0, **popen):
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun_procs}"]
                if torchrun_procs else [sys.executable])
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", SYNTHETIC_GNS_TOKENS="20",
               SYNTHETIC_GNS_SKEW=str(skew), SYNTHETIC_GNS_SLEEP=str(sleep))
    os.makedirs(record, exist_ok=True)
    command = [*launcher, SYNTHETIC, str(record), *args]
    if popen:
        return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return p


def expected_accumulation(steps, floor, ceiling, warmup, update_tokens, world=1):
    """By hand: the global accumulation steps of each step for GNS = 1 + tokens / 20 examples,
    4 examples (64 tokens) per micro-batch, every step measured."""
    tokens, accumulation, changed_at, chosen = 0, floor, None, []
    for step in range(steps):
        if step >= warmup:  # the EMA has averaged `step` steps
            want = world * math.ceil(math.ceil((1 + tokens / 20) / 4) / world)
            want = min(max(want, floor), ceiling)
            if want > accumulation and (changed_at is None or tokens - changed_at >= update_tokens):
                accumulation, changed_at = want, tokens
        chosen.append(accumulation)
        tokens += accumulation * 64
    return chosen


def test_the_accumulation_follows_a_growing_gns_after_warm_up_and_rate_limited(tiny_dataset, tmp_path):
    out = tmp_path / "out"
    run_synthetic(tmp_path / "record", *TINY, *CONTROLLER, f"--dataset={tiny_dataset}", f"--out_dir={out}",
                  "--max_iters=9", "--bs_update_tokens=300")
    expected = expected_accumulation(9, floor=1, ceiling=8, warmup=3, update_tokens=300)
    assert expected == [1, 1, 1, 3, 3, 8, 8, 8, 8]  # the case worked through: a change held back at 384 tokens
    df = pd.read_csv(out / "log.csv")
    assert df["gradient_accumulation_steps"].tolist() == expected
    assert df["bs_controller/accumulation_steps"].tolist() == expected
    # the target: none while the EMA warms up, then 1 + tokens / 20 at the step's start
    before = np.concatenate([[0], df["tokens_processed"].to_numpy()[:-1]])
    assert df["bs_controller/target_examples"].isna().tolist() == [True] * 3 + [False] * 6
    assert df["bs_controller/target_examples"][3:].tolist() == pytest.approx((1 + before[3:] / 20).tolist())
    recorded = [int(line.split()[1]) for line in (tmp_path / "record" / "rank0.txt").read_text().splitlines()]
    assert recorded == expected


def test_with_nothing_measured_the_batch_stays_at_the_floor(tiny_dataset, tmp_path):
    p = run_train(*TINY, f"--dataset={tiny_dataset}", f"--out_dir={tmp_path}", "--max_iters=4",
                  "--bs_controller=gns", "--gradient_accumulation_steps=8", "--bs_min_accum=2", "--bs_warmup_steps=0")
    assert "warning: --bs_controller=gns but no layer measures per-example gradient norms" in p.stdout
    df = pd.read_csv(tmp_path / "log.csv")
    assert df["gradient_accumulation_steps"].tolist() == [2] * 4
    assert df["bs_controller/target_examples"].isna().all()


@pytest.mark.slow
def test_a_killed_run_resumes_with_the_accumulation_of_an_uninterrupted_one(tiny_dataset, tmp_path):
    import signal
    flags = [*TINY, *CONTROLLER, f"--dataset={tiny_dataset}", "--bs_update_tokens=1000", "--max_iters=11"]
    run_synthetic(tmp_path / "r1", *flags, f"--out_dir={tmp_path / 'whole'}")
    whole = pd.read_csv(tmp_path / "whole" / "log.csv")["gradient_accumulation_steps"].tolist()
    # the change at 192 tokens holds the batch at 3 until 1192: a resume that forgot it would change at once
    assert whole == expected_accumulation(11, floor=1, ceiling=8, warmup=3, update_tokens=1000)
    assert whole == [1, 1, 1] + [3] * 6 + [8] * 2
    out = tmp_path / "killed"
    proc = run_synthetic(tmp_path / "r2", *flags[:-1], "--max_iters=100000", f"--out_dir={out}", sleep=0.5, popen=True)
    wait_for(lambda: logged_rows(out) >= 4, proc)  # inside the rate limit's hold
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    done = len(pd.read_csv(out / "log.csv"))
    assert done in (4, 5)  # the step under way when the signal came was finished
    run_synthetic(tmp_path / "r2", *flags, f"--out_dir={out}", "--init_from=resume")
    assert pd.read_csv(out / "log.csv")["gradient_accumulation_steps"].tolist() == whole


@pytest.mark.slow
def test_two_ranks_take_the_same_accumulation_every_step(tiny_dataset, tmp_path):
    """Rank 1's GNS is 1000 examples above rank 0's: alone it would take the ceiling at once;
    both take rank 0's decision at every step."""
    out, record = tmp_path / "out", tmp_path / "record"
    run_synthetic(record, *TINY, *CONTROLLER, f"--dataset={tiny_dataset}", f"--out_dir={out}", "--max_iters=7",
                  "--bs_min_accum=2", "--bs_update_tokens=0", "--backend=gloo", torchrun_procs=2, skew=1000)
    rank0, rank1 = ((record / f"rank{r}.txt").read_text().splitlines() for r in (0, 1))
    assert rank0 == rank1 and len(rank0) == 7
    expected = expected_accumulation(7, floor=2, ceiling=8, warmup=3, update_tokens=0, world=2)
    assert [2 * int(line.split()[1]) for line in rank0] == expected
    assert pd.read_csv(out / "log.csv")["bs_controller/accumulation_steps"].tolist() == expected


# ---------------------------------------------------------------- reads from the device

# runs train.py as `python train.py FLAGS...` would, counting the project's reads of tensor values on the
# host (each one a device-to-host copy that waits for the device on a GPU): calls of Tensor.item, tolist,
# cpu, float(), int() and bool() made from this repository's files, by file and function, into argv[1]
COUNT_READS = r"""
import collections, json, os, runpy, sys, torch
out, repo = sys.argv[1], os.getcwd()
reads = collections.Counter()
def counted(method):
    def wrapper(self, *args, **kwargs):
        caller = sys._getframe(1).f_code
        if caller.co_filename.startswith(repo) and '.venv' not in caller.co_filename:
            reads[f"{os.path.basename(caller.co_filename)}:{caller.co_name}"] += 1
        return method(self, *args, **kwargs)
    return wrapper
for name in ('item', 'tolist', 'cpu', '__float__', '__int__', '__bool__'):
    setattr(torch.Tensor, name, counted(getattr(torch.Tensor, name)))
sys.argv = sys.argv[2:]
try:
    runpy.run_path(os.path.join(repo, 'train.py'), run_name='__main__')
finally:
    with open(out, 'w') as f:
        json.dump(reads, f)
"""


def count_reads(tmp_path, *flags):
    """The project's reads of tensor values in a train.py run with TINY and `flags`, by file:function."""
    counts = tmp_path / "reads.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    run = subprocess.run([sys.executable, "-c", COUNT_READS, str(counts), "train.py", *TINY, *flags],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(counts.read_text()), run.stdout


def test_an_evaluation_reads_its_losses_once(tiny_dataset, tmp_path):
    """estimate_loss keeps the batches' losses on the device: one read of both splits' means, not one per batch."""
    reads, _ = count_reads(tmp_path, f"--dataset={tiny_dataset}", f"--out_dir={tmp_path / 'out'}", "--max_iters=4",
                           "--eval_interval=100", "--eval_iters=6", "--log_interval=100")
    assert reads.get("train.py:estimate_loss") == 2  # two evaluations (the first step's, the last's)


LOOP_READERS = ("train.py:<module>", "pending.py:_read_in_one_copy", "base.py:read_now",
                "model.py:step_unless_nonfinite", "stopping.py:agreed")


@pytest.mark.slow
@pytest.mark.parametrize("layers", [[], ["--lnclass=fused"], ["--linearclass=gns", "--embeddingclass=gns", "--lnclass=shim"]],
                         ids=["nn", "layernorm", "every-layer"])
def test_ten_steps_logged_every_ten_read_the_device_at_most_three_times(tiny_dataset, tmp_path, layers):
    """The loop keeps each step's loss, gradient norm and GNS sums on the device and reads them all in one
    copy when it logs (the first step and the last here), as the skip of a non-finite step is decided there:
    a step that does not log waits for nothing. log.csv still has every step's row."""
    out = tmp_path / "out"
    reads, stdout = count_reads(tmp_path, f"--dataset={tiny_dataset}", f"--out_dir={out}", "--max_iters=10",
                                "--eval_interval=1000", "--log_interval=10", *layers)
    loop = {where: n for where, n in reads.items() if where not in ("train.py:estimate_loss",
                                                                    "checkpoint.py:save_training_state")}
    assert set(loop) <= set(LOOP_READERS), reads  # a new reader would escape this count
    assert sum(loop.values()) <= 3, reads  # the start's tokens_processed, then one read per log
    log = pd.read_csv(out / "log.csv")
    assert list(log["iter_num"]) == list(range(10)) and log["train/lossf"].notna().all() and (log["grad_norm"] > 0).all()
    assert [int(line.split()[1][:-1]) for line in stdout.splitlines() if line.startswith("iter ")] == [0]
    if layers:
        assert log.filter(like="/pegn").notna().all().all() and (log.filter(like="/pegn") > 0).all().all()


def test_help_gives_every_key_words_of_its_own():
    """python train.py --help: each of train.py's keys with its default and what it does."""
    p = subprocess.run([sys.executable, os.path.join(REPO, "train.py"), "--help"], capture_output=True, text=True,
                       timeout=120, cwd=REPO)
    assert p.returncode == 0, p.stderr[-2000:]
    keys = [line.split() for line in p.stdout.splitlines() if line.startswith("  --")]
    assert len(keys) > 60
    assert [k[0] for k in keys if len(k) < 2] == []  # a key shown with its default alone
