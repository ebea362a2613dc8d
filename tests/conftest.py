"""Shared fixtures: the repo root on sys.path, a tiny character dataset, and a helper that
runs train.py in a subprocess the way a user would."""
import fcntl
import os
import pickle
import shutil
import subprocess
import sys
import time

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


def made_once(tmp_path_factory, name, make, timeout=900):
    """The folder `name`, filled by make(folder) once per test run. Each pytest-xdist worker builds its
    own copy of a module or session fixture, so a fixture that runs train.py (or torchrun, or a bench
    script) for several tests would run it on both workers: the first worker to get here makes the
    folder and the other waits for it, at most `timeout` seconds (make's own runs have timeouts)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # .../pytest-N/popen-gwK: the parent is this run's, shared by its workers
    folder, done = root / f"made-{name}", root / f"made-{name}.done"
    deadline = time.monotonic() + timeout
    with open(root / f"made-{name}.lock", "w") as lock:
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                assert time.monotonic() < deadline, f"waited {timeout} s for another worker to make {folder}"
                time.sleep(0.2)
        try:
            if not done.exists():
                shutil.rmtree(folder, ignore_errors=True)  # what a failed attempt left
                folder.mkdir()
                make(folder)
                done.touch()
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return folder


def run_bench(script, *args, timeout=300):
    """Run bench/`script` with the given flags as train.py's tests run it; returns the CompletedProcess."""
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    return subprocess.run([sys.executable, os.path.join(REPO, "bench", script), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout, env=env)


# the batch-size experiment (two settings) and both model families of the normalisation-only vs
# total comparison on 1-layer GPTs; the flags are the tests' to read
BATCH_CONTROL = ["--seeds=1", "--max_tokens=4096", "--settings=fixed-floor,gns-total", "--n_layer=1",
                 "--n_embd=16", "--n_head=2", "--eval_iters=2", "--bs_warmup_steps=2", "--warmup_tokens=0"]
CRITICAL_BATCH = ["--quick"]  # the whole pipeline on a 1-layer GPT, one family and seed
NORM_VS_TOTAL = ["--seeds=1", "--max_tokens=3072", "--alpha=0.5", "--n_layer=1", "--n_embd=16", "--n_head=2",
                 "--batch_size=4", "--block_size=16", "--eval_iters=2", "--eval_interval=1000"]


class OnFirstUse(dict):
    """{key: made_once's folder `name`-key, filled by make(key, folder)}, each made when a test first asks
    for it: a test waits only for what it reads, and a second worker makes another key meanwhile
    instead of waiting for every key in turn. result(key, folder) is what a test gets (the folder)."""

    def __init__(self, tmp_path_factory, name, make, result=lambda key, folder: folder):
        super().__init__()
        self.tmp_path_factory, self.name, self.make, self.result = tmp_path_factory, name, make, result

    def __missing__(self, key):
        folder = made_once(self.tmp_path_factory, f"{self.name}-{key}", lambda folder: self.make(key, folder))
        self[key] = self.result(key, folder)
        return self[key]


@pytest.fixture(scope="session")
def bench_runs(tiny_dataset, tmp_path_factory):
    """{script: (out_dir, its stdout)} of bench/batch_control.py, bench/norm_vs_total.py and
    bench/critical_batch.py on the tiny dataset, made once (each on first use) for their end-to-end
    tests and the notebook's; treat the folders as read-only."""
    flags = {"batch_control.py": BATCH_CONTROL, "norm_vs_total.py": NORM_VS_TOTAL, "critical_batch.py": CRITICAL_BATCH}

    def make(script, folder):
        p = run_bench(script, f"--out_dir={folder / 'runs'}", f"--dataset={tiny_dataset}", *flags[script])
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
        (folder / "stdout.txt").write_text(p.stdout)
    return OnFirstUse(tmp_path_factory, "bench", make,
                      result=lambda script, folder: (folder / "runs", (folder / "stdout.txt").read_text()))


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
