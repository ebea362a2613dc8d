"""bench/throughput.py end to end on a tiny GPT: the table and the CSV hold every setting asked
for with positive numbers, and bad input is one line. No timing assertions: this machine's
speed is nobody's contract."""
import csv
import importlib.util
import os
import subprocess
import sys

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


@pytest.mark.parametrize("args, message", [
    (["--settings", "nn,bogus"], "unknown setting(s) bogus"),
    (["--n_embd=30", "--n_head=4"], "is not divisible by --n_head=4"),
    (["--iters=0"], "--iters: 0 is not positive"),
    (["--dtype=float8"], "invalid choice"),
    (["--csv", "/no/such/folder/x.csv"], "does not exist"),
])
def test_bad_input_is_one_line(args, message, capsys):
    spec = importlib.util.spec_from_file_location("throughput", BENCH)
    throughput = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(throughput)
    with pytest.raises(SystemExit) as exit_info:
        throughput.main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
