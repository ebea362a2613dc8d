"""bench/throughput.py end to end on a tiny GPT: the table and the CSV hold every setting asked
for, and the null setting, with positive numbers; each run is train.py's own, timed over a window
that begins and ends with the device synchronised (its peak memory, its profile); another checkout
is timed beside this one; --time_limit stops in time; bad input is one line. No timing assertions:
this machine's speed is nobody's contract."""
import argparse
import csv
import importlib.util
import json
import math
import os
import pickle
import shutil
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench", "throughput.py")
TINY = ["--n_layer=1", "--n_embd=16", "--n_head=2", "--block_size=8", "--batch_size=2",
        "--iters=2", "--rounds=1", "--warmup=2", "--threads=1"]


def bench(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, BENCH, *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=240)


@pytest.mark.slow
def test_settings_table_and_csv(tmp_path):
    # two settings asked for; nn is added as the baseline, nn-null as the noise floor
    out = tmp_path / "bench.csv"
    done = bench(*TINY, "--settings", "ln-fused,hooks-exact", "--csv", str(out))
    assert done.returncode == 0, done.stdout + done.stderr

    with open(out) as f:
        rows = list(csv.DictReader(f))
    names = ["nn", "nn-null", "ln-fused", "hooks-exact"]
    assert [r["setting"] for r in rows] == names
    for r in rows:
        for key in ("ms_per_iter", "host_ms_per_step", "tokens_per_s", "ratio", "ratio_rounds", "ratio_min",
                    "ratio_max", "setup_s", "peak_mem_mib", "mem_ratio"):
            assert float(r[key]) > 0, (r["setting"], key, r[key])
        assert math.isnan(float(r["device_ms_per_step"]))  # no device events on the CPU
        # tokens/s is the tokens of one iteration (2 x 8) over its time
        assert float(r["tokens_per_s"]) == pytest.approx(16 / (float(r["ms_per_iter"]) / 1e3), rel=1e-6)
    assert float(rows[0]["ratio"]) == 1.0 and float(rows[0]["mem_ratio"]) == 1.0
    assert [r["flags"] for r in rows] == ["(plain nn)", "(plain nn)", "--lnclass=fused", "--gns_hooks=exact"]

    # the printed table has one line per setting, with the same numbers, and the noise floor its line
    table = {line.split()[0]: line.split() for line in done.stdout.splitlines() if line.split()[:1] in [[n] for n in names]}
    assert set(table) == set(names)
    for r in rows:
        assert float(table[r["setting"]][1]) == pytest.approx(float(r["ms_per_iter"]), abs=0.006)
    assert f"noise floor: nn-null, nn's flags under a second name, at {float(rows[1]['ratio']):.3f}x of nn" in done.stdout


def load_bench():
    spec = importlib.util.spec_from_file_location("throughput", BENCH)
    throughput = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(throughput)
    return throughput


@pytest.mark.parametrize("args, message", [
    (["--settings", "nn,bogus"], "unknown setting(s) bogus"),
    (["--settings", "lnclass=shim+fused"], "is not flag=value[+flag=value...]"),
    (["--settings", "lnclass=shim+n_layer=2"], "sets --n_layer, which the bench sets itself; use the bench flag --n_layer"),
    (["--settings", "out_dir=x"], "sets --out_dir, which the bench sets itself"),
    (["--n_embd=30", "--n_head=4"], "is not divisible by --n_head=4"),
    (["--iters=0"], "--iters: 0 is not positive"),
    (["--dtype=float8"], "invalid choice"),
    (["--vocab_size=70000"], "uint16 tokens"),
    (["--csv", "/no/such/folder/x.csv"], "does not exist"),
    (["--repo", "/no/such/checkout"], "--repo /no/such/checkout: there is no train.py in it"),
    (["--modes", "eager,fast"], "give eager, compiled or eager,compiled"),
    (["--compile", "--modes", "eager"], "--compile is --modes compiled"),
    (["--warmup=1"], "--warmup: 1: give at least 2 (train.py reads the device after its first step"),
    (["--time_limit=0"], "--time_limit: 0 is not above 0"),
    (["--profile_only"], "--profile_only profiles the settings of --profile; give them"),
])
def test_bad_input_is_one_line(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_bench().main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_a_value_train_py_refuses_is_its_one_line_and_exit_2(capsys, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert load_bench().main([*TINY, "--settings", "lnclass=bogus"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "lnclass=bogus" in err and "is not one of nn, shim, fused" in err, err


def test_the_dataset_is_random_uint16_tokens_with_the_vocabulary_in_meta_pkl_but_gpt2s(tmp_path):
    throughput = load_bench()
    for vocab, folder in ((65, tmp_path / "char"), (throughput.GPT2_VOCAB, tmp_path / "gpt2")):
        folder.mkdir()
        throughput.write_dataset(str(folder), vocab, block_size=32, seed=0)
        for split in ("train", "val"):
            tokens = np.fromfile(folder / f"{split}.bin", dtype=np.uint16)
            assert len(tokens) > 32 and tokens.max() < vocab and tokens.max() > vocab // 2
    with open(tmp_path / "char" / "meta.pkl", "rb") as f:
        assert pickle.load(f) == {"vocab_size": 65}
    assert not (tmp_path / "gpt2" / "meta.pkl").exists()  # train.py then takes 50304


def fake_run(ms, seconds=1.0, peak=1):
    """What run_train returns of a timed run of `ms` milliseconds per iteration that took `seconds`."""
    return dict(ms=ms, host_ms=ms / 2, device_ms=math.nan, setup_s=seconds / 2, run_s=seconds, peak=peak,
                synced_at=[2, 4], stdout="")


def tiny_args(throughput, work, **changes):
    args = throughput.parse_args([*TINY, "--warmup=2", "--iters=3"])
    os.makedirs(os.path.join(work, "data"))
    throughput.write_dataset(os.path.join(work, "data"), args.vocab_size, args.block_size, args.seed)
    return argparse.Namespace(**{**vars(args), **changes})


def test_a_run_is_train_py_timed_over_a_window_between_two_synchronisations(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    throughput = load_bench()
    args = tiny_args(throughput, str(tmp_path))
    run = throughput.run_train(ROOT, "nn", args, str(tmp_path))
    # synchronised after train.py's 2nd and 5th optimizer steps: the window is the 3 steps between
    assert run["synced_at"] == [2, 5]
    assert run["ms"] > 0 and run["host_ms"] > 0 and math.isnan(run["device_ms"]) and 0 < run["setup_s"] < run["run_s"]
    assert run["peak"] > 0 and "number of parameters" in run["stdout"]
    # train.py evaluated before its first step, and the run ended with the window, before the last step's evaluation
    assert "step 0: train loss" in run["stdout"] and "step 5: train loss" not in run["stdout"]
    assert os.listdir(tmp_path) == ["data"]  # the run's out_dir is removed


class FakeDevice:
    """A device whose work the test queues: sync() finishes it; the clock reads the host's time."""

    def __init__(self):
        self.log, self.now = [], 0.0

    def sync(self):
        self.log.append("sync")

    def clock(self):
        self.log.append("clock")
        return self.now


def test_the_window_begins_and_ends_with_the_device_synchronised():
    throughput = load_bench()
    device = FakeDevice()
    clock = throughput.StepClock(warmup=2, iters=3, sync=device.sync, clock=device.clock)
    ends = []
    for step in range(1, 8):
        device.now += step  # the host's time grows by 1, 2, 3, ... s per step
        ends.append(clock.after_step())
        if step in (2, 5):  # the window's first and last step: synchronised, then the time read
            assert device.log[-2:] == ["sync", "clock"], (step, device.log)
    assert device.log.count("sync") == 2 and clock.synced_at == [2, 5]
    assert ends == [False, False, False, False, True, True, True]
    result = clock.result()
    # from the end of step 2 (t = 3) to the end of step 5 (t = 15): steps 3, 4, 5 of 3, 4 and 5 s
    assert result["wall_s"] == 12 and result["host_s"] == [3, 4, 5] and result["device_s"] is None
    # with device events: each step's time between the events recorded at its two ends
    events = []

    class Event:
        def __init__(self):
            self.at = len(events) * 0.25
            events.append(self)

        def elapsed_time(self, later):  # milliseconds, as torch.cuda.Event's
            return (later.at - self.at) * 1e3
    clock = throughput.StepClock(warmup=2, iters=3, sync=device.sync, event=Event, clock=device.clock)
    while not clock.after_step():
        pass
    assert len(events) == 4 and clock.result()["device_s"] == [0.25, 0.25, 0.25]


def test_a_llama_setting_runs_train_py_with_the_llama_style_flags(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    throughput = load_bench()
    args = tiny_args(throughput, str(tmp_path))
    run = throughput.run_train(ROOT, "llama-all-gns", args, str(tmp_path))
    assert run["ms"] > 0 and run["synced_at"] == [2, 5]
    for flag, value in throughput.LLAMA.items():  # as train.py read them
        assert f"Overriding: {flag} = {value!r}" in run["stdout"]


def test_a_profiled_run_profiles_the_iterations_after_the_warmup(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    throughput = load_bench()
    args = tiny_args(throughput, str(tmp_path))
    path = tmp_path / "profile.json"
    throughput.run_train(ROOT, "nn", args, str(tmp_path), profile=str(path))
    result = json.loads(path.read_text())
    assert result["wall_s"] > 0 and result["self_us"]["aten::mm"] > 0 and "MmBackward0" in result["node_us"]
    step = next(line for line in result["table"].splitlines() if "Optimizer.step#AdamW.step" in line)
    assert step.split()[-1] == "3"  # calls: the three timed iterations' steps


@pytest.mark.slow
def test_another_checkout_is_timed_in_the_same_rounds_against_its_own_baseline(tmp_path):
    other = tmp_path / "before"
    shutil.copytree(ROOT, other, ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__", "out*"))
    with open(other / "train.py") as f:
        code = f.read()
    with open(other / "train.py", "w") as f:  # each run of the copy's train.py leaves a line
        f.write("import os; open(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'ran'), 'a').write('ran\\n')\n"
                + code)
    out = tmp_path / "bench.csv"
    done = bench(*TINY, "--settings", "nn", "--repo", ROOT, "--repo", str(other), "--csv", str(out), "--no_memory")
    assert done.returncode == 0, done.stdout + done.stderr
    with open(out) as f:
        rows = list(csv.DictReader(f))
    assert [(r["setting"], r["repo"]) for r in rows] == [("nn", ROOT), ("nn", str(other)), ("nn-null", ROOT),
                                                         ("nn-null", str(other))]
    for r in rows[:2]:  # each checkout's nn is its own baseline (the two runs' times differ)
        assert float(r["ratio"]) == 1.0 and float(r["ratio_rounds"]) == 1.0
    for r in rows:
        assert math.isnan(float(r["peak_mem_mib"])) and math.isnan(float(r["mem_ratio"]))  # --no_memory
    assert (other / "ran").read_text() == "ran\n" * 2  # nn and nn-null timed, and not again for memory
    assert "peak memory: not measured (--no_memory)" in done.stdout and "nan" not in done.stdout  # "-" instead
    assert not os.path.exists(os.path.join(ROOT, "ran"))


def test_modes_time_each_setting_eager_and_compiled_against_the_same_modes_baseline(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    throughput = load_bench()
    args = throughput.parse_args([*TINY, "--modes", "eager,compiled"])
    assert args.modes == [False, True] and throughput.parse_args([*TINY, "--compile"]).modes == [True]
    seen = []
    monkeypatch.setattr(throughput, "run_train", lambda repo, s, args, work, memory=False, profile=None,
                        compiled=None: seen.append((s, compiled)) or
                        fake_run(100 if "nn" in s else 200 if compiled else 400))
    out = tmp_path / "bench.csv"
    assert throughput.main([*TINY, "--modes", "eager,compiled", "--settings", "ln-shim", "--csv", str(out),
                            "--no_memory"]) == 0
    # side by side in a round
    assert seen == [("nn", False), ("nn", True), ("nn-null", False), ("nn-null", True), ("ln-shim", False),
                    ("ln-shim", True)]
    with open(out) as f:
        rows = [(r["setting"], r["compile"], float(r["ratio"])) for r in csv.DictReader(f)]
    assert rows == [("nn", "False", 1.0), ("nn", "True", 1.0), ("nn-null", "False", 1.0), ("nn-null", "True", 1.0),
                    ("ln-shim", "False", 0.25), ("ln-shim", "True", 0.5)]
    # train.py gets --compile from the mode
    flags = throughput.train_flags(args, "d", "o", 3, compiled=True)
    assert flags["compile"] is True and throughput.train_flags(args, "d", "o", 3)["compile"] is False


def test_profile_passes_sets_how_many_profiled_runs_each_setting_gets(tmp_path, monkeypatch, capsys):
    throughput = load_bench()
    profiled = []

    def fake_profiled_run(repo, s, args, work, memory=False, profile=None, compiled=None):
        if profile:
            profiled.append(s)
            with open(profile, "w") as f:
                json.dump(dict(wall_s=0.1, self_us={"aten::mm": 10.0}, node_us={}, table=f"table of {s}",
                               device_table=f"kernels of {s}" if s == "ln-shim" else None), f)
        return fake_run(100)
    monkeypatch.setattr(throughput, "run_train", fake_profiled_run)
    assert throughput.main([*TINY, "--settings", "ln-shim", "--profile", "ln-shim", "--profile_passes", "1",
                            "--no_memory"]) == 0
    assert profiled == ["nn", "ln-shim"]
    out = capsys.readouterr().out
    assert "1 x " in out and "the same by GPU time (the top kernels):\nkernels of ln-shim" in out
    profiled.clear()
    assert throughput.main([*TINY, "--settings", "ln-shim", "--profile", "ln-shim", "--no_memory"]) == 0
    assert profiled == ["nn", "ln-shim"] * throughput.PROFILE_PASSES
    # --profile_only: no timing rounds before it, so no table
    profiled.clear()
    capsys.readouterr()
    assert throughput.main([*TINY, "--settings", "ln-shim", "--profile", "ln-shim", "--profile_passes", "1",
                            "--profile_only"]) == 0
    assert profiled == ["nn", "ln-shim"] and "vs nn" not in capsys.readouterr().out


def test_no_setting_is_chosen_by_the_environment():
    """Every route is chosen by flags or by measurement: no setting exists to set an environment switch."""
    throughput = load_bench()
    assert not {"ln-fused-op", "llama-rms-fused-op", "all-gns-kernel"} & set(throughput.SETTINGS)
    assert not hasattr(throughput, "SETTING_ENV")
    assert set(throughput.parse_args(["--quick"]).settings) == set(throughput.SETTINGS)


def test_the_null_setting_and_the_baseline_are_in_every_run():
    throughput = load_bench()
    for asked in (["--settings", "ln-fused"], ["--settings", "nn-null,ln-fused,nn"], []):
        settings = list(throughput.parse_args(["--quick", *asked]).settings)
        assert settings[:2] == ["nn", "nn-null"] and "ln-fused" in settings and len(set(settings)) == len(settings)
    assert throughput.SETTINGS["nn-null"] == throughput.SETTINGS["nn"] == {}


def test_every_run_shares_the_compile_cache(tmp_path, monkeypatch):
    throughput = load_bench()
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    args = throughput.parse_args(["--quick"])
    assert args.compile_cache is None  # torch's own folder, which every run shares
    env = throughput.run_env("ln-fused", args)
    assert "TORCHINDUCTOR_CACHE_DIR" not in env
    assert env["TORCHINDUCTOR_FX_GRAPH_CACHE"] == env["TORCHINDUCTOR_AUTOGRAD_CACHE"] == "1"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "from-env"))
    args = throughput.parse_args(["--quick"])
    assert {throughput.run_env(s, args)["TORCHINDUCTOR_CACHE_DIR"] for s in args.settings} == {str(tmp_path / "from-env")}
    args = throughput.parse_args(["--quick", "--compile_cache", "cache"])
    assert {throughput.run_env(s, args)["TORCHINDUCTOR_CACHE_DIR"] for s in args.settings} == {os.path.abspath("cache")}
    # and the runs' commands carry it: one train.py run, its environment seen
    seen = []
    monkeypatch.setattr(throughput.subprocess, "run", lambda cmd, cwd, env, **kw: seen.append(env) or
                        subprocess.CompletedProcess(cmd, 3, "", "boom"))
    with pytest.raises(throughput.BenchError):
        throughput.run_train(ROOT, "nn", args, str(tmp_path), compiled=True)
    assert seen[0]["TORCHINDUCTOR_CACHE_DIR"] == os.path.abspath("cache")


def test_the_timed_runs_threads_wait_as_train_pys_do(monkeypatch):
    """train.py sets OMP_WAIT_POLICY=PASSIVE before torch loads; the wrapper loads torch first, so the
    environment says it (a policy given is kept)."""
    throughput = load_bench()
    args = throughput.parse_args(["--quick"])
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert throughput.run_env("nn", args)["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert throughput.run_env("nn", args)["OMP_WAIT_POLICY"] == "ACTIVE"


def test_time_limit_starts_no_run_that_would_not_end_in_time(tmp_path, monkeypatch, capsys):
    """Runs of 10 s (the clock is the test's): within 45 s, round 1's three runs (30 s) and round 2's nn (40 s);
    nn-null would end at 50 s. What was timed is reported, in the table and the CSV."""
    throughput = load_bench()
    now = [0.0]
    monkeypatch.setattr(throughput.time, "monotonic", lambda: now[0])

    def ten_seconds(repo, s, args, work, memory=False, profile=None, compiled=None):
        now[0] += 10
        return fake_run(100 if "nn" in s else 125, seconds=10)
    monkeypatch.setattr(throughput, "run_train", ten_seconds)
    out = tmp_path / "bench.csv"
    assert throughput.main([*TINY, "--settings", "ln-shim", "--rounds", "5", "--time_limit", "45", "--csv", str(out),
                            "--no_memory"]) == 0
    assert now[0] == 40
    printed = capsys.readouterr().out
    assert "round 2/5: nn 100.0 ms/iter" in printed and "stopped before round 2 ended" in printed
    with open(out) as f:
        rows = {r["setting"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"nn", "nn-null", "ln-shim"} and rows["nn"]["rounds"] == "2" and rows["ln-shim"]["rounds"] == "1"
    assert float(rows["ln-shim"]["ratio"]) == 0.8


def test_a_setting_never_timed_within_the_limit_is_named(monkeypatch, capsys):
    throughput = load_bench()
    now = [0.0]
    monkeypatch.setattr(throughput.time, "monotonic", lambda: now[0])

    def slow(repo, s, args, work, memory=False, profile=None, compiled=None):
        now[0] += 30
        return fake_run(100, seconds=30)
    monkeypatch.setattr(throughput, "run_train", slow)
    assert throughput.main([*TINY, "--settings", "ln-shim", "--time_limit", "45", "--no_memory"]) == 0
    assert "not timed within --time_limit 45 s: nn-null, ln-shim" in capsys.readouterr().out  # 30 s + 30 s > 45 s


def test_on_cuda_peak_memory_is_the_timed_runs(monkeypatch):
    """On a GPU no extra run measures memory: each setting's peak is the largest of its timed runs'."""
    throughput = load_bench()
    monkeypatch.setattr(throughput.torch.cuda, "is_available", lambda: True)  # as on a GPU machine
    args = throughput.parse_args([*TINY, "--device", "cuda", "--settings", "ln-shim"])
    v = (args.repo[0], False)
    keys = [(v, s) for s in args.settings]
    runs = {(v, "nn"): {0: fake_run(100, peak=2**20), 1: fake_run(100, peak=2 * 2**20)},
            (v, "nn-null"): {0: fake_run(100, peak=2 * 2**20)},
            (v, "ln-shim"): {0: fake_run(200, peak=3 * 2**20), 1: fake_run(100, peak=2**20)}}
    rows = {r["setting"]: r for r in throughput.result_rows(keys, runs, {k: math.nan for k in keys}, args)}
    assert rows["ln-shim"]["peak_mem_mib"] == 3 and rows["ln-shim"]["mem_ratio"] == 1.5
    # ratios: medians over the rounds each ran (150 ms against 100), and round by round (0.5, 1.0)
    assert rows["ln-shim"]["ratio"] == pytest.approx(100 / 150)
    assert (rows["ln-shim"]["ratio_min"], rows["ln-shim"]["ratio_max"]) == (0.5, 1.0)
    assert rows["nn-null"]["rounds"] == 1 and rows["nn-null"]["ratio"] == 1.0
