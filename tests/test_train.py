"""train.py end to end on CPU, as a user runs it: training lowers the loss, resume continues
exactly, the LR follows the token schedule, bad input fails cleanly, DDP on gloo runs."""
import os
import re

import pytest
import torch

from conftest import TINY, run_train


def val_losses(stdout):
    return [(int(s), float(v)) for s, v in re.findall(r"step (\d+): train loss [\d.]+, val loss ([\d.]+)", stdout)]


def test_short_run_lowers_val_loss_and_checkpoints(tiny_dataset, tmp_path):
    out = tmp_path / "out"
    p = run_train(*TINY, f"--dataset={tiny_dataset}", f"--out_dir={out}", "--max_iters=60",
                  "--eval_interval=30", "--learning_rate=3e-3", "--warmup_tokens=640",
                  "--max_tokens=1000000", "--lr_decay_tokens=3840", "--min_lr=3e-4")
    losses = val_losses(p.stdout)
    assert [s for s, _ in losses] == [0, 30, 60]  # evals at 0, 30 and the final one
    assert losses[-1][1] < losses[0][1] - 0.5
    ckpt = torch.load(out / "ckpt.pt", weights_only=False)
    assert ckpt['iter_num'] == 60
    assert ckpt['model']['tokens_processed'].item() == 60 * 4 * 16


def test_resume_continues_iter_num_and_tokens_exactly(tiny_dataset, tmp_path):
    out = tmp_path / "out"
    common = [*TINY, f"--dataset={tiny_dataset}", f"--out_dir={out}", "--eval_interval=5",
              "--gradient_accumulation_steps=2", "--max_tokens=1000000"]
    run_train(*common, "--max_iters=5")
    ckpt = torch.load(out / "ckpt.pt", weights_only=False)
    assert ckpt['iter_num'] == 5 and ckpt['model']['tokens_processed'].item() == 5 * 2 * 4 * 16
    p = run_train(*common, "--max_iters=8", "--init_from=resume")
    iters = [int(i) for i in re.findall(r"^iter (\d+):", p.stdout, re.M)]
    assert iters == [6, 7, 8]
    toks = [int(t.replace(',', '')) for t in re.findall(r"tokens ([\d,]+),", p.stdout)]
    assert toks == [i * 2 * 4 * 16 for i in (6, 7, 8)]
    ckpt = torch.load(out / "ckpt.pt", weights_only=False)
    assert ckpt['iter_num'] == 8 and ckpt['model']['tokens_processed'].item() == 8 * 2 * 4 * 16


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
                  "--max_tokens=1000000", torchrun_procs=2)
    # two ranks of one micro-step each: 2 * 4 * 16 tokens per iteration
    toks = [int(t.replace(',', '')) for t in re.findall(r"tokens ([\d,]+),", p.stdout)]
    assert toks == [128, 256, 384, 512]
    assert torch.load(out / "ckpt.pt", weights_only=False)['iter_num'] == 4
