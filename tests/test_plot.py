import importlib.util
import os
import re
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from nanogns.runlog import LogWrapper

from conftest import peak_rss, write_long_log  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "plot.py")
spec = importlib.util.spec_from_file_location("plot_tool", SCRIPT)
plot_tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plot_tool)


@pytest.fixture
def run_dir(tmp_path):
    """A small nanoGPT-like log: train/lossf every step, train/loss and val/loss every 5th, GNS columns."""
    with LogWrapper(out_dir=tmp_path) as log:
        for it in range(20):
            if it % 5 == 0:
                log.log({"train/loss": 3.0 - 0.1 * it, "val/loss": 3.1 - 0.1 * it})
            log.log({"iter_num": it, "tokens_processed": 1024 * (it + 1), "train/lossf": 3.0 - 0.09 * it,
                     "lr": 1e-3 * (it + 1) / 20})
            for name in ("transformer.ln_f.weight", "transformer.h.0.ln_1.weight", "lm_head.weight"):
                log.log({f"train/gns/{name}/norm": 0.5 + 0.01 * it, f"train/gns/{name}/pegn": 2.0,
                         f"train/gns/{name}/batch_size": 8})
            log.step()
    return tmp_path


def plot(capsys, *args):
    code = plot_tool.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_default_columns_over_tokens(run_dir, capsys):
    code, out, err = plot(capsys, run_dir)
    assert code == 0 and err == ""
    assert "20 rows, steps 0..19" in out and "(tokens_processed)" in out
    # not a terminal: each curve is drawn with its own character, which its legend line shows
    assert "⠤o⠤ train/loss" in out and "⠤o⠤ val/loss" in out and "last: train/loss=1.5" in out
    drawn = [ch for ch in out.split("Legend")[0] if 0x2800 < ord(ch) <= 0x28FF]  # braille dots, not blanks
    assert len(drawn) > 10


def test_globs_share_a_plot_and_options_mix_with_columns(run_dir, capsys):
    code, out, err = plot(capsys, run_dir, "train/gns/*ln*/pegn", "--x", "iter_num", "lr", "--logy")
    assert code == 0, err
    legend = re.findall(r"⠤(.)⠤ (train/gns/transformer\.(?:ln_f|h\.0\.ln_1)\.weight/pegn)\n", out)
    assert len(legend) == 2 and legend[0][0] != legend[1][0]  # two curves, two characters
    assert "lm_head" not in out and "(iter_num)" in out and "(log10 lr)" in out
    code, out, _ = plot(capsys, run_dir, "train/gns/*", "--height", "5")
    assert code == 0 and "first 8 of 9 columns" in out


def test_a_killed_run_is_plotted(run_dir, capsys):
    with open(run_dir / "log.csv", "a") as f:
        f.write("20,0.5,")  # cut short
    code, out, _ = plot(capsys, run_dir, "train/lossf", "--x", "step")
    assert code == 0 and "20 rows, steps 0..19" in out and "last: train/lossf=1.29" in out


def test_list(run_dir, capsys):
    code, out, _ = plot(capsys, run_dir, "--list")
    assert code == 0 and out.splitlines()[:3] == ["step", "train/loss", "val/loss"]


def test_unknown_columns_name_some_available_ones(run_dir, capsys):
    code, out, err = plot(capsys, run_dir, "train/los")
    assert code == 2 and out == "" and len(err.splitlines()) == 1
    assert "no column matches 'train/los'" in err and "train/loss, val/loss" in err
    assert "9 per-parameter columns like train/gns/transformer.ln_f.weight/norm" in err
    code, _, err = plot(capsys, run_dir, "--x", "tokens")
    assert code == 2 and "no column 'tokens' for --x" in err


BAD = [
    (["{missing}"], "no such directory"),
    (["{empty}"], "empty"),
    (["{run}", "nope*"], "no column matches 'nope*'"),
    (["{run}", "--x", "tokens"], "no column 'tokens'"),
    (["{run}", "--width", "ten"], "invalid int value"),
    (["{nodefault}"], "no train/loss or val/loss"),
    (["{run}", "--height", "2"], "--height at least 3"),
    (["{nodefault}", "lr", "--max-tokens", "5"], "--max-tokens needs a tokens_processed column"),
    (["{binary}"], "not a text CSV"),
]


def test_bad_inputs_from_the_command_line(run_dir, tmp_path_factory):
    other = tmp_path_factory.mktemp("other")
    (other / "empty").mkdir()
    (other / "empty" / "log.csv").write_text("")
    (other / "nodefault").mkdir()
    (other / "nodefault" / "log.csv").write_text("step,lr\n0,1\n")
    (other / "binary").mkdir()
    (other / "binary" / "log.csv").write_bytes(b"\xff\xfe\x00binary\n")
    paths = dict(missing=other / "missing", empty=other / "empty", run=run_dir, nodefault=other / "nodefault",
                 binary=other / "binary")
    children = [subprocess.Popen([sys.executable, SCRIPT, *(a.format(**paths) for a in args)], cwd=ROOT, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE) for args, _ in BAD]
    for child, (args, message) in zip(children, BAD):
        _, stderr = child.communicate()
        assert child.returncode == 2 and "Traceback" not in stderr, (args, stderr)
        assert message in stderr and len(stderr.strip().splitlines()) == 1, (args, stderr)


def test_the_reference_command_line(run_dir, capsys):
    """plot.py log_dir metric [--x-axis COL] [--log-y] [--log-x] [--max-tokens N] [--width W] [--height H]"""
    code, ours, _ = plot(capsys, run_dir, "lr", "--x", "iter_num", "--logy", "--width", "80", "--height", "20")
    code2, theirs, _ = plot(capsys, run_dir, "lr", "--x-axis", "iter_num", "--log-y", "--width", "80", "--height", "20")
    assert code == code2 == 0 and ours == theirs and "(log10 lr)" in ours and "(iter_num)" in ours
    code, out, _ = plot(capsys, run_dir, "train/lossf", "--x-axis", "iter_num", "--log-x")
    assert code == 0 and "(log10 iter_num)" in out and " 1.243 " in out, "x from log10 1 = 0 to log10 19 = 1.28"
    # tokens_processed is 1024 (it + 1): iterations 0..9
    code, out, _ = plot(capsys, run_dir, "train/lossf", "--max-tokens", "10240")
    assert code == 0 and "10 rows with tokens_processed <= 10240, steps 0..9" in out
    assert "last: train/lossf=2.19" in out and " 9984 " in out
    code, out, _ = plot(capsys, run_dir, "train/lossf", "--max-tokens", "1e3")
    assert code == 0 and "no rows with tokens_processed <= 1000" in out and "(nothing to plot)" in out
    r = subprocess.run([sys.executable, SCRIPT, "--help"], capture_output=True, text=True, cwd=ROOT)
    assert all(f in r.stdout for f in ("--x-axis", "--log-y", "--log-x", "--max-tokens", "reference"))


def test_the_reference_plot_metric_is_refused():
    from nanogns.refusals import ReferenceNameError
    with pytest.raises(ReferenceNameError, match="plot_metric .* use nanogns.logread.figure"):
        plot_tool.plot_metric
    with pytest.raises(AttributeError):
        plot_tool.no_such_name


def test_reference_tensor_losses_are_plotted(tmp_path, capsys):
    (tmp_path / "log.csv").write_text("step,train/loss,iter_num\n0,tensor(4.2000),0\n1,\"tensor(3.9000, device='cuda:0')\",1\n")
    code, out, _ = plot(capsys, tmp_path, "train/loss")
    assert code == 0 and "last: train/loss=3.9" in out


def test_only_the_plotted_columns_are_read(run_dir, capsys, monkeypatch):
    asked = []

    def load_log(out_dir, columns=None):
        asked.append(set(columns))
        return plot_tool.load_log.__wrapped__(out_dir, columns)

    load_log.__wrapped__ = plot_tool.load_log
    monkeypatch.setattr(plot_tool, "load_log", load_log)
    assert plot(capsys, run_dir, "train/gns/*ln_f*/pegn", "lr")[0] == 0
    assert asked[-1] == {"train/gns/transformer.ln_f.weight/pegn", "lr", "tokens_processed", "iter_num", "step"}
    assert plot(capsys, run_dir, "lr", "--x", "step", "--max-tokens", "5000")[0] == 0
    assert asked[-1] == {"lr", "step", "tokens_processed"}


def test_output_that_cannot_be_written(run_dir):
    with open(os.devnull if not os.path.exists("/dev/full") else "/dev/full", "w") as full:
        r = subprocess.run([sys.executable, SCRIPT, str(run_dir), "lr"], stdout=full, stderr=subprocess.PIPE,
                           text=True, cwd=ROOT)
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        "plot.py: error: cannot write the output (No space left on device)"]


@pytest.mark.slow
def test_memory_is_about_what_is_plotted(tmp_path):
    """On a 12 MB log, plot.py needs little more than on a short one: it read every column (7x) before."""
    (tmp_path / "long").mkdir(), (tmp_path / "short").mkdir()
    size = write_long_log(tmp_path / "long" / "log.csv", rows=6000, params=48)
    write_long_log(tmp_path / "short" / "log.csv", rows=20, params=48)
    args = ["train/lossf", "train/gns/*h.0.ln_1.weight/pegn"]
    baseline = peak_rss(sys.executable, SCRIPT, tmp_path / "short", *args)
    peak = peak_rss(sys.executable, SCRIPT, tmp_path / "long", *args)
    assert size > 10e6 and peak - baseline < 0.5 * size, (peak - baseline) / size


def test_no_arguments_asks_for_out_dir_alone(capsys):
    """COLUMN is optional (train/loss and val/loss by default): only OUT_DIR is required."""
    with pytest.raises(SystemExit) as e:
        plot_tool.main([])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.splitlines()) == 1
    assert "OUT_DIR" in err and "COLUMN" not in err


def test_small_batch_size_columns_count_as_per_parameter_columns(tmp_path, capsys):
    """The per-parameter columns are gnsmath's (parse_column), small_batch_size included."""
    with LogWrapper(out_dir=tmp_path) as log:
        for it in range(3):
            log.log({"iter_num": it, "train/loss": 1.0})
            log.log({"train/microbatch_gns/h.0.weight/norm": 1.0, "train/microbatch_gns/h.0.weight/pegn": 2.0,
                     "train/microbatch_gns/h.0.weight/batch_size": 8,
                     "train/microbatch_gns/h.0.weight/small_batch_size": 2})
            log.step()
    code, _, err = plot(capsys, tmp_path, "nope")
    assert code == 2 and "4 per-parameter columns like" in err and "small_batch_size" not in err.split("like")[0]


def without(tmp_path, *modules):
    """The environment of a run where `modules` cannot be imported (as without the analysis extra): a
    folder first on the path whose module of each name raises the ImportError a missing one does."""
    shim = tmp_path / "without"
    shim.mkdir()
    for name in modules:
        (shim / f"{name}.py").write_text(f"raise ModuleNotFoundError(\"No module named '{name}'\", name={name!r})\n")
    return dict(os.environ, PYTHONPATH=str(shim))


@pytest.mark.parametrize("missing", ["pandas", "plotille"])
def test_without_the_analysis_extra_one_line_names_it(run_dir, tmp_path, missing):
    r = subprocess.run([sys.executable, SCRIPT, str(run_dir), "lr"], cwd=ROOT, env=without(tmp_path, missing),
                       capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout) == (2, ""), r.stderr
    assert r.stderr == (f"plot.py: error: No module named '{missing}': plot.py needs {missing}, in the 'analysis' "
                        f"extra: pip install 'nanogns[analysis]'\n")
