"""bench/throughput.py end to end on a tiny GPT: the table and the CSV hold every setting asked
for with positive numbers, each run is train.py's own (its log's dt after the warmup, its peak
memory, its profile), another checkout is timed beside this one, and bad input is one line. No
timing assertions: this machine's speed is nobody's contract."""
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
        "--iters=2", "--rounds=1", "--warmup=1", "--threads=1"]


def bench(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, BENCH, *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=240)


@pytest.mark.slow
def test_settings_table_and_csv(tmp_path):
    # two settings asked for; nn is added as the baseline
    out = tmp_path / "bench.csv"
    done = bench(*TINY, "--settings", "ln-fused,hooks-exact", "--csv", str(out))
    assert done.returncode == 0, done.stdout + done.stderr

    with open(out) as f:
        rows = list(csv.DictReader(f))
    assert [r["setting"] for r in rows] == ["nn", "ln-fused", "hooks-exact"]
    for r in rows:
        for key in ("ms_per_iter", "tokens_per_s", "ratio", "ratio_rounds", "ratio_min", "ratio_max", "peak_mem_mib", "mem_ratio"):
            assert float(r[key]) > 0, (r["setting"], key, r[key])
        # tokens/s is the tokens of one iteration (2 x 8) over its time
        assert float(r["tokens_per_s"]) == pytest.approx(16 / (float(r["ms_per_iter"]) / 1e3), rel=1e-6)
    assert float(rows[0]["ratio"]) == 1.0 and float(rows[0]["mem_ratio"]) == 1.0
    assert [r["flags"] for r in rows] == ["(plain nn)", "--lnclass=fused", "--gns_hooks=exact"]

    # the printed table has one line per setting, with the same numbers
    table = {line.split()[0]: line.split() for line in done.stdout.splitlines()
             if line.split()[:1] in (["nn"], ["ln-fused"], ["hooks-exact"])}
    assert set(table) == {"nn", "ln-fused", "hooks-exact"}
    for r in rows:
        assert float(table[r["setting"]][1]) == pytest.approx(float(r["ms_per_iter"]), abs=0.006)


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


def tiny_args(throughput, work, **changes):
    args = throughput.parse_args([*TINY, "--warmup=2", "--iters=3"])
    os.makedirs(os.path.join(work, "data"))
    throughput.write_dataset(os.path.join(work, "data"), args.vocab_size, args.block_size, args.seed)
    return argparse.Namespace(**{**vars(args), **changes})


def test_a_run_is_train_py_timed_by_its_log_after_the_warmup(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    throughput = load_bench()
    args = tiny_args(throughput, str(tmp_path))
    run = throughput.run_train(ROOT, "nn", args, str(tmp_path), args.warmup + args.iters)
    assert len(run["dts"]) == 3 and all(dt > 0 for dt in run["dts"])  # iterations 2, 3, 4 of 0..4
    assert run["peak"] > 0 and "number of parameters" in run["stdout"]
    assert os.listdir(tmp_path) == ["data"]  # the run's out_dir is removed


def test_a_llama_setting_runs_train_py_with_the_llama_style_flags(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    throughput = load_bench()
    args = tiny_args(throughput, str(tmp_path))
    run = throughput.run_train(ROOT, "llama-all-gns", args, str(tmp_path), args.warmup + args.iters)
    assert len(run["dts"]) == 3 and all(dt > 0 for dt in run["dts"])
    for flag, value in throughput.LLAMA.items():  # as train.py read them
        assert f"Overriding: {flag} = {value!r}" in run["stdout"]


def test_a_profiled_run_profiles_the_iterations_after_the_warmup(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    throughput = load_bench()
    args = tiny_args(throughput, str(tmp_path))
    path = tmp_path / "profile.json"
    throughput.run_train(ROOT, "nn", args, str(tmp_path), args.warmup + args.iters, profile=str(path))
    result = json.loads(path.read_text())
    assert result["wall_s"] > 0 and result["self_us"]["aten::mm"] > 0 and "MmBackward0" in result["node_us"]
    step = next(line for line in result["table"].splitlines() if "Optimizer.step#AdamW.step" in line)
    assert step.split()[-1] == "3"  # calls: the three timed iterations' steps


@pytest.mark.slow
def test_another_checkout_is_timed_in_the_same_rounds_against_its_own_baseline(tmp_path):
    other = tmp_path / "before"
    shutil.copytree(ROOT, other, ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__", "out*"))
    with open(other / "train.py", "a") as f:  # each run of the copy's train.py leaves a line
        f.write("\nopen(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'ran'), 'a').write('ran\\n')\n")
    out = tmp_path / "bench.csv"
    done = bench(*TINY, "--settings", "nn", "--repo", ROOT, "--repo", str(other), "--csv", str(out), "--no_memory")
    assert done.returncode == 0, done.stdout + done.stderr
    with open(out) as f:
        rows = list(csv.DictReader(f))
    assert [(r["setting"], r["repo"]) for r in rows] == [("nn", ROOT), ("nn", str(other))]
    for r in rows:  # each checkout's nn is its own baseline (the two runs' times differ)
        assert float(r["ratio"]) == 1.0 and float(r["ratio_rounds"]) == 1.0
        assert math.isnan(float(r["peak_mem_mib"])) and math.isnan(float(r["mem_ratio"]))  # --no_memory
    assert (other / "ran").read_text() == "ran\n"  # timed, and not again for memory
    assert "peak memory: not measured (--no_memory)" in done.stdout and "nan" not in done.stdout  # "-" instead
    assert not os.path.exists(os.path.join(ROOT, "ran"))


def test_modes_time_each_setting_eager_and_compiled_against_the_same_modes_baseline(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    throughput = load_bench()
    args = throughput.parse_args([*TINY, "--modes", "eager,compiled"])
    assert args.modes == [False, True] and throughput.parse_args([*TINY, "--compile"]).modes == [True]
    seen = []
    monkeypatch.setattr(throughput, "run_train", lambda repo, s, args, work, iters, memory=False, profile=None,
                        compiled=None: seen.append((s, compiled)) or dict(
                            dts=[0.1 if s == "nn" else 0.2 if compiled else 0.4] * 2, peak=1, stdout=""))
    out = tmp_path / "bench.csv"
    assert throughput.main([*TINY, "--modes", "eager,compiled", "--settings", "ln-shim", "--csv", str(out),
                            "--no_memory"]) == 0
    assert seen == [("nn", False), ("nn", True), ("ln-shim", False), ("ln-shim", True)]  # side by side in a round
    with open(out) as f:
        rows = [(r["setting"], r["compile"], float(r["ratio"])) for r in csv.DictReader(f)]
    assert rows == [("nn", "False", 1.0), ("nn", "True", 1.0), ("ln-shim", "False", 0.25), ("ln-shim", "True", 0.5)]
    # train.py gets --compile from the mode
    flags = throughput.train_flags(args, "d", "o", 3, compiled=True)
    assert flags["compile"] is True and throughput.train_flags(args, "d", "o", 3)["compile"] is False


def test_profile_passes_sets_how_many_profiled_runs_each_setting_gets(tmp_path, monkeypatch, capsys):
    throughput = load_bench()
    profiled = []

    def fake_run(repo, s, args, work, iters, memory=False, profile=None, compiled=None):
        if profile:
            profiled.append(s)
            with open(profile, "w") as f:
                json.dump(dict(wall_s=0.1, self_us={"aten::mm": 10.0}, node_us={}, table=f"table of {s}",
                               device_table=f"kernels of {s}" if s == "ln-shim" else None), f)
        return dict(dts=[0.1] * 2, peak=1, stdout="")
    monkeypatch.setattr(throughput, "run_train", fake_run)
    assert throughput.main([*TINY, "--settings", "ln-shim", "--profile", "ln-shim", "--profile_passes", "1",
                            "--no_memory"]) == 0
    assert profiled == ["nn", "ln-shim"]
    out = capsys.readouterr().out
    assert "1 x " in out and "the same by GPU time (the top kernels):\nkernels of ln-shim" in out
    profiled.clear()
    assert throughput.main([*TINY, "--settings", "ln-shim", "--profile", "ln-shim", "--no_memory"]) == 0
    assert profiled == ["nn", "ln-shim"] * throughput.PROFILE_PASSES


def test_settings_that_differ_by_their_gpu_environment_alone_run_by_default_only_on_a_gpu(monkeypatch):
    throughput = load_bench()
    on_cpu = throughput.parse_args(["--quick"]).settings
    monkeypatch.setattr(throughput.torch.cuda, "is_available", lambda: True)  # as on a GPU machine
    on_gpu = throughput.parse_args(["--quick", "--device", "cuda"]).settings
    assert set(throughput.SETTING_ENV) <= set(on_gpu) and not set(throughput.SETTING_ENV) & set(on_cpu)
    assert set(on_gpu) == set(throughput.SETTINGS) and "ln-fused" in on_cpu
    assert "ln-fused-op" in throughput.parse_args(["--settings", "ln-fused-op"]).settings  # asked for: run
    assert throughput.SETTING_ENV["ln-fused-op"] == {"NORMGNORM_TRITON_OP": "1"}
