"""
The same training three ways, for tests/test_meter.py, test_hf.py and test_lightning.py:
a tiny Hugging Face GPT-2 (random weights), fixed token rows taken in order, AdamW, gradient
accumulation and clipping, with the GNS measured by our own loop (nanogns.GNSMeter), the
Hugging Face Trainer callback or the Lightning one. Each writes log.csv; gns_columns() reads its GNS cells.
Then the README's examples, run as a user runs them: saved as a script outside the checkout, with the
package pip installed from a copy of the checkout (installed_package()) and nothing else of it importable.
"""
import csv
import math
import os
import shutil
import subprocess
import sys

import pytest
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
    """The four code blocks of the README's "Measuring the GNS in your own training": our loop, the
    Hugging Face Trainer, Lightning, OLMo-core."""
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    start = text.index("### Measuring the GNS in your own training")
    section = text[start:text.index("\n### ", start + 1)]
    blocks = section.split("```python\n")[1:]
    assert len(blocks) == 4
    return [block[:block.index("\n```\n")] for block in blocks]


# -- the package as a user installs it ---------------------------------------------------------------------

def checkout_files():
    """The checkout's files as a fresh clone of it would hold them: git's tracked files and the untracked
    ones it does not ignore (a tracked file deleted in the working tree is left out)."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed: the checkout's files are the ones git lists")
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    if listed.returncode != 0:
        pytest.skip(f"{REPO} is not a git checkout: {listed.stderr.strip()}")
    return sorted({p for p in listed.stdout.split("\0") if p and os.path.isfile(os.path.join(REPO, p))})


def copy_checkout(dest):
    """Copy checkout_files() into dest, a clone of the working tree; returns dest."""
    for path in checkout_files():
        os.makedirs(os.path.join(dest, os.path.dirname(path)), exist_ok=True)
        shutil.copy2(os.path.join(REPO, path), os.path.join(dest, path))
    return str(dest)


def pip_install(source, target):
    """pip install the package at `source` (a folder or a requirement) into `target`, offline, with neither
    its dependencies nor a build environment (the running python's setuptools builds it)."""
    run = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                          "--disable-pip-version-check", "--no-cache-dir", "--quiet",
                          "--target", str(target), str(source)],
                         capture_output=True, text=True, timeout=300, env=dict(os.environ, PIP_NO_INPUT="1"))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


def installed_package(tmp_path_factory):
    """The folder (outside the checkout) into which pip installed a copy of the checkout, made once per
    test run: <base>/made-installed-package/site, beside the clone it was built from (.../clone)."""
    from conftest import made_once

    def install(folder):
        pip_install(copy_checkout(folder / "clone"), folder / "site")
    return str(made_once(tmp_path_factory, "installed-package", install) / "site")


def installed_env(site):
    """The environment of a user's script that sees the installed package and nothing of the checkout."""
    return dict(os.environ, PYTHONPATH=site, OMP_NUM_THREADS="1")


def run_script(code, cwd, site, name="my_training.py"):
    """Save `code` as cwd/name and run it there, as a user's script, with only the installed package."""
    with open(os.path.join(cwd, name), "w") as f:
        f.write(code)
    return subprocess.run([sys.executable, name], cwd=cwd, env=installed_env(site), capture_output=True, text=True,
                          timeout=300)


def run_readme_example(index, cwd, out_dir, parameters, site, steps=20):
    """Run README example `index` as written, as a script in `cwd` (outside the checkout) with the package
    installed in `site`, then gns-analysis.py on its out_dir, whose summary must count `parameters`
    (e.g. "28 parameters (LayerNorm 10, ...)"); returns the example's output."""
    run = run_script(readme_examples()[index], cwd, site)
    assert run.returncode == 0, run.stderr[-3000:]
    assert sorted(gns_columns(os.path.join(cwd, out_dir))) == list(range(steps))
    analysis = subprocess.run([sys.executable, os.path.join(REPO, "gns-analysis.py"), out_dir, "--no-plots"],
                              cwd=cwd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                              timeout=120)
    assert analysis.returncode == 0, analysis.stderr[-3000:]
    assert f"{steps} steps with GNS measurements under 'train/gns', {parameters}" in analysis.stdout, analysis.stdout
    return run.stdout + run.stderr


def torchrun_two_ranks(worker, *args, cwd):
    """Run tests/<worker> on two CPU ranks (gloo) with torchrun; fails the test with its output if it fails."""
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
