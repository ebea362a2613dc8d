"""
Everything that needs a GPU, in one command sized for a short loan of one: the GPU tests, the
one-LayerNorm table, training throughput of a GPT-2 small (bf16, batch 8 x 1024) eager and
compiled against plain nanoGPT, and a short profile of where the host time goes. Each step is
a subprocess with its own time limit, its output saved as a file in --out as it finishes, so a
step that crashes or runs out of time costs only itself; summary.txt says how each step ended.

    python bench/gpu_check.py --out gpu-check                  # every step (make gpu-check)
    python bench/gpu_check.py --out gpu-check --steps tests,layernorm
    git worktree add /tmp/before HEAD~1
    python bench/gpu_check.py --out gpu-check --steps eager --repo . --repo /tmp/before

Steps (in this order):
    env        the GPU, driver, torch and triton versions
    tests      the normalisations' tests on the GPU (pytest -rA); the CUDA binding's, which
               build and load a C++ extension, in a process of their own
    layernorm  bench/layernorm.py: one LayerNorm forward+backward, torch's against the fused
               kernels, launched from Python and replayed from a CUDA graph
    eager      bench/throughput.py, eager: nn, ln-fused, ln-shim, every layer, llama-nn and
               llama-rms-fused, taking turns round by round
    compiled   the same under --compile=True
    profile    torch.profiler over nn and ln-fused: top ops and kernels, the host time per step
"""
import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from csv_tools import ToolParser  # noqa: E402

GPT2_SMALL = ['--device', 'cuda', '--dtype', 'bfloat16', '--n_layer', '12', '--n_embd', '768', '--n_head', '12',
              '--block_size', '1024', '--batch_size', '8', '--vocab_size', '50304']
# the tests that run on a GPU, and those whose C++ build runs in a process of its own
TESTS = ['tests/test_normgnorm.py', 'tests/test_fused_gns.py', 'tests/test_bench_layernorm.py']
BINDING_TESTS = 'cuda_binding or cuda_kernels_compile'


def _workers(python):
    """pytest-xdist's workers where `python` has it: the tests compile many Triton kernels, on the CPU."""
    has = subprocess.run([python, '-c', 'import xdist'], capture_output=True).returncode == 0
    return ['-n', str(min(8, os.cpu_count() or 1))] if has else []


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
                codes.append(f'stopped after {limit} s')
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
    parser.add_argument('--python', default=sys.executable, help="the python that has torch and triton (default: this one)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    steps = [s.strip() for s in args.steps.split(',') if s.strip()]
    unknown = [s for s in steps if s not in STEPS]
    if unknown or not steps:
        parser.error(f"unknown step(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(STEPS)}")
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: give at least 1")
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

    summary, failed = [], []
    for name in steps:
        limit, commands = STEPS[name]
        print(f"{name} (at most {limit} s) ...", flush=True)
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
