"""
Everything that needs a GPU, in one command sized for a short loan of one (9 minutes): the GPU
tests, the CUDA binding's tests, the one-LayerNorm table, the Linear routes' sweep, training
throughput of a GPT-2 small (bf16, batch 8 x 1024) eager and compiled against plain nanoGPT and
its null setting, with peak memory, and a short profile of the fused LayerNorm's host and device
time. Each step is a subprocess with its own time limit, its output appended to a file in --out
as it runs, so a step that crashes or runs out of time costs only itself. All the steps share
--budget seconds: each gets at most what is left of it, and the default steps' own limits fit in
the default budget, so that every step runs. Everything goes into the one folder --out, at most
MAX_FILES files; summary.txt says how each step ended and what it found.

    python bench/gpu_check.py --out gpu-check                  # every step (make gpu-check)
    python bench/gpu_check.py --out gpu-check --dry_run        # the plan: each step's limit, file, commands
    python bench/gpu_check.py --out gpu-check --steps tests,layernorm
    python bench/gpu_check.py --out gpu-check --steps linear     # the Linear routes' table alone
    git worktree add /tmp/before HEAD~1
    python bench/gpu_check.py --out gpu-check --steps eager --repo . --repo /tmp/before

Steps (in this order), and the file each writes into:
    env        tests.txt       the GPU, driver, torch and triton versions
    binding    tests.txt       the CUDA binding's tests, which build a C++ extension and its kernels
                               with nvcc: in a step of their own, so that they always run
    tests      tests.txt       the normalisations' and the Linear kernel's tests on the GPU (pytest
                               -rA, one worker per CPU core)
    layernorm  kernels.txt     bench/layernorm.py: one LayerNorm forward+backward, torch's against
                               the fused kernels, launched from Python and replayed from a CUDA graph
    linear     kernels.txt     the sweep of a measured Linear's per-example-norm routes (nanogns/layers:
                               the cuBLAS routes, nanogns/layers/linear_kernel.py's Triton kernel at several
                               tilings, the ghost norm) at GPT-2 small's five weight shapes and a
                               Llama-style model's, each against torch's weight GEMM and float64
                               (--time_linear); its rows into linear-routes-sm<major><minor>.csv (the
                               card's compute capability), the table that, committed under
                               nanogns/layers/routes/, chooses the routes
    eager      throughput.txt  bench/throughput.py, eager: nn, nn-null, ln-fused, ln-shim, every
                               layer, llama-nn, llama-rms-fused and the Llama-style model's every
                               layer (llama-all-gns), taking turns round by round for
                               as many rounds as the step's time holds (throughput.csv)
    compiled   throughput.txt  the same under --compile=True (throughput.csv)
    profile    profile.txt     torch.profiler over nn and ln-fused, eager: top ops by host and by
                               device time, and the ops whose host time differs most
"""
import argparse
import csv
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.runs import dies_with_parent  # noqa: E402
from nanogns.logread import ToolParser  # noqa: E402

GPT2_SMALL = ['--device', 'cuda', '--dtype', 'bfloat16', '--n_layer', '12', '--n_embd', '768', '--n_head', '12',
              '--block_size', '1024', '--batch_size', '8', '--vocab_size', '50304']
# the tests that run on a GPU (of test_layers.py, the separated LayerNorm under CUDA autocast and the Embedding
# repeated; of test_compiled_norms.py, a measured GPT step in CUDA graphs), and those
# whose C++ build runs in a step of its own
TESTS = ['tests/test_normgnorm.py', 'tests/test_fused_gns.py', 'tests/test_bench_layernorm.py',
         'tests/test_linear_kernel.py', 'tests/test_layers.py::test_layernorm_under_cuda_autocast_like_torch',
         'tests/test_gpu_launches.py', 'tests/test_layers.py::test_cuda_embedding_backward_repeats_bit_for_bit',
         'tests/test_compiled_norms.py::test_cuda_graphs_of_a_measured_gpt_step_measure_as_eager']
BINDING_TESTS = 'cuda_binding or cuda_kernels_compile'
PYTEST = ['-m', 'pytest', '-q', '-rA', '-p', 'no:cacheprovider']
SETTINGS = 'nn,ln-fused,ln-shim,all-gns,llama-nn,llama-rms-fused,llama-all-gns'  # and nn-null, which throughput.py adds


def _workers(python):
    """pytest-xdist's workers, one per CPU core, where `python` has it: the tests compile many Triton kernels."""
    has = subprocess.run([python, '-c', 'import xdist'], capture_output=True,
                         preexec_fn=dies_with_parent()).returncode == 0
    return ['-n', str(os.cpu_count() or 1)] if has else []


def _throughput(a, limit, compiled):
    """bench/throughput.py on GPT-2 small, as many rounds as fit in `limit` seconds with time for its table."""
    mode = 'compiled' if compiled else 'eager'
    return [[a.python, 'bench/throughput.py', *GPT2_SMALL, '--modes', mode,
             '--settings', a.compiled_settings if compiled else a.settings, '--rounds', str(a.rounds),
             '--iters', '20', '--warmup', '5', '--time_limit', str(max(1, int(limit - TABLE_SECONDS))),
             '--csv', os.path.join(a.scratch, f'{mode}.csv'), *a.repo_flags]]


# one device command: at most 9 minutes, of which the steps have BUDGET seconds (python's start and
# the summary the rest)
DEADLINE = 540
BUDGET = 525
MIN_STEP_SECONDS = 10  # a step given less is not started
TABLE_SECONDS = 15  # of a throughput step's time: its last run's overrun of the estimate, and the table
MAX_FILES = 8  # in --out: room for one more, the Linear sweep's
# step -> (seconds allowed, the file in --out its output goes into, what it runs: a function of the
# parsed arguments and the seconds it is given)
STEPS = {
    'env': (15, 'tests.txt', lambda a, limit: [
        ['nvidia-smi'], [a.python, '-c', 'import torch, triton; print("torch", torch.__version__, "cuda", '
                         'torch.version.cuda, "triton", triton.__version__, torch.cuda.get_device_name())']]),
    'binding': (75, 'tests.txt', lambda a, limit: [
        [a.python, '-X', 'faulthandler', *PYTEST, 'tests/test_normgnorm.py', '-k', BINDING_TESTS]]),
    'tests': (95, 'tests.txt', lambda a, limit: [
        [a.python, *PYTEST, *_workers(a.python), *TESTS, '-k', f'not ({BINDING_TESTS})']]),
    'layernorm': (30, 'kernels.txt', lambda a, limit: [
        [a.python, 'bench/layernorm.py', '--shapes', '8x1024x768', '8x1024x4096', '8x2048x8192']]),
    'linear': (40, 'kernels.txt', lambda a, limit: [[a.python, 'bench/gpu_check.py', '--out', a.out, '--time_linear']]),
    'eager': (85, 'throughput.txt', lambda a, limit: _throughput(a, limit, compiled=False)),
    'compiled': (145, 'throughput.txt', lambda a, limit: _throughput(a, limit, compiled=True)),
    'profile': (40, 'profile.txt', lambda a, limit: [
        [a.python, 'bench/throughput.py', *GPT2_SMALL, '--settings', 'ln-fused', '--iters', '10', '--warmup', '5',
         '--profile', 'ln-fused', '--profile_only', '--profile_passes', '1', '--profile_rows', '25']]),
}
# the throughput steps' rows, gathered from their own CSVs (the `compile` column says which)
THROUGHPUT_CSV = 'throughput.csv'


# the weight shapes the linear step sweeps, (in K, out L) by model and layer: GPT-2 small's five (its
# head tied to the token embedding), then those of the Llama-style model of the same width that
# GPT-2 small's do not hold already (SwiGLU's hidden width 2048; c_gate is c_fc's shape)
LINEAR_SHAPES = {'gpt2-small': {'attn.c_attn': (768, 2304), 'attn.c_proj': (768, 768), 'mlp.c_fc': (768, 3072),
                                'mlp.c_proj': (3072, 768), 'lm_head': (768, 50304)},
                 'llama-small': {'mlp.c_fc': (768, 2048), 'mlp.c_proj': (2048, 768)}}
# the Triton kernel's tilings the sweep times (linear_gns_kernel.config_of's labels), few: each is a compile
LINEAR_TILINGS = ('128x128 t32 w8 s3', '128x128 t64 w8 s3', '128x128 t64 w8 s4', '128x256 t32 w8 s3',
                  '128x256 t64 w8 s3', '64x64 t32 w4 s3', '128x128 t64 w8 s3 split1', '128x128 t64 w8 s3 split2',
                  '128x128 t64 w8 s3 split4', '128x128 t64 w8 s3 split8')


def time_linear(out, batch=8, tokens=1024, reps=20, shapes=LINEAR_SHAPES, tilings=LINEAR_TILINGS, device='cuda'):
    """
    The linear step: every route of a measured Linear's per-example norms (nanogns/layers: the cuBLAS
    routes, the Triton kernel at each of `tilings`, the ghost norm where its [T, T] Gram matrices are
    smaller than W_b, 2T^2 < K L) at each of `shapes` (bf16, batch x tokens), beside torch's weight
    GEMM dy^T x: the median milliseconds (`reps` runs after 3 warm-ups, CUDA events: host time counts
    where the host is the slower), the time over the GEMM's, and the sum of the norms' and the weight
    gradient's relative errors against float64. A table on stdout; the rows (buffered.ROUTE_COLUMNS) in
    out/linear-routes-sm<major><minor>.csv (buffered.route_table_path: by the card's compute capability),
    rewritten after each shape: the file that, committed under nanogns/layers/routes/, chooses the
    routes on every card of that capability. device 'cpu' (under TRITON_INTERPRET=1, with tiny shapes,
    into linear-routes-cpu.csv) is for the tests.
    """
    import torch
    if device == 'cuda' and not torch.cuda.is_available():
        print('bench/gpu_check.py: error: --time_linear needs a CUDA GPU', file=sys.stderr)
        return 2
    import nanogns.layers as buffered
    import nanogns.layers.linear as linear_module
    from nanogns.runlog import atomic_write
    chunk = buffered.PEGradNormLinear.max_chunk_numel
    card = torch.cuda.get_device_name() if device == 'cuda' else device
    path = os.path.join(out, os.path.basename(buffered.route_table_path(device)))

    def median_ms(fn):
        for _ in range(3):
            fn()
        times = []
        for _ in range(reps):
            if device == 'cuda':
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                start = time.perf_counter()
                fn()
                times.append(1e3 * (time.perf_counter() - start))
        return statistics.median(times)

    def exact(x, dy):
        """(sum_b ||W_b||^2, dW) in float64, an example at a time."""
        sq, dw = 0.0, 0.0
        for b in range(x.shape[0]):
            w = dy[b].double().mT @ x[b].double()
            sq, dw = sq + w.square().sum(), dw + w
        return sq, dw

    def write_rows(f):
        writer = csv.DictWriter(f, fieldnames=buffered.ROUTE_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)

    rows, best = [], []
    print(f"{card}, bf16, {batch} x {tokens} tokens, ms (median of {reps}); x GEMM: time over torch's weight "
          f"GEMM's; norm, grad: relative error against float64", flush=True)
    print(f"{'model':<12} {'layer':<12} {'K':>5} {'L':>6}  {'route':<28} {'ms':>8} {'x GEMM':>7} {'norm':>8} "
          f"{'grad':>8}", flush=True)
    for model, layers in shapes.items():
        for layer, (K, L) in layers.items():
            g = torch.Generator(device=device).manual_seed(0)
            x = torch.randn(batch, tokens, K, device=device, generator=g).bfloat16()
            dy = torch.randn(batch, tokens, L, device=device, generator=g).bfloat16()
            want_sq, want_dw = exact(x, dy)
            flat_x, flat_dy = x.reshape(-1, K), dy.reshape(-1, L)
            # each route: what it runs, giving (sum of norms or None, dW)
            routes = {'gemm': lambda: (None, flat_dy.mT @ flat_x)}
            routes.update({route: (lambda r=route: linear_module._weight_sqnorm_materialised(x, dy, chunk, True, route=r))
                           for route in ('bmm', 'bmm-f32', *(f'kernel {t}' for t in tilings))})
            if 2 * tokens * tokens < K * L:
                routes['ghost'] = lambda: (linear_module._weight_sqnorm_ghost(x, dy, chunk), flat_dy.mT @ flat_x)
            ms = {}
            for route, fn in routes.items():
                try:
                    ms[route] = median_ms(fn)
                    sq, dw = fn()[:2]
                except Exception as e:  # a tiling this card cannot run: no row, so never chosen
                    print(f"{model:<12} {layer:<12} {K:>5} {L:>6}  {route:<28} failed: {str(e).splitlines()[0][:80]}",
                          flush=True)
                    continue
                norm_err = '' if sq is None else f"{abs(sq.double().item() / want_sq.item() - 1):.1e}"
                grad_err = f"{((dw.double() - want_dw).abs().max() / want_dw.abs().max()).item():.1e}"
                rows.append(dict(card=card, model=model, layer=layer, B=batch, T=tokens, K=K, L=L, dtype='bfloat16',
                                 route=route, ms=f'{ms[route]:.4f}', vs_gemm=f"{ms[route] / ms['gemm']:.3f}",
                                 norm_err=norm_err, grad_err=grad_err))
                print(f"{model:<12} {layer:<12} {K:>5} {L:>6}  {route:<28} {ms[route]:8.3f} "
                      f"{ms[route] / ms['gemm']:6.2f}x {norm_err:>8} {grad_err:>8}", flush=True)
            atomic_write(path, write_rows, 'w')  # what was measured stays, whenever the step is stopped
            chosen = buffered.read_route_table(path)[(K, L, 'bfloat16')][tokens][0]
            best.append(f"{model} {layer} {chosen} {ms[chosen] / ms['gemm']:.2f}x")
    print(f"fastest exact route (time over the GEMM's): {'; '.join(best)}", flush=True)
    return 0


def run_command(cmd, log, seconds):
    """cmd with its output into log; 'ok', 'exit N', or 'stopped' after `seconds`, when it and every
    process it started (pytest's workers, train.py under the bench) are killed, leaving the device
    to the next step."""
    try:
        process = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                   env=dict(os.environ, PYTHONUNBUFFERED='1', WANDB_MODE='disabled'),
                                   preexec_fn=dies_with_parent())
    except OSError as e:
        return f'could not start ({e.strerror})'
    try:
        code = process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # its own session: the command and all it started
        process.wait()
        return 'stopped'
    return 'ok' if code == 0 else f'exit {code}'


def run_step(name, commands, limit, path):
    """Run the step's commands one after another within `limit` seconds in all, their output appended
    to `path`; returns a line for the summary, and whether every command succeeded."""
    start = time.time()
    codes = []
    with open(path, 'a') as log:
        log.write(f"\n==== {name} (at most {limit:.0f} s)\n")
        for cmd in commands:
            left = limit - (time.time() - start)
            log.write(f"$ {' '.join(cmd)}\n")
            log.flush()
            if left <= 0:
                codes.append('not run (no time left)')
                continue
            code = run_command(cmd, log, left)
            codes.append(f'stopped after {limit:.0f} s' if code == 'stopped' else code)
    seconds = time.time() - start
    return f"{name:<10} {', '.join(codes):<28} {seconds:6.0f} s", all(code == 'ok' for code in codes)


def step_result(name, path, scratch):
    """What the step found, in one line: a throughput step's ratios from its CSV, else pytest's count
    or the last line of its output."""
    rows = read_csv(os.path.join(scratch, f'{name}.csv'))
    if rows:
        nn = next((r for r in rows if r['setting'] == 'nn'), None)
        ratios = ', '.join(f"{r['setting']} {float(r['ratio']):.3f}x" for r in rows if r['setting'] != 'nn')
        return (f"nn {float(nn['ms_per_iter']):.2f} ms/iter; " if nn else '') + f"tokens/s vs nn: {ratios}"
    with open(path, errors='replace') as f:
        lines = [line.rstrip() for line in f if line.strip()]
    counts = [line for line in lines if ' passed' in line or ' failed' in line or ' error' in line]
    return counts[-1].strip('= ') if counts else (lines[-1][:100] if lines else '(no output)')


def read_csv(path):
    try:
        with open(path, newline='') as f:
            return list(csv.DictReader(f))
    except OSError:
        return []


def gather_throughput(scratch, out):
    """The throughput steps' rows, eager then compiled, into one CSV in out (none if neither wrote any)."""
    rows = [row for mode in ('eager', 'compiled') for row in read_csv(os.path.join(scratch, f'{mode}.csv'))]
    if rows:
        with open(os.path.join(out, THROUGHPUT_CSV), 'w', newline='') as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


def plan(steps, budget):
    """Each step's seconds if every step before it took all of its own: (name, seconds), 0 for one that
    would not start."""
    planned, left = [], budget
    for name in steps:
        seconds = min(STEPS[name][0], left)
        seconds = seconds if seconds >= min(STEPS[name][0], MIN_STEP_SECONDS) else 0
        planned.append((name, seconds))
        left -= seconds
    return planned


def main(argv=None):
    parser = ToolParser(prog='bench/gpu_check.py', description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--out', required=True,
                        help="the folder for everything the steps find, summary.txt among it (made if missing; "
                             "it must hold nothing else)")
    parser.add_argument('--steps', default=','.join(STEPS), help=f"comma-separated steps (default: all: {','.join(STEPS)})")
    parser.add_argument('--repo', action='append', metavar='DIR',
                        help="eager/compiled: a checkout to time beside this one, repeatable (bench/throughput.py --repo)")
    parser.add_argument('--settings', default=SETTINGS,
                        help="eager: bench/throughput.py's settings, nn-null added (default: %(default)s)")
    parser.add_argument('--compiled_settings', default=SETTINGS,
                        help="compiled: bench/throughput.py's settings, nn-null added (default: %(default)s)")
    parser.add_argument('--rounds', type=int, default=10,
                        help="eager/compiled: rounds over the settings at most, as many as the step's time holds "
                             "(default: %(default)s)")
    parser.add_argument('--time_linear', action='store_true',
                        help="run the linear step's sweep in this process instead of the steps (needs a CUDA GPU)")
    parser.add_argument('--python', default=sys.executable, help="the python that has torch and triton (default: this one)")
    parser.add_argument('--budget', type=float, default=BUDGET,
                        help=f"seconds for all the steps together: each step gets at most what is left of it, and one "
                             f"with less than {MIN_STEP_SECONDS} s of it left is not started, so that the summary is "
                             f"written in time (default: %(default)s, which the default steps' limits fit in)")
    parser.add_argument('--dry_run', action='store_true', help="print the plan (each step's seconds, file and "
                        "commands) and run nothing")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    steps = [s.strip() for s in args.steps.split(',') if s.strip()]
    unknown = [s for s in steps if s not in STEPS]
    if unknown or not steps:
        parser.error(f"unknown step(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(STEPS)}")
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: give at least 1")
    if not args.budget > 0:
        parser.error(f"--budget {args.budget}: give a number of seconds above 0")
    for repo in args.repo or []:
        if not os.path.isfile(os.path.join(repo, 'train.py')):
            parser.error(f"--repo {repo}: there is no train.py in it")
    args.repo_flags = [flag for repo in args.repo or [] for flag in ('--repo', os.path.abspath(repo))]
    if args.repo_flags:
        args.repo_flags = ['--repo', ROOT] + args.repo_flags
    args.out = os.path.abspath(args.out)
    if args.time_linear:
        os.makedirs(args.out, exist_ok=True)
        return time_linear(args.out)
    if args.dry_run:
        args.scratch = '<scratch>'
        for name, seconds in plan(steps, args.budget):
            limit, file, commands = STEPS[name]
            print(f"{name:<10} {seconds:4.0f} s  -> {file}" if seconds else f"{name:<10} not run: no budget left")
            for cmd in commands(args, seconds) if seconds else []:
                print(f"    $ {' '.join(cmd)}")
        print(f"in all at most {args.budget:g} s, into {args.out} (at most {MAX_FILES} files, summary.txt among them)")
        return 0
    if os.path.isdir(args.out) and os.listdir(args.out):
        parser.error(f"--out {args.out} holds files already (another run's?); give a new folder or empty it")
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as e:
        parser.error(f"--out {args.out}: {e.strerror}")

    summary, failed = [], []
    started = time.time()
    with tempfile.TemporaryDirectory(prefix='gpu-check-') as scratch:  # the throughput steps' own CSVs
        args.scratch = scratch
        for name in steps:
            limit, file, commands = STEPS[name]
            left = args.budget - (time.time() - started)
            if left < min(limit, MIN_STEP_SECONDS):  # too little of the budget left to be worth starting
                line, ok = f"{name:<10} not run: the --budget of {args.budget:g} s was spent", False
            else:
                limit = min(limit, left)
                print(f"{name} (at most {limit:.0f} s) ...", flush=True)
                path = os.path.join(args.out, file)
                line, ok = run_step(name, commands(args, limit), limit, path)
                line += '  ' + step_result(name, path, scratch)
                gather_throughput(scratch, args.out)
            summary.append(line)
            failed += [] if ok else [name]
            print('  ' + line, flush=True)
            with open(os.path.join(args.out, 'summary.txt'), 'w') as f:  # rewritten after every step
                f.write('\n'.join(summary) + '\n')
    files = sorted(os.listdir(args.out))
    summary.append(f"{len(files)} files in {args.out}: {', '.join(files)}")
    if len(files) > MAX_FILES:
        summary.append(f"more than the {MAX_FILES} files a run may leave")
        failed.append('files')
    with open(os.path.join(args.out, 'summary.txt'), 'w') as f:
        f.write('\n'.join(summary) + '\n')
    print(f"\nsummary ({args.out}/summary.txt):")
    print('\n'.join(summary))
    if failed:
        print(f"bench/gpu_check.py: step(s) {', '.join(failed)} failed; their output says why", file=sys.stderr)
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
