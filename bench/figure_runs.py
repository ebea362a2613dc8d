"""
The two short CPU training runs that `Replicating Figures.ipynb` draws its figures from: the
same small GPT, the same tokens and learning-rate schedule, every parameter's per-example
gradient norm measured (--linearclass=gns --embeddingclass=gns --lnclass=shim), once with a
fixed batch and once with a batch-size schedule (--bs_schedule=True: gradient accumulation
growing linearly in tokens from 2 steps to the fixed run's gradient_accumulation_steps).

    python bench/figure_runs.py                      # out-figures/fixed, out-figures/schedule
    python bench/figure_runs.py --out_dir runs --dataset data/shakespeare_char --max_tokens=400000

Any other --key=value is passed to train.py for both runs (model size, tokens, evaluation...).
The two runs go side by side, each with half the CPU threads; each run's output is kept in
OUT_DIR/<run>.out. With --execute the notebook then runs headless on them (nbclient): the PNGs
go to OUT_DIR/figures and the notebook with its outputs to OUT_DIR/Replicating Figures.ipynb.
Or open the notebook in Jupyter with GNS_RUN_FIXED=OUT_DIR/fixed GNS_RUN_SCHEDULE=OUT_DIR/schedule.

Runs made elsewhere (the paper's scale, on GPUs with torchrun: see docs/paper.md) go in the same
two folders; --notebook_only then draws the figures from them without training anything:

    python bench/figure_runs.py --out_dir runs-owt --notebook_only
"""
import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.runs import dies_with_parent  # noqa: E402
from nanogns.logread import ToolParser  # noqa: E402

# A 4-layer, 128-wide character-level GPT (as in the CPU demo), 32 examples of 64 tokens per
# optimizer step in the fixed run: a few minutes on 2 CPU cores
TRAIN_FLAGS = dict(
    device='cpu', dtype='float32', compile=False, device_name='M1_eflops',
    n_layer=4, n_head=4, n_embd=128, block_size=64, batch_size=8, dropout=0.0, bias=False,
    gradient_accumulation_steps=4, max_tokens=400 * 4 * 8 * 64,
    learning_rate=1e-3, min_lr=1e-4, beta2=0.99, warmup_tokens=20 * 4 * 8 * 64, lr_decay_tokens=400 * 4 * 8 * 64,
    eval_interval=20, eval_iters=10, log_interval=50, always_save_checkpoint=False,
    linearclass='gns', embeddingclass='gns', lnclass='shim',
)
RUNS = {'fixed': dict(bs_schedule=False), 'schedule': dict(bs_schedule=True)}
NOTEBOOK = 'Replicating Figures.ipynb'


def main(argv=None):
    parser = ToolParser(prog='bench/figure_runs.py', description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--out_dir', default='out-figures', help="where the runs go: OUT_DIR/fixed, OUT_DIR/schedule "
                                                                  "(default: out-figures)")
    parser.add_argument('--dataset', default='shakespeare_char',
                        help="a dataset under data/ or a folder holding train.bin, val.bin (default: shakespeare_char; "
                             "prepare it with python data/shakespeare_char/prepare.py)")
    parser.add_argument('--execute', action='store_true',
                        help="then execute Replicating Figures.ipynb on the two runs (PNGs in OUT_DIR/figures)")
    parser.add_argument('--notebook_only', action='store_true',
                        help="train nothing: execute the notebook on the runs already in OUT_DIR/fixed and "
                             "OUT_DIR/schedule (e.g. full-scale GPU runs)")
    args, extra = parser.parse_known_args(argv)
    if args.notebook_only:
        missing = [os.path.join(args.out_dir, name, 'log.csv') for name in RUNS
                   if not os.path.isfile(os.path.join(args.out_dir, name, 'log.csv'))]
        if missing:
            parser.error(f"no run to draw from: {', '.join(missing)} not found")
        execute_notebook(args.out_dir)
        return 0
    for flag in extra:
        if not flag.startswith('--') or '=' not in flag:
            parser.error(f"{flag!r}: train.py flags must be written --key=value")
    lr_decay_given = any(f.startswith('--lr_decay_tokens=') for f in extra)
    max_tokens = [f.split('=', 1)[1] for f in extra if f.startswith('--max_tokens=')]
    flags = dict(TRAIN_FLAGS, dataset=args.dataset)
    if max_tokens and not lr_decay_given:
        extra.append(f'--lr_decay_tokens={max_tokens[-1]}')  # decay over the whole run, as by default

    data_dir = args.dataset if os.path.isdir(args.dataset) else os.path.join(ROOT, 'data', args.dataset)
    if not os.path.isfile(os.path.join(data_dir, 'train.bin')):
        parser.error(f"dataset {args.dataset!r} is not prepared (no {os.path.join(data_dir, 'train.bin')}); "
                     f"for shakespeare_char run: python data/shakespeare_char/prepare.py")
    threads = str(max(1, (os.cpu_count() or 2) // len(RUNS)))
    procs = {}
    for name, run_flags in RUNS.items():
        out_dir = os.path.join(args.out_dir, name)
        os.makedirs(out_dir, exist_ok=True)
        argv = [sys.executable, os.path.join(ROOT, 'train.py')]
        argv += [f'--{k}={v}' for k, v in {**flags, **run_flags, 'out_dir': out_dir}.items()] + extra
        log = open(os.path.join(args.out_dir, f'{name}.out'), 'w')
        env = dict(os.environ, OMP_NUM_THREADS=threads, WANDB_MODE='disabled')
        procs[name] = (subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                        preexec_fn=dies_with_parent()), log)
        print(f"{name}: training into {out_dir} (output in {log.name})", flush=True)
    wait_showing_progress(procs)
    failed = []
    for name, (proc, log) in procs.items():
        log.close()
        if proc.returncode != 0:
            with open(log.name) as f:
                lines = f.read().strip().splitlines()
            failed.append(f"{name} run failed: {lines[-1] if lines else 'no output'} (see {log.name})")
    for message in failed:
        print(f"bench/figure_runs.py: error: {message}", file=sys.stderr)
    if failed:
        return 2
    print(f"done: GNS_RUN_FIXED={os.path.join(args.out_dir, 'fixed')} "
          f"GNS_RUN_SCHEDULE={os.path.join(args.out_dir, 'schedule')}")
    if args.execute:
        execute_notebook(args.out_dir)
    return 0


def last_iteration(path):
    """The last 'iter N' train.py printed into `path`, or None: how far a run is."""
    try:
        with open(path, 'rb') as f:
            f.seek(max(0, os.path.getsize(path) - 4096))
            lines = [line for line in f.read().decode('utf-8', 'replace').splitlines() if line.startswith('iter ')]
    except OSError:
        return None
    return lines[-1].split(':')[0] if lines else None


def wait_showing_progress(procs, every=30):
    """Wait for the runs, printing every `every` seconds how far each has got."""
    started = time.time()
    while any(proc.poll() is None for proc, _ in procs.values()):
        try:
            next(proc for proc, _ in procs.values() if proc.poll() is None).wait(timeout=every)
        except subprocess.TimeoutExpired:
            where = ", ".join(f"{name} {'done' if proc.poll() is not None else last_iteration(log.name) or 'starting'}"
                              for name, (proc, log) in procs.items())
            print(f"  {time.time() - started:.0f} s: {where}", flush=True)


def execute_notebook(out_dir):
    import nbclient
    import nbformat
    out_dir = os.path.abspath(out_dir)
    os.environ.update(GNS_RUN_FIXED=os.path.join(out_dir, 'fixed'), GNS_RUN_SCHEDULE=os.path.join(out_dir, 'schedule'),
                      FIGURES_DIR=os.path.join(out_dir, 'figures'))
    nb = nbformat.read(os.path.join(ROOT, NOTEBOOK), as_version=4)
    cells = sum(cell.cell_type == 'code' for cell in nb.cells)
    done = []

    def executed(cell, **_):  # one line per code cell: the notebook takes minutes
        done.append(cell)
        print(f"  notebook: cell {len(done)} of {cells} done", flush=True)
    print(f"executing {NOTEBOOK} ({cells} code cells)", flush=True)
    nbclient.NotebookClient(nb, timeout=600, kernel_name='python3', resources={'metadata': {'path': ROOT}},
                            on_cell_executed=executed).execute()
    nbformat.write(nb, os.path.join(out_dir, NOTEBOOK))
    print(f"figures in {os.environ['FIGURES_DIR']}, the executed notebook in {os.path.join(out_dir, NOTEBOOK)}")


if __name__ == '__main__':
    sys.exit(main())
