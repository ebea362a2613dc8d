"""
Everything that needs a GPU, in one command sized for a short loan of one: the GPU tests, the
one-LayerNorm table, training throughput of a GPT-2 small (bf16, batch 8 x 1024) eager and
compiled against plain nanoGPT, and a short profile of where the host time goes. Each step is
a subprocess with its own time limit, its output saved as a file in --out as it finishes, so a
step that crashes or runs out of time costs only itself; summary.txt says how each step ended.
All the steps share --budget seconds (each gets at most what is left of it), so that one call
ends, with its summary, within the 10 minutes such a loan allows a command.

    python bench/gpu_check.py --out gpu-check                  # every step (make gpu-check)
    python bench/gpu_check.py --out gpu-check --steps tests,layernorm
    git worktree add /tmp/before HEAD~1
    python bench/gpu_check.py --out gpu-check --steps eager --repo . --repo /tmp/before

Steps (in this order):
    env        the GPU, driver, torch and triton versions
    tests      the normalisations' and the Linear kernel's tests on the GPU (pytest -rA); the
               CUDA binding's, which build and load a C++ extension, in a process of their own
    layernorm  bench/layernorm.py: one LayerNorm forward+backward, torch's against the fused
               kernels, launched from Python and replayed from a CUDA graph
    linear     the Linear's weight-gradient kernel with per-example norms (linear_gns_kernel.py)
               at GPT-2 small's four Linear shapes, bf16, batch 8 x 1024, against torch's weight
               GEMM, the torch.bmm materialised path it replaces on a GPU, and the ghost norm;
               then other tilings of the kernel (--time_linear; also out/linear.csv)
    eager      bench/throughput.py, eager: nn, ln-fused, ln-shim, every layer, llama-nn and
               llama-rms-fused, taking turns round by round
    compiled   the same under --compile=True
    profile    torch.profiler over nn and ln-fused: top ops and kernels, the host time per step
"""
import argparse
import csv
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from csv_tools import ToolParser  # noqa: E402

GPT2_SMALL = ['--device', 'cuda', '--dtype', 'bfloat16', '--n_layer', '12', '--n_embd', '768', '--n_head', '12',
              '--block_size', '1024', '--batch_size', '8', '--vocab_size', '50304']
# the tests that run on a GPU, and those whose C++ build runs in a process of its own
TESTS = ['tests/test_normgnorm.py', 'tests/test_fused_gns.py', 'tests/test_bench_layernorm.py',
         'tests/test_linear_gns_kernel.py']
BINDING_TESTS = 'cuda_binding or cuda_kernels_compile'


def _workers(python):
    """pytest-xdist's workers where `python` has it: the tests compile many Triton kernels, on the CPU."""
    has = subprocess.run([python, '-c', 'import xdist'], capture_output=True).returncode == 0
    return ['-n', str(min(8, os.cpu_count() or 1))] if has else []


# all the steps within one command of at most 10 minutes, with time to spare for starting and the summary
BUDGET = 540
MIN_STEP_SECONDS = 10  # a step given less is not started
# step -> (seconds allowed, what it runs: a function of the parsed arguments)
STEPS = {
    'env': (30, lambda a: [['nvidia-smi'], [a.python, '-c', 'import torch, triton; print("torch", torch.__version__, '
                                            '"cuda", torch.version.cuda, "triton", triton.__version__, '
                                            'torch.cuda.get_device_name())']]),
    'tests': (150, lambda a: [[a.python, '-m', 'pytest', '-q', '-rA', '-p', 'no:cacheprovider', *_workers(a.python), *TESTS,
                               '-k', f'not ({BINDING_TESTS})'],
                              [a.python, '-X', 'faulthandler', '-m', 'pytest', '-q', '-rA', '-p', 'no:cacheprovider',
                               'tests/test_normgnorm.py', '-k', BINDING_TESTS]]),
    'layernorm': (60, lambda a: [[a.python, 'bench/layernorm.py', '--shapes', '8x1024x768', '8x1024x4096',
                                  '8x2048x8192']]),
    'linear': (45, lambda a: [[a.python, 'bench/gpu_check.py', '--out', a.out, '--time_linear']]),
    'eager': (150, lambda a: [[a.python, 'bench/throughput.py', *GPT2_SMALL, '--settings', a.settings, '--rounds',
                               str(a.rounds), '--iters', '20', '--warmup', '5', '--csv',
                               os.path.join(a.out, 'eager.csv'), *a.repo_flags]]),
    'compiled': (150, lambda a: [[a.python, 'bench/throughput.py', *GPT2_SMALL, '--modes', 'compiled', '--settings',
                                  a.compiled_settings, '--rounds', '1', '--iters', '20', '--warmup', '5',
                                  '--no_memory', '--csv', os.path.join(a.out, 'compiled.csv'), *a.repo_flags]]),
    'profile': (90, lambda a: [[a.python, 'bench/throughput.py', *GPT2_SMALL, '--settings', 'nn,ln-fused',
                                '--rounds', '1', '--iters', '10', '--warmup', '5', '--no_memory', '--profile',
                                'ln-fused', '--profile_passes', '1', '--profile_rows', '25']]),
}


# GPT-2 small's four Linears, (in K, out L): attention's qkv and output projection, the MLP's up and down
GPT2_LINEARS = {'attn.c_attn': (768, 2304), 'attn.c_proj': (768, 768), 'mlp.c_fc': (768, 3072), 'mlp.c_proj': (3072, 768)}
# tilings timed beside linear_gns_kernel.TUNING's plan (its plan()'s arguments), few: each is a compile
LINEAR_CONFIGS = {'128x64 4 warps': dict(block_l=128, block_k=64, num_warps=4),
                  '64x64 4 warps': dict(block_l=64, block_k=64, num_warps=4),
                  '128x128 t64': dict(block_t=64),
                  'no split': dict(n_splits=1), 'split 4': dict(n_splits=4)}


def time_linear(out, batch=8, tokens=1024, reps=20, shapes=GPT2_LINEARS, configs=LINEAR_CONFIGS, device='cuda'):
    """
    The linear step: at each of GPT-2 small's Linear shapes (bf16, batch x tokens), the median
    milliseconds (`reps` runs after 3 warm-ups, CUDA events: host time counts where the host is
    the slower) of torch's weight GEMM dy^T x, the kernel (dW and the norms; the norms alone, as
    a shim layer asks), the torch.bmm materialised path it replaces on a GPU, and the ghost norm;
    then the kernel's other tilings. A table on stdout, rows in out/linear.csv, times over the
    GEMM's, each way's sum of norms against the bmm path's. device 'cpu' (under TRITON_INTERPRET=1,
    with tiny shapes) is for the tests.
    """
    import torch
    if device == 'cuda' and not torch.cuda.is_available():
        print('bench/gpu_check.py: error: --time_linear needs a CUDA GPU', file=sys.stderr)
        return 2
    import buffered
    import linear_gns_kernel
    chunk = buffered.PEGradNormLinear.max_chunk_numel

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

    def bmm_path(x, dy):
        # the materialised path as it runs off GPU (and ran on one before the kernel)
        has_triton, buffered.HAS_TRITON = buffered.HAS_TRITON, False
        try:
            return buffered._weight_sqnorm_materialised(x, dy, chunk, True)
        finally:
            buffered.HAS_TRITON = has_triton

    rows, summary = [], []
    print(f"bf16, {batch} x {tokens} tokens, ms (median of {reps}); x GEMM: time over torch's weight GEMM's; "
          f"norm: the sum of squared per-example norms over the bmm path's, minus 1", flush=True)
    print(f"{'layer':<12} {'K':>5} {'L':>5}  {'method':<28} {'ms':>8} {'x GEMM':>7} {'norm':>9}", flush=True)
    for name, (K, L) in shapes.items():
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(batch, tokens, K, device=device, generator=g).bfloat16()
        dy = torch.randn(batch, tokens, L, device=device, generator=g).bfloat16()
        # each way: (what it runs, how its result gives the sum of the norms)
        ways = {'torch GEMM dy^T x': (lambda: dy.reshape(-1, L).mT @ x.reshape(-1, K), None),
                'kernel: dW + norms': (lambda: linear_gns_kernel.per_example_weight_grad(x, dy), lambda r: r[1].sum()),
                'kernel: norms (shim)': (lambda: linear_gns_kernel.per_example_weight_grad(x, dy, False),
                                         lambda r: r[1].sum()),
                'bmm chunks: dW + norms': (lambda: bmm_path(x, dy), lambda r: r[0]),
                'ghost: norms': (lambda: buffered._weight_sqnorm_ghost(x, dy, chunk), lambda r: r)}
        ways.update({f'kernel {label}': ((lambda c=config: linear_gns_kernel._launch(x, dy, True, **c)),
                                         lambda r: r[1].sum()) for label, config in configs.items()})
        before = bmm_path(x, dy)[0].double()
        ms = {}
        for method, (fn, norm_of) in ways.items():
            ms[method] = median_ms(fn)
            gemm = ms['torch GEMM dy^T x']
            norm = '' if norm_of is None else f"{(norm_of(fn()).double() / before).item() - 1:+.1e}"
            rows.append(dict(layer=name, K=K, L=L, method=method, ms=f'{ms[method]:.4f}',
                             vs_gemm=f'{ms[method] / gemm:.3f}', norm_vs_bmm=norm))
            print(f"{name:<12} {K:>5} {L:>5}  {method:<28} {ms[method]:8.3f} {ms[method] / gemm:6.2f}x {norm:>9}",
                  flush=True)
        kernel = ms['kernel: dW + norms']
        summary.append((kernel / ms['torch GEMM dy^T x'], kernel / ms['bmm chunks: dW + norms']))
    with open(os.path.join(out, 'linear.csv'), 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    over_gemm, over_bmm = zip(*summary)
    print(f"kernel dW + norms: {min(over_gemm):.2f}x-{max(over_gemm):.2f}x the time of torch's GEMM, "
          f"{min(over_bmm):.2f}x-{max(over_bmm):.2f}x that of the bmm path", flush=True)
    return 0


def run_step(name, commands, limit, out):
    """Run the step's commands one after another within `limit` seconds in all, output into
    out/<name>.txt; returns a line for the summary, and whether every command succeeded."""
    path = os.path.join(out, f'{name}.txt')
    start = time.time()
    codes = []
    with open(path, 'w') as log:
        for cmd in commands:
            left = limit - (time.time() - start)
            log.write(f"$ {' '.join(cmd)}\n")
            log.flush()
            if left <= 0:
                codes.append('not run (no time left)')
                continue
            try:
                done = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=left,
                                      env=dict(os.environ, PYTHONUNBUFFERED='1', WANDB_MODE='disabled'))
                codes.append('ok' if done.returncode == 0 else f'exit {done.returncode}')
            except subprocess.TimeoutExpired:
                codes.append(f'stopped after {limit:.0f} s')
            except OSError as e:
                codes.append(f'could not start ({e.strerror})')
    seconds = time.time() - start
    tail = _last_result_line(path)
    return f"{name:<10} {', '.join(codes):<28} {seconds:6.0f} s  {tail}", all(code == 'ok' for code in codes)


def _last_result_line(path):
    """The line that says how the step went: pytest's count, or the throughput table's rows."""
    with open(path, errors='replace') as f:
        lines = [line.rstrip() for line in f if line.strip()]
    counts = [line for line in lines if ' passed' in line or ' failed' in line or ' error' in line]
    return counts[-1].strip('= ') if counts else (lines[-1][:100] if lines else '(no output)')


def main(argv=None):
    parser = ToolParser(prog='bench/gpu_check.py', description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--out', required=True, help="folder for every step's output and summary.txt (made if missing)")
    parser.add_argument('--steps', default=','.join(STEPS), help=f"comma-separated steps (default: all: {','.join(STEPS)})")
    parser.add_argument('--repo', action='append', metavar='DIR',
                        help="eager/compiled: a checkout to time beside this one, repeatable (bench/throughput.py --repo)")
    parser.add_argument('--settings', default='nn,ln-fused,ln-shim,all-gns,llama-nn,llama-rms-fused',
                        help="eager: bench/throughput.py's settings (default: %(default)s)")
    parser.add_argument('--compiled_settings', default='nn,ln-fused,llama-nn,llama-rms-fused',
                        help="compiled: bench/throughput.py's settings (default: %(default)s)")
    parser.add_argument('--rounds', type=int, default=2, help="eager: rounds over the settings (default: 2)")
    parser.add_argument('--time_linear', action='store_true',
                        help="run the linear step's timing in this process instead of the steps (needs a CUDA GPU)")
    parser.add_argument('--python', default=sys.executable, help="the python that has torch and triton (default: this one)")
    parser.add_argument('--budget', type=float, default=BUDGET,
                        help="seconds for all the steps together: each step gets at most what is left of it, and one "
                             "with less than 10 s of it left is not started, so that the summary is written in time "
                             "(default: %(default)s; the steps' own limits sum to more)")
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
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as e:
        parser.error(f"--out {args.out}: {e.strerror}")
    args.out = os.path.abspath(args.out)
    if args.time_linear:
        return time_linear(args.out)

    summary, failed = [], []
    started = time.time()
    for name in steps:
        limit, commands = STEPS[name]
        left = args.budget - (time.time() - started)
        if left < min(limit, MIN_STEP_SECONDS):  # too little of the budget left to be worth starting
            line, ok = f"{name:<10} not run: the --budget of {args.budget:g} s was spent", False
        else:
            limit = min(limit, left)
            print(f"{name} (at most {limit:.0f} s) ...", flush=True)
            line, ok = run_step(name, commands(args), limit, args.out)
        summary.append(line)
        failed += [] if ok else [name]
        print('  ' + line, flush=True)
        with open(os.path.join(args.out, 'summary.txt'), 'w') as f:  # rewritten after every step
            f.write('\n'.join(summary) + '\n')
    print(f"\nsummary ({args.out}/summary.txt; each step's output in {args.out}/<step>.txt):")
    print('\n'.join(summary))
    if failed:
        print(f"bench/gpu_check.py: step(s) {', '.join(failed)} failed; their output says why", file=sys.stderr)
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
