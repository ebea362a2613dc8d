import importlib.util
import os
import subprocess
import sys

import pytest

from tracker import LogWrapper

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
    assert "⠤⠤ train/loss" in out and "⠤⠤ val/loss" in out and "last: train/loss=1.5" in out
    drawn = [ch for ch in out.split("Legend")[0] if 0x2800 < ord(ch) <= 0x28FF]  # braille dots, not blanks
    assert len(drawn) > 10


def test_globs_share_a_plot_and_options_mix_with_columns(run_dir, capsys):
    code, out, err = plot(capsys, run_dir, "train/gns/*ln*/pegn", "--x", "iter_num", "lr", "--logy")
    assert code == 0, err
    assert "⠤⠤ train/gns/transformer.ln_f.weight/pegn" in out and "⠤⠤ train/gns/transformer.h.0.ln_1.weight/pegn" in out
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
    assert code == 1 and out == "" and len(err.splitlines()) == 1
    assert "no column matches 'train/los'" in err and "train/loss, val/loss" in err
    assert "9 per-parameter columns like train/gns/transformer.ln_f.weight/norm" in err
    code, _, err = plot(capsys, run_dir, "--x", "tokens")
    assert code == 1 and "no column 'tokens' for --x" in err


BAD = [
    (["{missing}"], "no such directory"),
    (["{empty}"], "empty"),
    (["{run}", "nope*"], "no column matches 'nope*'"),
    (["{run}", "--x", "tokens"], "no column 'tokens'"),
    (["{run}", "--width", "ten"], "invalid int value"),
    (["{nodefault}"], "no train/loss or val/loss"),
]


def test_bad_inputs_from_the_command_line(run_dir, tmp_path_factory):
    other = tmp_path_factory.mktemp("other")
    (other / "empty").mkdir()
    (other / "empty" / "log.csv").write_text("")
    (other / "nodefault").mkdir()
    (other / "nodefault" / "log.csv").write_text("step,lr\n0,1\n")
    paths = dict(missing=other / "missing", empty=other / "empty", run=run_dir, nodefault=other / "nodefault")
    children = [subprocess.Popen([sys.executable, SCRIPT, *(a.format(**paths) for a in args)], cwd=ROOT, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE) for args, _ in BAD]
    for child, (args, message) in zip(children, BAD):
        _, stderr = child.communicate()
        assert child.returncode != 0 and "Traceback" not in stderr, (args, stderr)
        assert message in stderr and len(stderr.strip().splitlines()) == 1, (args, stderr)
