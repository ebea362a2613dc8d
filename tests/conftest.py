"""Shared fixtures: the repo root on sys.path, a tiny character dataset, and a helper that
runs train.py in a subprocess the way a user would."""
import os
import pickle
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

# a tiny GPT that trains in a second or two on CPU
TINY = ["--device=cpu", "--dtype=float32", "--compile=False", "--n_layer=2", "--n_head=2",
        "--n_embd=32", "--block_size=16", "--batch_size=4", "--gradient_accumulation_steps=1",
        "--eval_iters=2", "--log_interval=1", "--dropout=0.0", "--device_name='M1_eflops'"]


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory):
    """A character-level dataset (train.bin, val.bin, meta.pkl) of a short repeated text:
    learnable in a few dozen steps, so a falling loss is a real signal."""
    d = tmp_path_factory.mktemp("tinydata")
    text = "the quick brown fox jumps over the lazy dog. " * 400
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    ids = np.array([stoi[c] for c in text], dtype=np.uint16)
    n = int(0.9 * len(ids))
    ids[:n].tofile(d / "train.bin")
    ids[n:].tofile(d / "val.bin")
    with open(d / "meta.pkl", "wb") as f:
        pickle.dump(dict(vocab_size=len(chars), itos={i: c for c, i in stoi.items()}, stoi=stoi), f)
    return str(d)


def run_train(*args, cwd=REPO, timeout=300, check=True, torchrun_procs=0):
    """Run train.py with the given flags; returns the CompletedProcess (stdout+stderr text)."""
    if torchrun_procs:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={torchrun_procs}", os.path.join(REPO, "train.py"), *args]
    else:
        cmd = [sys.executable, os.path.join(REPO, "train.py"), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    if check and p.returncode != 0:
        raise AssertionError(f"train.py failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def write_long_log(path, rows, params):
    """A log shaped like a long run's: many per-parameter GNS columns of full-precision floats."""
    rng = np.random.default_rng(0)
    names = [f"transformer.h.{i // 4}.{k}" for i, k in
             zip(range(params), ["ln_1.weight", "ln_1.bias", "mlp.c_fc.weight", "mlp.c_proj.weight"] * params)]
    cols = {"step": np.arange(rows), "iter_num": np.arange(rows), "tokens_processed": 4096 * np.arange(1, rows + 1),
            "train/lossf": rng.uniform(2, 4, rows)}
    for n in names:
        cols.update({f"train/gns/{n}/norm": rng.uniform(0.1, 1, rows), f"train/gns/{n}/pegn": rng.uniform(1, 3, rows),
                     f"train/gns/{n}/batch_size": np.full(rows, 64)})
    pd.DataFrame(cols).to_csv(path, index=False)
    return os.path.getsize(path)


def peak_rss(*args):
    """Peak resident memory in bytes of a command, measured in a fresh process (RUSAGE_CHILDREN is its own)."""
    code = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    r = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, cwd=REPO,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr
    return int(r.stdout) * 1024  # kilobytes on Linux
