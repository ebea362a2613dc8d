"""
The package as another project gets it: pip installs a copy of this checkout (its git-tracked and
not-ignored files) offline into a folder outside it, with every file of nanogns/ (the C and CUDA
sources too) and nothing of the checkout's top-level modules but the `gns-analysis` command; a script
elsewhere then imports the installed package and cannot import the checkout's modules, and the command
analyses a log there; the extra form "nanogns[hf] @ git+<url>" installs too. The README's examples run against this installation in the tests of what they show
(test_meter.py, test_hf.py, test_lightning.py, test_measure.py).
"""
import json
import os
import shutil
import subprocess
import sys

import pytest

from loop_fixtures import REPO, checkout_files, copy_checkout, installed_env, installed_package, pip_install, run_script


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    return installed_package(tmp_path_factory)


def inside(path, folder):
    return os.path.commonpath([os.path.realpath(path), os.path.realpath(folder)]) == os.path.realpath(folder)


def package_files(root):
    """{path under root/nanogns: bytes} of every file but Python's caches."""
    found = {}
    for folder, dirs, files in os.walk(os.path.join(root, "nanogns")):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, root)] = f.read()
    return found


def test_the_installation_holds_the_whole_package_and_nothing_else(site):
    assert not inside(site, REPO), site
    # no top-level module; pip --target puts the console scripts in bin/
    assert all(entry.startswith("nanogns") or entry == "bin" for entry in os.listdir(site)), os.listdir(site)
    assert os.listdir(os.path.join(site, "bin")) == ["gns-analysis"]
    expected = {}
    for path in checkout_files():
        if path.startswith("nanogns/"):
            with open(os.path.join(REPO, path), "rb") as f:
                expected[path] = f.read()
    installed = package_files(site)
    assert sorted(installed) == sorted(expected)
    assert all(installed[path] == expected[path] for path in expected)
    sources = {os.path.splitext(p)[1] for p in installed if p.startswith("nanogns/normgnorm/csrc/")}
    assert {".c", ".cpp", ".cu"} <= sources, sources  # the kernels' sources, built on the user's machine


def test_a_script_outside_the_checkout_imports_the_installed_package_and_none_of_the_checkouts_modules(
        site, tmp_path):
    top_level = sorted({p[:-3] for p in checkout_files() if "/" not in p and p.endswith(".py")} |
                       {p.split("/")[0] for p in checkout_files() if p.count("/") == 1 and p.endswith("/__init__.py")})
    assert {"buffered", "gnstracking", "model", "normgnorm", "nanogns"} <= set(top_level)
    top_level.remove("nanogns")
    script = f"""
import importlib.util, json, sys
import nanogns.maths
torch_loaded = "torch" in sys.modules  # the offline analysis's maths needs no torch
specs = {{name: importlib.util.find_spec(name) for name in {top_level!r} if name.isidentifier()}}
try:
    import buffered
    buffered_error = None
except ImportError as error:
    buffered_error = type(error).__name__
print(json.dumps({{"nanogns": nanogns.__file__, "maths": nanogns.maths.__file__, "torch": torch_loaded,
                  "found": {{n: s.origin for n, s in specs.items() if s is not None}}, "buffered": buffered_error,
                  "path": sys.path, "prefix": sys.prefix}}))
"""
    run = run_script(script, tmp_path, site, name="check_imports.py")
    assert run.returncode == 0, run.stderr
    seen = json.loads(run.stdout)
    assert seen["nanogns"] == os.path.join(site, "nanogns", "__init__.py")
    assert seen["maths"] == os.path.join(site, "nanogns", "maths.py")
    assert seen["torch"] is False
    assert seen["buffered"] == "ModuleNotFoundError"
    assert not [origin for origin in seen["found"].values() if origin and inside(origin, REPO)], seen["found"]
    # nothing of the checkout on the path but the interpreter's own environment (a .venv in it)
    assert not [p for p in seen["path"] if p and inside(p, REPO) and not inside(p, seen["prefix"])], seen["path"]


def test_the_gns_analysis_command_of_the_installation_analyses_a_log_without_torch(site, tmp_path):
    """pip's `gns-analysis` (in bin/ under --target), run where a pip user runs it: outside the checkout,
    with only the installed package on the path and torch unimportable. Its output is the clone's
    gns-analysis.py's, its messages name the command."""
    command = os.path.join(site, "bin", "gns-analysis")
    out = tmp_path / "out"
    out.mkdir()
    param = "train/gns/transformer.h.0.ln_1.weight"
    rows = [f"step,tokens_processed,{param}/norm,{param}/pegn,{param}/batch_size"]
    rows += [f"{s},{64 * (s + 1)},{0.5 + 0.03 * s:.3f},{2 + 0.1 * (s % 3):.3f},8" for s in range(6)]
    (out / "log.csv").write_text("\n".join(rows) + "\n")
    no_torch = tmp_path / "no-torch"
    no_torch.mkdir()
    (no_torch / "torch.py").write_text("raise ImportError('the analysis imported torch')\n")
    env = dict(installed_env(site), PYTHONPATH=os.pathsep.join([site, str(no_torch)]))

    def run(*args, tool=(command,), env=env):
        return subprocess.run([*tool, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)

    done = run("out")
    assert done.returncode == 0, done.stderr
    assert "6 steps with GNS measurements under 'train/gns', 1 parameters (LayerNorm 1)" in done.stdout
    assert "GNS over tokens_processed:" in done.stdout and (out / "gns_analysis.csv").is_file()
    clone = run("out", tool=(sys.executable, os.path.join(REPO, "gns-analysis.py")))
    assert clone.returncode == 0 and clone.stdout == done.stdout, clone.stderr
    missing = run("no-such-run")
    assert (missing.returncode, missing.stderr) == (2, "gns-analysis: error: no-such-run: no such directory\n")
    # a pip install without the analysis extra: one line saying which to install
    no_pandas = tmp_path / "no-pandas"
    no_pandas.mkdir()
    (no_pandas / "pandas.py").write_text("raise ModuleNotFoundError(\"No module named 'pandas'\", name='pandas')\n")
    bare = run("out", env=dict(env, PYTHONPATH=os.pathsep.join([site, str(no_pandas)])))
    assert (bare.returncode, bare.stderr) == (2, "gns-analysis: error: No module named 'pandas': the analysis needs "
                                                 "pandas, in the 'analysis' extra: pip install 'nanogns[analysis]'\n")
    usage = run("out", "--alpha", "2")
    assert (usage.returncode, usage.stderr) == (2, "gns-analysis: error: argument --alpha: 2.0 is outside [0, 1) "
                                                   "(see --help)\n")


def test_the_extra_form_installs_from_a_git_url(tmp_path):
    """pip install "nanogns[hf] @ git+file://<repository>", the repository a commit of the checkout's files."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed: pip needs it for a git+ URL")
    repository = copy_checkout(tmp_path / "repository")
    git = ["git", "-c", "user.name=test", "-c", "user.email=test@example.invalid", "-c", "commit.gpgsign=false"]
    for command in (["init", "--quiet"], ["add", "--all"], ["commit", "--quiet", "--message", "the checkout"]):
        done = subprocess.run(git + command, cwd=repository, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
    target = tmp_path / "target"
    # file://localhost/...: the host named, as the URL check of older pips (23.2) wants one
    pip_install(f"nanogns[hf] @ git+file://localhost{repository}", target)
    assert (target / "nanogns" / "hf.py").is_file() and (target / "nanogns" / "normgnorm" / "csrc").is_dir()
    [metadata] = target.glob("nanogns-*.dist-info/METADATA")
    assert "Provides-Extra: hf" in metadata.read_text()
    run = subprocess.run([sys.executable, "-c", "import nanogns; print(nanogns.__file__)"], cwd=tmp_path,
                         env=installed_env(str(target)), capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str(target / "nanogns" / "__init__.py")
