"""`Replicating Figures.ipynb` executed headless on two tiny runs made by bench/figure_runs.py
(fixed batch and batch-size schedule): every cell runs, every figure is a real PNG."""
import os
import subprocess
import sys

import pytest

nbclient = pytest.importorskip("nbclient", reason="nbclient is in requirements-dev.txt")
import nbformat  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "Replicating Figures.ipynb")
FIGURES = ["a_batch_size_schedule.png", "b_phase_plot.png", "c_gns_over_tokens.png",
           "d_gns_per_layer_type.png", "e_layernorm_vs_total.png", "f_batch_control.png",
           "g_norm_vs_total_by_family.png", "h_critical_batch.png"]
# a 1-layer GPT, 16 examples of 16 tokens per fixed-batch step, 60 such steps
TINY_RUNS = ["--n_layer=1", "--n_head=2", "--n_embd=16", "--block_size=16", "--batch_size=4",
             "--gradient_accumulation_steps=4", "--max_tokens=15360", "--warmup_tokens=1024",
             "--eval_interval=10", "--eval_iters=2"]


@pytest.mark.slow
def test_notebook_writes_every_figure(tmp_path, tiny_dataset, bench_runs):
    runs = tmp_path / "runs"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "figure_runs.py"), "--out_dir", str(runs),
                           "--dataset", tiny_dataset, *TINY_RUNS], capture_output=True, text=True, cwd=ROOT,
                          timeout=240, env=dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled"))
    assert done.returncode == 0, done.stdout + done.stderr
    with open(runs / "schedule" / "grad_accum_schedule.txt") as f:
        assert "15_360, 4" in f.read()  # the schedule grows to the fixed run's accumulation
    # and, for (f) and (g), two settings of the batch-size experiment and both model families of
    # the normalisation-only vs total comparison (bench_runs)
    control, families = bench_runs["batch_control.py"][0], bench_runs["norm_vs_total.py"][0]
    critical = bench_runs["critical_batch.py"][0]  # and for (h), the critical-batch pipeline's --quick run

    # the notebook on those runs, as for full-scale runs made elsewhere: --notebook_only
    env = dict(os.environ, GNS_ALPHA="0.9", GNS_RUN_BATCH_CONTROL=str(control), GNS_RUN_NORM_VS_TOTAL=str(families),
               GNS_RUN_CRITICAL_BATCH=str(critical))
    done = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "figure_runs.py"), "--out_dir", str(runs),
                           "--notebook_only"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    figures = runs / "figures"
    nb = nbformat.read(runs / "Replicating Figures.ipynb", as_version=4)  # executed, with its outputs

    for name in FIGURES:
        path = figures / name
        assert path.is_file(), name
        with open(path, "rb") as f:
            data = f.read()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000, (name, len(data))
    printed = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "Pearson r" in printed and ("saved" in printed or "does not reach" in printed), printed
    assert "| fixed-floor |" in printed and "| gns-total |" in printed  # the experiment's table
    assert "| llama | 1 |" in printed and "| gpt2 | 1 |" in printed
    assert "b_crit" in printed and "b_simple_norm_adam" in printed  # (h)


def test_notebook_only_needs_the_runs(tmp_path):
    done = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "figure_runs.py"), "--out_dir",
                           str(tmp_path), "--notebook_only"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2 and "no run to draw from" in done.stderr and "Traceback" not in done.stderr


def test_figure_runs_shows_how_far_its_runs_have_got(tmp_path, capsys):
    """The runs train in the background for minutes: the wait prints each one's last iteration."""
    sys.path.insert(0, ROOT)
    from bench.figure_runs import wait_showing_progress
    out = tmp_path / "fixed.out"
    out.write_text("number of parameters: 0.1M\niter 0: loss 4.2\niter 7: loss 3.1, time 10 ms\n")
    run = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
    with open(out) as log:
        wait_showing_progress({"fixed": (run, log)}, every=0.3)
    shown = capsys.readouterr().out
    assert "fixed iter 7" in shown and run.returncode == 0
