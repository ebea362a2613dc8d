"""
The same training three ways, for tests/test_gnsmeter.py, test_hf_gns.py and test_lightning_gns.py:
a tiny Hugging Face GPT-2 (random weights), fixed token rows taken in order, AdamW, gradient
accumulation and clipping, with the GNS measured by our own loop (gnsmeter.GNSMeter), the
Hugging Face Trainer callback or the Lightning one. Each writes log.csv; gns_columns() reads its GNS cells.
"""
import csv
import math
import os

import torch

from gns_fixtures import tiny_hf

VOCAB, T = 97, 16  # tiny_hf's vocabulary and positions
LR = 1e-3


def token_rows(n, seed=1):
    return torch.randint(0, VOCAB, (n, T), generator=torch.Generator().manual_seed(seed))


def micro_batches(rows, batch):
    return [rows[i:i + batch] for i in range(0, len(rows), batch)]


def own_loop(out_dir, rows, batch, accumulation, steps, max_grad_norm, model=None, meter_state=None, first_step=0):
    """Train tiny_hf('gpt2') (or `model`) on `rows` in order with our loop; returns the model, the
    optimizer and the meter (closed). first_step: the step to start at (a resume: model, optimizer
    state and meter_state given)."""
    from nanogns.meter import GNSMeter
    model = tiny_hf("gpt2").train() if model is None else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    meter = GNSMeter(model, out_dir=out_dir)
    if meter_state is not None:
        meter.load_state_dict(meter_state)
    chunks = micro_batches(rows, batch)
    for step in range(first_step, steps):
        for x in chunks[step * accumulation:(step + 1) * accumulation]:
            (model(input_ids=x, labels=x).loss / accumulation).backward()
        meter.step()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    meter.close()
    return model, optimizer, meter


def gns_columns(out_dir):
    """{step: {column: value}} of the exact estimator's cells in out_dir/log.csv."""
    with open(os.path.join(out_dir, "log.csv"), newline="") as f:
        return {int(row["step"]): {k: float(v) for k, v in row.items() if k.startswith("train/gns/") and v != ""}
                for row in csv.DictReader(f)}


def largest_difference(a, b):
    """The largest relative difference between two gns_columns() of the same steps and columns."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    worst = 0.0
    for step in a:
        assert a[step].keys() == b[step].keys()
        assert len(a[step]) > 0
        for column, value in a[step].items():
            other = b[step][column]
            assert math.isfinite(value) and math.isfinite(other)
            worst = max(worst, abs(value - other) / max(abs(value), abs(other), 1e-12))
    return worst


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_examples():
    """The three code blocks of the README's "Measuring the GNS in your own training": our loop, the
    Hugging Face Trainer, Lightning."""
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    start = text.index("### Measuring the GNS in your own training")
    section = text[start:text.index("\n### ", start + 1)]
    blocks = section.split("```python\n")[1:]
    assert len(blocks) == 3
    return [block[:block.index("\n```\n")] for block in blocks]


def run_readme_example(index, cwd, out_dir, steps=20):
    """Run README example `index` as written in `cwd`, then gns-analysis.py on its out_dir; returns the
    analysis's output."""
    import subprocess
    import sys
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-c", readme_examples()[index]], cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert sorted(gns_columns(os.path.join(cwd, out_dir))) == list(range(steps))
    analysis = subprocess.run([sys.executable, os.path.join(REPO, "gns-analysis.py"), out_dir, "--no-plots"],
                              cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert analysis.returncode == 0, analysis.stderr[-3000:]
    assert f"{steps} steps with GNS measurements under 'train/gns', 28 parameters" in analysis.stdout
    return run.stdout + run.stderr


def torchrun_two_ranks(worker, *args, cwd):
    """Run tests/<worker> on two CPU ranks (gloo) with torchrun; fails the test with its output if it fails."""
    import subprocess
    import sys
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "tests")])}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             os.path.join(REPO, "tests", worker), *map(str, args)],
                            capture_output=True, text=True, timeout=300, env=env, cwd=str(cwd))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def assert_bfloat16_rounding(exact, half):
    """One step's GNS cells under bfloat16 against float32's (gns_columns()[step]): the model's summed
    squared norms within 5%, and not equal (bfloat16 did round: not float32 in disguise)."""
    assert exact.keys() == half.keys()
    for kind in ("/norm", "/pegn"):
        ratio = sum(v ** 2 for k, v in half.items() if k.endswith(kind)) / \
            sum(v ** 2 for k, v in exact.items() if k.endswith(kind))
        assert 0 < abs(ratio - 1) < 0.05, (kind, ratio)
