"""train.py's --init_from=resume end to end: a run killed (SIGKILL) or stopped (SIGTERM) at a random
step and resumed writes the log.csv of a run never interrupted, value for value (the wall-clock
columns aside), in one process, with the batch-size controller or schedule, and under DDP and FSDP."""
import csv
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import REPO, TINY, made_once, run_train

WALL_CLOCK = {"dt", "mfu", "tokens_per_sec"}  # the columns that measure time, not training
STEPS = 12
# dropout on (torch's global RNG), every layer measured (the GNS columns), accumulation (prefetched batches);
# the Linears' methods from the shapes: two runs' timed choices need not agree (a resume keeps its own)
FLAGS = [*TINY, "--dropout=0.1", "--gradient_accumulation_steps=2", "--eval_interval=4", f"--max_iters={STEPS}",
         "--warmup_iters=2", f"--lr_decay_iters={STEPS}", "--linearclass=gns", "--embeddingclass=gns", "--lnclass=shim",
         "--per_example_mode=shapes"]
# every row takes 0.05 s longer, so that a signal lands mid-run on any machine
SLOW_ROWS = """
import sys, time
sys.path.insert(0, {root!r})
import nanogns.runlog as tracker
step = tracker.LogWrapper.step
def slow_step(self):
    step(self)
    time.sleep(0.05)
tracker.LogWrapper.step = slow_step
"""


def log_rows(out):
    """log.csv's header and rows, the wall-clock columns left out."""
    with open(out / "log.csv", newline="") as f:
        rows = list(csv.reader(f))
    keep = [i for i, name in enumerate(rows[0]) if name not in WALL_CLOCK]
    return [[row[i] if i < len(row) else "" for i in keep] for row in rows]


def rows_in(out):
    path = out / "log.csv"
    return len(path.read_bytes().splitlines()) - 1 if path.exists() else 0


def ranks_of(launcher):
    """The pids of a torchrun launcher's ranks (each leads a process group of its own)."""
    try:
        with open(f"/proc/{launcher.pid}/task/{launcher.pid}/children") as f:
            return [int(pid) for pid in f.read().split()]
    except OSError:
        return []


def end_all(proc, ranks):
    """SIGKILL the launcher's and the ranks' process groups, whatever failed: nothing left running."""
    for pid in [*ranks, proc.pid]:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if proc.poll() is None:
        proc.communicate()


def signal_all(proc, signum):
    """signum to proc and, under torchrun, to its ranks at once, as a cluster's scheduler sends it."""
    for pid in [*ranks_of(proc), proc.pid]:
        try:
            os.killpg(pid, signum)
        except ProcessLookupError:
            pass


def start(flags, out, torchrun_procs=0, site=None):
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun_procs}"]
                if torchrun_procs else [sys.executable])
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", PYTHONPATH=str(site or ""))
    return subprocess.Popen([*launcher, os.path.join(REPO, "train.py"), *flags, f"--out_dir={out}"], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def interrupt(flags, out, signum, at_row, torchrun_procs=0, site=None):
    """Run train.py with `flags` into `out` and send `signum` to it (signal_all) once log.csv has
    at_row rows; returns (exit code, stdout, stderr)."""
    proc = start(flags, out, torchrun_procs, site)
    ranks = []
    try:
        deadline = time.monotonic() + 180
        while rows_in(out) < at_row:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.01)
        ranks = ranks_of(proc)
        signal_all(proc, signum)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        end_all(proc, ranks)
    return proc.returncode, stdout, stderr


def uninterrupted(tmp_path_factory, flags, torchrun_procs=0):
    """The out_dir of a run with `flags` never interrupted: made once for the tests whose runs it stands for."""
    name = "whole-" + hashlib.sha256(repr((flags, torchrun_procs)).encode()).hexdigest()[:16]
    make = lambda folder: run_train(*flags, f"--out_dir={folder / 'out'}", torchrun_procs=torchrun_procs)
    return made_once(tmp_path_factory, name, make) / "out"


def assert_resume_continues_exactly(tiny_dataset, tmp_path_factory, tmp_path, flags, signum, torchrun_procs=0):
    flags = [*flags, f"--dataset={tiny_dataset}"]
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_ROWS.format(root=REPO))
    at_row = random.Random().randrange(6, 9)  # after the first checkpoint (iter 4), before the end
    out = tmp_path / "cut"
    code = interrupt(flags, out, signum, at_row, torchrun_procs, site)[0]
    assert code != 0, "the run ended before the signal"
    stopped_at = torch.load(out / "ckpt.pt", weights_only=False)["iter_num"]
    p = run_train(*flags, f"--out_dir={out}", "--init_from=resume", torchrun_procs=torchrun_procs)
    # a stop is an exit of the run's own, which empties train.lock; a kill is not, and is named
    assert ("taking over" in p.stdout) == (signum == signal.SIGKILL), p.stdout[-2000:]
    # the same flags uninterrupted (a kill and a stop compare with one such run)
    whole, resumed = log_rows(uninterrupted(tmp_path_factory, flags, torchrun_procs)), log_rows(out)
    assert resumed[0] == whole[0]
    assert len(resumed) == len(whole) > 9
    for step, (a, b) in enumerate(zip(whole[1:], resumed[1:])):
        assert a == b, f"step {step} differs (signal at row {at_row}, resumed from iter {stopped_at}): " + \
            str([(name, x, y) for name, x, y in zip(whole[0], a, b) if x != y][:4])


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
def test_a_run_killed_or_stopped_and_resumed_writes_the_log_of_an_uninterrupted_one(tiny_dataset, tmp_path_factory,
                                                                                   tmp_path, signum):
    assert_resume_continues_exactly(tiny_dataset, tmp_path_factory, tmp_path, FLAGS, signum)


@pytest.mark.slow
@pytest.mark.parametrize("sizing", [
    ["--bs_controller=gns", "--gradient_accumulation_steps=8", "--bs_warmup_steps=2", "--bs_update_tokens=0",
     "--bs_allow_decrease=True"],
    ["--bs_schedule=True", "--bs_schedule_points=[(0, 1), (2000, 4)]"]], ids=["controller", "schedule"])
def test_the_batch_size_controller_and_schedule_resume_exactly(tiny_dataset, tmp_path_factory, tmp_path, sizing):
    assert_resume_continues_exactly(tiny_dataset, tmp_path_factory, tmp_path, [*FLAGS, *sizing], signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.parametrize("sharding", [[], ["--fsdp=True"]], ids=["ddp", "fsdp"])
def test_two_ranks_killed_and_resumed_write_the_log_of_an_uninterrupted_run(tiny_dataset, tmp_path_factory, tmp_path,
                                                                          sharding):
    assert_resume_continues_exactly(tiny_dataset, tmp_path_factory, tmp_path, [*FLAGS, "--backend=gloo", *sharding],
                                    signal.SIGKILL, torchrun_procs=2)


@pytest.mark.slow
def test_a_resumed_run_measures_each_linear_with_its_checkpoints_method(tiny_dataset, tmp_path):
    """--per_example_mode=auto (the default): each measured Linear's method, timed in the first step,
    is recorded in out_dir and kept in the checkpoint; a resume takes the checkpoint's (here each one
    flipped, which no timing would give back) and does not time again."""
    flags = [*TINY, f"--dataset={tiny_dataset}", f"--out_dir={tmp_path}", "--eval_interval=2", "--linearclass=gns"]
    run_train(*flags, "--max_iters=2")
    recorded = json.loads((tmp_path / "linear_norm_methods.json").read_text())
    checkpoint = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    assert recorded and checkpoint["linear_norm_methods"] == recorded
    assert set(recorded.values()) <= {"ghost", "materialise"} and all(".c_" in name for name in recorded)
    flipped = {name: "ghost" if method == "materialise" else "materialise" for name, method in recorded.items()}
    checkpoint["linear_norm_methods"] = flipped
    torch.save(checkpoint, tmp_path / "ckpt.pt")
    run_train(*flags, "--max_iters=4", "--init_from=resume")
    assert json.loads((tmp_path / "linear_norm_methods.json").read_text()) == flipped
    assert torch.load(tmp_path / "ckpt.pt", weights_only=False)["linear_norm_methods"] == flipped


@pytest.mark.slow
def test_a_compiled_run_chooses_each_linears_method_before_compiling_and_keeps_it(tiny_dataset, tmp_path):
    """torch.compile reads no routes table: under --compile=True each "auto" Linear takes its method
    before the first step (buffered.choose_linear_norm_methods: the table's, else the shapes rule), and
    the choice is recorded and checkpointed as in eager mode."""
    flags = [*TINY, f"--dataset={tiny_dataset}", f"--out_dir={tmp_path}", "--eval_interval=2", "--linearclass=gns",
             "--compile=True"]
    run_train(*flags, "--max_iters=2")
    recorded = json.loads((tmp_path / "linear_norm_methods.json").read_text())
    assert set(recorded.values()) <= {"ghost", "materialise"}
    # every measured Linear (the head shares its weight with an unmeasured embedding: not measured)
    assert sorted(recorded) == sorted(f"transformer.h.{i}.{m}" for i in range(2)
                                      for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"))
    assert torch.load(tmp_path / "ckpt.pt", weights_only=False)["linear_norm_methods"] == recorded


# ---------------------------------------------------------------------------------------------
# a resume checks what it continues before it changes anything

@pytest.fixture(scope="module")
def short_runs(tiny_dataset, tmp_path_factory):
    """{name: out_dir} after 6 steps (checkpoint at 6, GNS columns): 'ours', two other models,
    'block_size' and 'n_layer', and another run of our model, 'seed 7', each run on first use."""
    from conftest import OnFirstUse
    others = {"ours": [], "block_size": ["--block_size=8"], "n_layer": ["--n_layer=1"], "seed 7": ["--seed=7"]}

    def make(name, folder):
        run_train(*TINY, f"--dataset={tiny_dataset}", "--eval_interval=3", "--max_iters=6", "--lnclass=shim",
                  *others[name], f"--out_dir={folder / 'out'}")
    return OnFirstUse(tmp_path_factory, "short_runs", make, result=lambda name, folder: folder / "out")


def resume(tiny_dataset, out, *flags):
    """(exit code, stderr) of a resume of out to its end, at step 6: what it says of the checkpoint and the log."""
    p = run_train(*TINY, f"--dataset={tiny_dataset}", "--eval_interval=3", "--lnclass=shim", f"--out_dir={out}",
                  "--init_from=resume", "--max_iters=6", *flags, check=False)
    return p.returncode, p.stderr


@pytest.mark.slow
@pytest.mark.parametrize("other", ["block_size", "n_layer"])
def test_another_models_checkpoint_stops_the_resume_and_leaves_everything_as_it_was(tiny_dataset, short_runs,
                                                                                    tmp_path, other):
    import shutil
    theirs = short_runs[other] / "ckpt.pt"  # first: another worker may be running 'ours' meanwhile
    out = tmp_path / "out"
    shutil.copytree(short_runs["ours"], out)
    shutil.copy(theirs, out / "ckpt.pt")
    before = {f.name: f.read_bytes() for f in out.iterdir() if f.name != "train.lock"}
    code, stderr = resume(tiny_dataset, out, f"--{other}={8 if other == 'block_size' else 1}")
    assert code == 2
    err = stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --init_from=resume:") and "another model" in err[0], stderr
    assert {f.name: f.read_bytes() for f in out.iterdir() if f.name != "train.lock"} == before


def files_in(out):
    return {f.name: f.read_bytes() for f in out.iterdir() if f.is_file() and f.name != "train.lock"}


@pytest.mark.slow
@pytest.mark.parametrize("copied", [["ckpt.pt"], ["ckpt.pt", "config.json"]], ids=["ckpt.pt", "ckpt.pt and config.json"])
def test_another_runs_checkpoint_stops_the_resume_and_leaves_everything_as_it_was(tiny_dataset, short_runs, tmp_path,
                                                                                copied):
    """The checkpoint of a --seed=7 run of the same model copied into a seed-1337 out_dir resumed, its
    rows mixed with the other run's in log.csv under a config.json of the other run; copied with its
    config.json too, the log alone is the other run's."""
    theirs = short_runs["seed 7"]
    out = tmp_path / "out"
    shutil.copytree(short_runs["ours"], out)
    for name in copied:
        shutil.copy(theirs / name, out / name)
    before = files_in(out)
    code, stderr = resume(tiny_dataset, out, "--max_iters=8")
    assert code == 2, stderr
    err = stderr.strip().splitlines()
    said = (f"{out}/ckpt.pt is another run's (run_id " if copied == ["ckpt.pt"] else
            f"{out}/log.csv's row of step 5 is not the one {out}/ckpt.pt's run logged (")
    assert len(err) == 1 and err[0].startswith(f"error: --init_from=resume: {said}") and "nothing was changed" in err[0], \
        stderr
    assert files_in(out) == before


@pytest.mark.slow
def test_an_out_dir_from_before_run_identities_resumes_and_then_keeps_one(tiny_dataset, short_runs, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(short_runs["ours"], out)
    ckpt = torch.load(out / "ckpt.pt", weights_only=False)
    del ckpt["log_row"], ckpt["config"]["run_id"]
    torch.save(ckpt, out / "ckpt.pt")
    config = json.loads((out / "config.json").read_text())
    del config["run_id"]
    (out / "config.json").write_text(json.dumps(config))
    code, stderr = resume(tiny_dataset, out, "--max_iters=7")
    assert code == 0, stderr
    resumed = torch.load(out / "ckpt.pt", weights_only=False)
    assert resumed["config"]["run_id"] == json.loads((out / "config.json").read_text())["run_id"]
    assert resumed["log_row"]["step"] == 6


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["--block_size=32", "--block_size=8"])
def test_a_resume_with_another_block_size_stops_before_it_changes_anything(tiny_dataset, short_runs, tmp_path, flag):
    """--block_size=32 on a block-16 checkpoint crashed at the first evaluation (a traceback), after it had
    rewritten config.json (and moved the rows after the checkpoint to log.csv.rejected)."""
    out = tmp_path / "out"
    shutil.copytree(short_runs["ours"], out)
    before = files_in(out)
    code, stderr = resume(tiny_dataset, out, "--max_iters=8", flag)
    assert code == 2, stderr
    assert stderr.strip().splitlines() == [
        f"error: --init_from=resume: {flag} (set on the command line), but {out}/ckpt.pt holds a model of block_size=16, "
        f"and a resume trains it as it is, on batches of its block_size; nothing was changed: resume with "
        f"--block_size=16, or train a model of {flag} in another out_dir"], stderr
    assert files_in(out) == before


@pytest.mark.slow
def test_a_resume_with_another_architecture_trains_the_checkpoints_saying_so(tiny_dataset, short_runs, tmp_path):
    """--n_layer=3 --n_embd=64 --bias=True on a resume went on with the checkpoint's 2 layers of 32 without biases,
    without a word."""
    out = tmp_path / "out"
    shutil.copytree(short_runs["ours"], out)
    p = run_train(*TINY, f"--dataset={tiny_dataset}", "--eval_interval=3", "--lnclass=shim", f"--out_dir={out}",
                  "--init_from=resume", "--max_iters=8", "--n_layer=3", "--n_embd=64", "--bias=True")
    notes = [line for line in p.stdout.splitlines() if "which this resume uses" in line]
    assert notes == [f"note: --{k}={mine} (set on the command line) is not {out}/ckpt.pt's {k}={theirs}, which this "
                     f"resume uses: a resume trains the checkpoint's model as it is"
                     for k, mine, theirs in (("n_layer", 3, 2), ("n_embd", 64, 32), ("bias", True, False))], p.stdout
    saved = torch.load(out / "ckpt.pt", weights_only=False)
    assert saved["iter_num"] == 8 and (saved["model_args"]["n_layer"], saved["model_args"]["n_embd"]) == (2, 32)
    assert json.loads((out / "config.json").read_text())["n_layer"] == 2  # config.json names the model trained


@pytest.mark.slow
def test_a_malformed_row_before_the_checkpoint_is_moved_aside_and_reported(tiny_dataset, short_runs, tmp_path):
    import shutil
    out = tmp_path / "out"
    shutil.copytree(short_runs["ours"], out)
    lines = (out / "log.csv").read_bytes().splitlines(keepends=True)
    (out / "log.csv").write_bytes(b"".join([*lines[:3], b"2,this is, not a row\r\n", *lines[3:]]))
    code, stderr = resume(tiny_dataset, out)
    assert code == 0
    assert f"warning: {out / 'log.csv'} line 4: the cell 'this is' is not a number; moved to log.csv.rejected" \
        in stderr.splitlines(), stderr
    assert (out / "log.csv").read_bytes() == b"".join(lines)
    assert (out / "log.csv.rejected").read_bytes() == b"2,this is, not a row\r\n"


@pytest.mark.slow
@pytest.mark.parametrize("log", ["empty", "missing"])
def test_a_resume_onto_an_empty_or_missing_log_says_the_steps_are_gone(tiny_dataset, short_runs, tmp_path, log):
    import shutil
    out = tmp_path / "out"
    shutil.copytree(short_runs["ours"], out)
    if log == "empty":
        (out / "log.csv").write_bytes(b"")
    else:
        (out / "log.csv").unlink()
    code, stderr = resume(tiny_dataset, out)
    assert code == 0
    assert f"warning: {out / 'log.csv'} is {log}: steps 0 to 5 are missing (the run resumes at step 6)" \
        in stderr.splitlines(), stderr


@pytest.mark.slow
def test_a_checkpoint_from_before_saved_data_orders_resumes_saying_the_order_restarts(tiny_dataset, short_runs,
                                                                                       tmp_path):
    import shutil
    out = tmp_path / "out"
    shutil.copytree(short_runs["ours"], out)
    ckpt = torch.load(out / "ckpt.pt", weights_only=False)
    del ckpt["data_order"], ckpt["nonfinite_steps"]
    torch.save(ckpt, out / "ckpt.pt")
    p = run_train(*TINY, f"--dataset={tiny_dataset}", "--eval_interval=3", "--lnclass=shim", f"--out_dir={out}",
                  "--init_from=resume", "--max_iters=7")
    notes = [line for line in p.stdout.splitlines() if "data order" in line]
    assert notes == ["note: ckpt.pt holds no data order (it predates them): the train batches' order restarts at "
                     "iter 6, so the run does not continue as the interrupted one would have"]
    assert torch.load(out / "ckpt.pt", weights_only=False)["iter_num"] == 7


# -- checkpoints written by other versions ------------------------------------------------------------
# tests/fixtures/checkpoints/<writer>/: out_dirs of a few CPU float32 steps (WRITERS: the steps each holds) of a
# 1-layer GPT on the tiny dataset, written by each program as it was shipped (see the README there)
FIXTURE_CHECKPOINTS = os.path.join(REPO, "tests", "fixtures", "checkpoints")
WRITERS = {  # writer: (the steps its checkpoint holds, its AdamW's param groups' 'fused')
    "nanogpt": (4, None), "reference": (5, None), "main-6145093": (4, None), "main-a92b74b": (4, True)}


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_a_checkpoint_of_an_earlier_version_or_of_the_reference_resumes_on_the_fused_step(tiny_dataset, tmp_path,
                                                                                          writer):
    out = tmp_path / "out"
    shutil.copytree(os.path.join(FIXTURE_CHECKPOINTS, writer), out)
    steps, fused = WRITERS[writer]
    saved = torch.load(out / "ckpt.pt", weights_only=False)
    assert saved["iter_num"] == steps and {g["fused"] for g in saved["optimizer"]["param_groups"]} == {fused}
    data = tmp_path / "tinydata"  # the folder's name: what the checkpoints without a fingerprint compare
    shutil.copytree(tiny_dataset, data)
    flags = ["--device=cpu", "--dtype=float32", "--compile=False", "--eval_iters=2", "--log_interval=1",
             "--device_name='M1_eflops'", "--batch_size=4", "--block_size=16", "--gradient_accumulation_steps=2",
             "--eval_interval=100",
             f"--dataset={data}", f"--out_dir={out}", "--init_from=resume", f"--max_iters={steps + 2}",
             *([] if writer == "nanogpt" else ["--lnclass=shim"])]
    p = run_train(*flags, check=False)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert re.findall(r"^iter (\d+):", p.stdout, re.M) == [str(steps), str(steps + 1)]
    resumed = torch.load(out / "ckpt.pt", weights_only=False)
    assert resumed["iter_num"] == steps + 2
    assert all(g["fused"] for g in resumed["optimizer"]["param_groups"])  # this run's AdamW, fused
    # the moments went on from the checkpoint's: a fresh AdamW would have stepped 2 times, not steps + 2
    assert {int(s["step"]) for s in resumed["optimizer"]["state"].values()} == {steps + 2}


@pytest.mark.slow
def test_a_resume_on_a_shuffled_train_bin_of_the_same_size_stops_and_the_same_data_moved_goes_on(tiny_dataset,
                                                                                                 short_runs, tmp_path):
    import numpy as np
    out = tmp_path / "out"
    shutil.copytree(short_runs["ours"], out)
    trained_on = torch.load(out / "ckpt.pt", weights_only=False)["config"]["dataset"]  # the worker's own copy
    shuffled = tmp_path / "shuffled"
    shutil.copytree(tiny_dataset, shuffled)
    tokens = np.fromfile(shuffled / "train.bin", dtype=np.uint16)
    np.random.default_rng(0).permutation(tokens).tofile(shuffled / "train.bin")
    assert (shuffled / "train.bin").stat().st_size == os.path.getsize(os.path.join(tiny_dataset, "train.bin"))
    before = {f.name: f.read_bytes() for f in out.iterdir() if f.is_file() and f.name != "train.lock"}
    code, stderr = resume(tiny_dataset, out, f"--dataset={shuffled}")
    assert code == 2, stderr
    err = stderr.strip().splitlines()
    assert len(err) == 1 and f"was trained on --dataset={trained_on!r}, this run reads --dataset={str(shuffled)!r}" \
        in err[0] and "nothing was changed" in err[0], stderr
    assert {f.name: f.read_bytes() for f in out.iterdir() if f.is_file() and f.name != "train.lock"} == before
    moved = tmp_path / "moved" / "renamed"
    shutil.copytree(tiny_dataset, moved)
    code, stderr = resume(tiny_dataset, out, f"--dataset={moved}")
    assert code == 0, stderr
