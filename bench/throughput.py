"""
What per-example gradient norms cost in training: train.py itself, timed under each setting. Every
(setting, round) is a fresh `python train.py` with the setting's flags on a synthetic dataset of
random tokens, evaluation and logging at the least train.py allows (both only before its first
step). Inside that process a hook after each optimizer step times one window of --iters steps
after --warmup ones: the window begins and ends with the device synchronised, so its wall-clock
time over its steps is what a step costs (data, forward, backward, the GNS tracker, clipping,
AdamW, train.py's bookkeeping), whichever of the host and the device is the slower. Beside it,
per step: the device's time (CUDA events recorded on the stream at each step's end; on a GPU)
and the host's (from one step's end to the next, waiting for nothing), whose gap to the window's
time says whether the host or the device set the pace. The run ends at the window's end. Settings
take turns round by round (nn, nn-null, ln-shim, ..., nn, nn-null, ln-shim, ...) so that drift of
a shared machine hits every setting alike.

Settings (train.py's flags for each; any `flag=value[+flag=value...]` is one too):
    nn           plain torch layers, no measurement: the baseline
    nn-null      nn again under a second name, in every run: its ratio to nn is the noise floor
    ln-shim      --lnclass=shim                          LayerNorm only, separated LayerNorm
    ln-fused     --lnclass=fused                         LayerNorm only, fused kernel
    ln-adam      --lnclass=shim --gns_adam=True          ln-shim and the Adam-preconditioned GNS
    all-gns      --linearclass=gns --embeddingclass=gns --lnclass=shim    every parameter
    all-shim     --linearclass=shim --embeddingclass=shim --lnclass=shim  every parameter
    hooks-sogns  --gns_hooks=sogns                       SOGNS hooks on plain Linears
    hooks-exact  --gns_hooks=exact                       ghost-norm hooks on plain Linears
    llama-nn     --norm=rmsnorm --mlp=swiglu --pos_emb=rope --tie_embeddings=False   a Llama-style
                 model (config/train_shakespeare_char_llama_cpu.py's layout), no measurement
    llama-rms-shim   llama-nn's flags and --lnclass=shim     its normalisations only
    llama-rms-fused  llama-nn's flags and --lnclass=fused    its normalisations only, fused
    llama-all-gns    llama-nn's flags and --linearclass=gns --embeddingclass=gns --lnclass=shim
    moe-nn       --n_expert=4 --n_expert_active=2   a mixture-of-experts model (4 GELU experts, top-2
                 routing: config/train_shakespeare_char_moe_cpu.py's), no measurement
    moe-ln-shim  moe-nn's flags and --lnclass=shim     its LayerNorms only
    moe-all-gns  moe-nn's flags and the measured classes of all-gns: every parameter, each expert's
Every ratio is against nn, so a llama-* or moe-* row's holds the architecture's cost too: the
measurement's own is its ratio over llama-nn's or moe-nn's.

Reported per setting: milliseconds per iteration (the median over rounds of each run's window),
the device's and the host's median per step, tokens/s, their ratio to the nn baseline (tokens/s
over tokens/s), the same ratio taken round by round (each round's run against that round's
baseline: the median of those cancels drift between rounds, and their range says how noisy the
machine was), the seconds a run took before its window (start-up, compilation), and peak memory.
On CUDA peak memory is torch.cuda.max_memory_allocated of the timed runs (weights, optimizer
state, activations, buffers). On the CPU it is that of one more run of train.py per setting, the
peak resident memory above what the process held once torch and train.py's imports were loaded
(VmHWM after resetting it through /proc/self/clear_refs), under a fixed glibc mmap threshold so
that it follows the live tensors rather than the heap's leftovers.

Compiled runs (--modes compiled) share one compile cache (--compile_cache, TORCHINDUCTOR_CACHE_DIR,
with inductor's FX graph and AOT autograd caches on): a setting compiles once, its later rounds
load what it compiled. --time_limit stops starting runs once what is left would not hold the next
(judged by the runs so far) and reports what was timed: for a command with a deadline.

--repo DIR (repeatable) times another checkout's train.py in the same rounds, each (repo, setting)
a row with its ratios against the same repo's nn: how a change is shown to cost nothing.
--modes eager,compiled does the same for train.py's --compile: each setting eager and compiled,
each against the nn of its own mode.

    python bench/throughput.py --quick
    python bench/throughput.py --rounds 10 --csv small.csv
    python bench/throughput.py --n_layer 6 --n_embd 384 --n_head 6 --block_size 256 --batch_size 16
    python bench/throughput.py --settings nn,all-gns,lnclass=fused+linearclass=shim --profile all-gns
    python bench/throughput.py --settings nn,ln-shim,ln-fused,all-gns --modes eager,compiled
    git worktree add /tmp/before HEAD~1 && python bench/throughput.py --quick --repo . --repo /tmp/before
"""
import argparse
import ast
import csv
import json
import math
import os
import pickle
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.runs import dies_with_parent  # noqa: E402
from nanogns.logread import ToolParser  # noqa: E402
from nanogns.runlog import atomic_write  # noqa: E402

# train.py's flags of a Llama-style model (model.GPTConfig's options)
LLAMA = dict(norm='rmsnorm', mlp='swiglu', pos_emb='rope', tie_embeddings=False)
# and of a mixture-of-experts one (config/train_shakespeare_char_moe_cpu.py's experts)
MOE = dict(n_expert=4, n_expert_active=2)
BASELINE = 'nn'
NULL = 'nn-null'  # the baseline's flags under a second name: how far two runs of the same code differ
# setting -> train.py flags that differ from the plain model (layer_config.FLAG_CLASSES maps the
# layer flags' values to classes)
SETTINGS = {
    BASELINE: {},
    NULL: {},
    'ln-shim': dict(lnclass='shim'),
    'ln-fused': dict(lnclass='fused'),
    'ln-adam': dict(lnclass='shim', gns_adam=True),
    'all-gns': dict(linearclass='gns', embeddingclass='gns', lnclass='shim'),
    'all-shim': dict(linearclass='shim', embeddingclass='shim', lnclass='shim'),
    'hooks-sogns': dict(gns_hooks='sogns'),
    'hooks-exact': dict(gns_hooks='exact'),
    'llama-nn': LLAMA,
    'llama-rms-shim': dict(LLAMA, lnclass='shim'),
    'llama-rms-fused': dict(LLAMA, lnclass='fused'),
    'llama-all-gns': dict(LLAMA, linearclass='gns', embeddingclass='gns', lnclass='shim'),
    'moe-nn': MOE,
    'moe-ln-shim': dict(MOE, lnclass='shim'),
    'moe-all-gns': dict(MOE, linearclass='gns', embeddingclass='gns', lnclass='shim'),
}
DTYPES = ('float32', 'bfloat16', 'float16')
GPT2_VOCAB = 50304  # train.py's vocabulary for a dataset without meta.pkl
# (normal, --quick) defaults of the flags --quick changes; a flag given explicitly wins
SIZES = dict(n_layer=(4, 2), n_embd=(128, 64), n_head=(4, 2), block_size=(64, 32), batch_size=(32, 8),
             iters=(10, 4), rounds=(5, 3), warmup=(3, 2))
# train.py reads the device after its first step (its first log row): the window starts after that
MIN_WARMUP = 2
MEMORY_ITERS = 3  # the optimizer state exists from the first step on, so the third backward sees it all
PROFILE_PASSES = 3  # interleaved, like the timing rounds, so that drift does not land on one setting
# inductor's caches that let a compiled run load what an earlier run of the same setting compiled
COMPILE_CACHES = {'TORCHINDUCTOR_FX_GRAPH_CACHE': '1', 'TORCHINDUCTOR_AUTOGRAD_CACHE': '1'}


class StepClock:
    """
    The timed window of one run, driven by after_step() after each optimizer step: the window is
    the `iters` steps after the first `warmup`, and begins and ends with sync(), which waits for
    everything queued on the device, so that its wall-clock time (clock()) is the steps' whole
    cost. Beside it, per step of the window: the host's time from one step's end to the next
    (nothing waited for) and, given event() (a CUDA event recorded on the stream), the device's.
    synced_at lists the steps after which it synchronised.
    """

    def __init__(self, warmup, iters, sync, event=None, clock=time.perf_counter):
        self.warmup, self.iters, self.sync, self.event, self.clock = warmup, iters, sync, event, clock
        self.steps, self.synced_at, self.marks, self.events = 0, [], [], []
        self.start = self.wall_s = None

    def after_step(self):
        """Counts a step; True once the window has ended."""
        self.steps += 1
        if self.steps == self.warmup:
            self.sync()
            self.synced_at.append(self.steps)
            self.start = self.clock()
            self.marks.append(self.start)
            if self.event:
                self.events.append(self.event())
        elif self.warmup < self.steps <= self.warmup + self.iters:
            self.marks.append(self.clock())
            if self.event:
                self.events.append(self.event())
            if self.steps == self.warmup + self.iters:
                self.sync()
                self.synced_at.append(self.steps)
                self.wall_s = self.clock() - self.start
        return self.wall_s is not None

    def result(self):
        """The window's seconds, and each of its steps' on the host and (None without events) the device."""
        host = [b - a for a, b in zip(self.marks, self.marks[1:])]
        device = [a.elapsed_time(b) / 1e3 for a, b in zip(self.events, self.events[1:])] if self.event else None
        return dict(wall_s=self.wall_s, iters=self.iters, host_s=host, device_s=device, synced_at=self.synced_at)


# `python -c WRAPPER OPTIONS_JSON train.py FLAGS...` in the checkout (after StepClock's source):
# runs train.py as `python train.py FLAGS...` would, times the window of options["iters"] steps
# after options["warmup"] with a StepClock (none if iters is 0) and ends the run there; prints, as
# its last line, the JSON of the window, the seconds before it, and the peak memory above what the
# process held once torch and train.py's imports were loaded. With options["profile"] it also
# profiles the window's steps, into that file.
WRAPPER = r'''
import ast, importlib, json, os, re, resource, runpy, sys, time
started = time.perf_counter()
options, script = json.loads(sys.argv[1]), sys.argv[2]
sys.argv = sys.argv[2:]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
import torch
import torch._dynamo  # loaded by the first AdamW step (and --compile): ~140 MiB that is no setting's
from torch.optim.optimizer import register_optimizer_step_post_hook
if options["threads"]:
    torch.set_num_threads(options["threads"])
for node in ast.walk(ast.parse(open(script).read())):
    names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
        [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:
            pass

def status_bytes(field):
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE).group(1)) * 1024

cuda = options["device"].startswith("cuda")
if cuda:
    torch.cuda.init()
    torch.cuda.reset_peak_memory_stats(options["device"])
    peak = lambda: torch.cuda.max_memory_allocated(options["device"])
else:
    try:
        before = status_bytes("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        peak = lambda: status_bytes("VmHWM") - before
    except OSError:  # no /proc: the lifetime peak (ru_maxrss is in bytes on macOS, KiB elsewhere)
        unit = 1 if sys.platform == "darwin" else 1024
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit
        peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit - before


class WindowDone(BaseException):
    """After the window's last step: nothing after it is timed, so the run ends there."""


def cuda_event():
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event

clock = None
if options["iters"]:
    clock = StepClock(options["warmup"], options["iters"],
                      (lambda: torch.cuda.synchronize(options["device"])) if cuda else (lambda: None),
                      cuda_event if cuda else None)
prof = None
if options["profile"]:
    from torch.profiler import ProfilerActivity, profile
    prof = profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda)


def after_step(optimizer, args, kwargs):
    if clock is None:
        return
    done = clock.after_step()
    if prof is not None and clock.steps == options["warmup"]:
        prof.start()
    if done:
        if prof is not None:
            prof.stop()
        raise WindowDone

register_optimizer_step_post_hook(after_step)
try:
    runpy.run_path(script, run_name="__main__")
except WindowDone:
    pass
except SystemExit as e:
    if e.code not in (None, 0):
        raise
window = clock.result() if clock is not None and clock.wall_s is not None else None
if prof is not None and window is not None:
    events = prof.key_averages()
    node = "autograd::engine::evaluate_function: "
    with open(options["profile"], "w") as f:
        json.dump(dict(wall_s=window["wall_s"], self_us={e.key: e.self_cpu_time_total for e in events},
                       node_us={e.key[len(node):]: e.cpu_time_total for e in events if e.key.startswith(node)},
                       table=events.table(sort_by="self_cpu_time_total", row_limit=options["rows"]),
                       device_table=events.table(sort_by="self_cuda_time_total", row_limit=options["rows"]) if cuda
                       else None), f)
print(json.dumps({"peak_bytes": peak(), "window": window,
                  "setup_s": clock.start - started if window is not None else None}))
'''


def wrapper_code():
    """The wrapper's code: StepClock's source, as this file has it, then WRAPPER."""
    with open(os.path.abspath(__file__)) as f:
        source = f.read()
    clock = next(node for node in ast.parse(source).body if isinstance(node, ast.ClassDef) and node.name == 'StepClock')
    return 'import time\n' + ast.get_source_segment(source, clock) + '\n' + WRAPPER


class BenchError(Exception):
    """A run of train.py that failed; the message is one line for the user, `code` the exit code."""

    def __init__(self, message, code):
        super().__init__(message)
        self.code = code


def flags_text(flags):
    return ' '.join(f'--{k}={v}' for k, v in flags.items()) or '(plain nn)'


def train_flags(args, dataset, out_dir, iters, compiled=False):
    """train.py's flags of every run: the model, the device, and the least evaluation and logging
    train.py allows (before the first step, and after the last, which the timed runs do not reach)."""
    return dict(device=args.device, dtype=args.dtype, compile=compiled, n_layer=args.n_layer,
                n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size, batch_size=args.batch_size,
                bias=args.bias, dropout=0.0, seed=args.seed, gradient_accumulation_steps=1, dataset=dataset,
                out_dir=out_dir, max_iters=iters, eval_interval=iters + 1, eval_iters=1, log_interval=iters + 1,
                always_save_checkpoint=False, wandb_log=False)


def write_dataset(folder, vocab_size, block_size, seed):
    """train.bin / val.bin of random uint16 tokens, and meta.pkl with the vocabulary unless it
    is GPT-2's padded one, which train.py takes when there is no meta.pkl."""
    tokens = max(1 << 16, 4 * block_size)
    rng = np.random.default_rng(seed)
    for split in ('train', 'val'):
        rng.integers(vocab_size, size=tokens, dtype=np.uint16).tofile(os.path.join(folder, f'{split}.bin'))
    if vocab_size != GPT2_VOCAB:
        with open(os.path.join(folder, 'meta.pkl'), 'wb') as f:
            pickle.dump({'vocab_size': vocab_size}, f)


def run_env(setting, args, memory=False):
    """The environment of a run of train.py: the compile cache every run shares, its threads' wait policy."""
    env = dict(os.environ, WANDB_MODE='disabled', **COMPILE_CACHES)
    env.setdefault('OMP_WAIT_POLICY', 'PASSIVE')  # train.py's own: the wrapper loads torch before train.py can set it
    if args.compile_cache:
        env['TORCHINDUCTOR_CACHE_DIR'] = args.compile_cache
    if args.threads:
        env['OMP_NUM_THREADS'] = str(args.threads)
    if memory:  # glibc: each tensor above 64 KiB mapped on its own and unmapped when freed
        env['MALLOC_MMAP_THRESHOLD_'] = '65536'
    return env


def run_train(repo, setting, args, work, memory=False, profile=None, compiled=None):
    """
    One fresh train.py of `repo` under `setting`, compiled or eager (None: the first of --modes):
    timed (its window's ms per iteration, the device's and host's median ms per step, the
    seconds before the window, the steps it synchronised after), or for memory (MEMORY_ITERS
    iterations, no window); its peak memory in bytes, its wall-clock seconds, and train.py's output.
    """
    out_dir = tempfile.mkdtemp(prefix='run-', dir=work)
    compiled = args.modes[0] if compiled is None else compiled
    iters = MEMORY_ITERS if memory else args.warmup + args.iters
    flags = {**train_flags(args, os.path.join(work, 'data'), out_dir, iters, compiled), **args.settings[setting]}
    options = dict(device=args.device, threads=args.threads, warmup=args.warmup, iters=0 if memory else args.iters,
                   profile=profile, rows=args.profile_rows)
    cmd = [sys.executable, '-c', wrapper_code(), json.dumps(options), 'train.py'] + [f'--{k}={v}' for k, v in flags.items()]
    started = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=repo, env=run_env(setting, args, memory), capture_output=True, text=True,
                              preexec_fn=dies_with_parent())
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)  # a checkpoint of a large model is large
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ['no output'])[-1]
        raise BenchError(f"{setting} in {repo}: train.py exited with {done.returncode}: {last}",
                         2 if done.returncode == 2 else 1)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    run = dict(peak=result['peak_bytes'], run_s=time.monotonic() - started, stdout=done.stdout, ms=None)
    window = result['window']
    if not memory and window is None:
        raise BenchError(f"{setting} in {repo}: train.py ended before its {args.iters} timed iterations", 1)
    if window is not None:
        run.update(ms=window['wall_s'] / window['iters'] * 1e3, host_ms=statistics.median(window['host_s']) * 1e3,
                   device_ms=statistics.median(window['device_s']) * 1e3 if window['device_s'] else math.nan,
                   setup_s=result['setup_s'], synced_at=window['synced_at'])
    return run


class Deadline:
    """--time_limit: whether the next run fits in what is left, judged by the longest run so far of
    the same setting and mode, else of the same mode, else (the first of its mode) yes."""

    def __init__(self, seconds):
        self.seconds, self.started, self.taken = seconds, time.monotonic(), {}

    def fits(self, key):
        if self.seconds is None:
            return True
        same_mode = [s for k, s in self.taken.items() if k[0][1] == key[0][1]]
        guess = self.taken.get(key, max(same_mode, default=0.0))
        return time.monotonic() - self.started + guess <= self.seconds

    def took(self, key, seconds):
        self.taken[key] = max(seconds, self.taken.get(key, 0.0))


# -- profile ------------------------------------------------------------------------------------

def profile(variants, settings, args, work):
    """
    torch.profiler over the timed window of --profile_passes runs of each setting and the
    baseline, taking turns. Prints, per setting: the top ops by self CPU time (last pass), the
    backward nodes by total CPU time, and the ops whose self CPU time per iteration differs most
    from the baseline's: where a setting's extra time goes.
    """
    settings = [BASELINE] + [s for s in settings if s != BASELINE]
    keys = [(v, s) for s in settings for v in variants]
    self_ms = {k: {} for k in keys}  # op -> self CPU ms per iteration
    node_ms = {k: {} for k in keys}  # backward node -> total CPU ms per iteration
    wall_ms = {k: 0.0 for k in keys}
    tables, device_tables = {}, {}
    n = args.profile_passes * args.iters
    path = os.path.join(work, 'profile.json')
    for _ in range(args.profile_passes):
        for v, s in keys:
            run_train(v[0], s, args, work, profile=path, compiled=v[1])
            with open(path) as f:
                result = json.load(f)
            wall_ms[v, s] += result['wall_s'] * 1e3 / n
            for into, got in ((self_ms[v, s], result['self_us']), (node_ms[v, s], result['node_us'])):
                for op, us in got.items():
                    into[op] = into.get(op, 0.0) + us / 1e3 / n
            tables[v, s] = result['table']
            device_tables[v, s] = result['device_table']
    rows = args.profile_rows
    for v, s in keys:
        name = s if len(variants) == 1 else f"{s} in {variant_name(*v)}"
        in_ops = sum(self_ms[v, s].values())
        print(f"\nprofile of {name} ({flags_text(args.settings[s])}), {args.profile_passes} x {args.iters} iterations: "
              f"{wall_ms[v, s]:.1f} ms per iteration under the profiler, {in_ops:.1f} ms of it inside ops; "
              f"ops by self CPU time (last pass):")
        print(tables[v, s])
        if device_tables[v, s]:
            print(f"the same by GPU time (the top kernels):\n{device_tables[v, s]}")
        print(f"backward nodes of {name}, total CPU time per iteration (the ops inside them included):")
        for node, ms in sorted(node_ms[v, s].items(), key=lambda kv: -kv[1])[:rows]:
            print(f"  {node:<56} {ms:9.2f} ms")
        if s == BASELINE:
            continue
        base = self_ms[v, BASELINE]
        deltas = sorted(((ms - base.get(op, 0.0), op) for op, ms in self_ms[v, s].items()), reverse=True)
        deltas += sorted((-ms, op) for op, ms in base.items() if op not in self_ms[v, s])
        print(f"self CPU time per iteration against {BASELINE}'s ({in_ops - sum(base.values()):+.1f} ms inside ops, "
              f"{wall_ms[v, s] - wall_ms[v, BASELINE]:+.1f} ms wall), the largest differences:")
        for delta, op in sorted(deltas, key=lambda d: -abs(d[0]))[:rows]:
            print(f"  {op:<56} {delta:+8.2f} ms  ({base.get(op, 0.0):.2f} -> {self_ms[v, s].get(op, 0.0):.2f})")


# -- command line -------------------------------------------------------------------------------

def positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not positive")
    return value


def warmup_steps(text):
    value = positive_int(text)
    if value < MIN_WARMUP:
        raise argparse.ArgumentTypeError(f"{value}: give at least {MIN_WARMUP} (train.py reads the device after "
                                         f"its first step, which a window must not hold)")
    return value


def positive_seconds(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is not above 0")
    return value


def settings_list(text):
    """{name: train.py flags} of a comma-separated list of named settings and flag=value[+flag=value...]."""
    settings = {}
    for name in (s.strip() for s in text.split(',')):
        if name in SETTINGS:
            settings[name] = SETTINGS[name]
        elif '=' in name:
            pairs = [p.split('=', 1) for p in name.split('+')]
            if not all(len(p) == 2 and p[0].isidentifier() and p[1] for p in pairs):
                raise argparse.ArgumentTypeError(f"{name!r} is not flag=value[+flag=value...]")
            settings[name] = dict(pairs)
        elif name:
            raise argparse.ArgumentTypeError(f"unknown setting(s) {name}; choose from {', '.join(SETTINGS)} "
                                             f"or give train.py flags as flag=value[+flag=value...]")
    if not settings:
        raise argparse.ArgumentTypeError(f"no setting in {text!r}")
    return settings


def modes_list(text):
    """[False, True] of "eager,compiled": train.py's --compile of each mode."""
    names = [m.strip() for m in text.split(',') if m.strip()]
    if not names or set(names) - {'eager', 'compiled'}:
        raise argparse.ArgumentTypeError(f"{text!r}: give eager, compiled or eager,compiled")
    return [name == 'compiled' for name in dict.fromkeys(names)]


def parse_args(argv):
    parser = ToolParser(prog='bench/throughput.py', description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--settings', type=settings_list, default=None,
                        help=f"comma-separated settings: any of {','.join(SETTINGS)} (default: all, those that "
                             f"differ by their GPU environment alone only on a GPU) and "
                             f"flag=value[+flag=value...] of train.py; {BASELINE} and {NULL} are always run")
    parser.add_argument('--repo', action='append', metavar='DIR',
                        help="a checkout whose train.py to time, repeatable, in the same rounds (default: the "
                             "one this bench is in)")
    parser.add_argument('--device', default='cpu', help="cpu, cuda or cuda:N (default: cpu)")
    parser.add_argument('--dtype', choices=DTYPES, default='float32',
                        help="float32, or autocast to bfloat16/float16 as train.py does (default: float32)")
    parser.add_argument('--compile', action='store_true', help="train.py's --compile=True: --modes compiled")
    parser.add_argument('--modes', type=modes_list, help="eager, compiled or eager,compiled: each setting in each "
                        "mode, against the same mode's baseline (default: eager)")
    quick = lambda k: f"(default: {SIZES[k][0]}, --quick: {SIZES[k][1]})"
    for k, what in (('n_layer', 'transformer blocks'), ('n_embd', 'model width'), ('n_head', 'attention heads'),
                    ('block_size', 'tokens per example'), ('batch_size', 'examples per step')):
        parser.add_argument(f'--{k}', type=positive_int, help=f"{what} {quick(k)}")
    parser.add_argument('--vocab_size', type=positive_int, default=65,
                        help=f"vocabulary of the random tokens (default: 65, shakespeare_char's; {GPT2_VOCAB}: GPT-2's)")
    parser.add_argument('--bias', action='store_true', help="biases in Linears and LayerNorms (train.py's default: none)")
    parser.add_argument('--iters', type=positive_int, help=f"timed iterations per run, one window {quick('iters')}")
    parser.add_argument('--rounds', type=positive_int, help=f"rounds over all settings {quick('rounds')}")
    parser.add_argument('--warmup', type=warmup_steps,
                        help=f"untimed iterations at the start of every run, the first evaluation and any "
                             f"compilation among them, at least {MIN_WARMUP} {quick('warmup')}")
    parser.add_argument('--quick', action='store_true', help="a small model and few iterations: a few minutes on 2 CPU cores")
    parser.add_argument('--csv', metavar='PATH', help="also write the results to this CSV file (after every run)")
    parser.add_argument('--time_limit', type=positive_seconds, metavar='SECONDS',
                        help="start no run that would not end within this many seconds of the start (judged by the "
                             "runs so far), and report what was timed (default: no limit)")
    parser.add_argument('--compile_cache', metavar='DIR', default=os.environ.get('TORCHINDUCTOR_CACHE_DIR'),
                        help="inductor's cache folder, shared by every run (default: $TORCHINDUCTOR_CACHE_DIR, "
                             "else torch's own)")
    parser.add_argument('--no_memory', action='store_true',
                        help="on the CPU, skip the one extra run of each setting that measures its peak memory")
    parser.add_argument('--profile', type=settings_list, metavar='SETTINGS',
                        help=f"after timing, profile these settings and the baseline (torch.profiler over the timed "
                             f"window of {PROFILE_PASSES} interleaved runs): top ops, backward nodes, and the ops "
                             f"whose time differs most from the baseline's")
    parser.add_argument('--profile_only', action='store_true', help="--profile without the timing rounds before it")
    parser.add_argument('--profile_rows', type=positive_int, default=15, help="rows of each profile table (default: 15)")
    parser.add_argument('--profile_passes', type=positive_int, default=PROFILE_PASSES,
                        help=f"runs of each profiled setting, taking turns (default: {PROFILE_PASSES})")
    parser.add_argument('--threads', type=positive_int,
                        help="CPU threads for torch (default: torch's own choice); on a busy machine 1 is steadier")
    parser.add_argument('--seed', type=int, default=1337)
    args = parser.parse_args(argv)

    for k, (normal, small) in SIZES.items():
        if getattr(args, k) is None:
            setattr(args, k, small if args.quick else normal)
    if args.n_embd % args.n_head:
        parser.error(f"--n_embd={args.n_embd} is not divisible by --n_head={args.n_head}")
    if args.vocab_size > 1 << 16:
        parser.error(f"--vocab_size={args.vocab_size}: train.bin holds uint16 tokens, at most {1 << 16}")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        parser.error(f"--device={args.device!r} is not a device (cpu, cuda, cuda:N)")
    if device.type not in ('cpu', 'cuda'):
        parser.error(f"--device={args.device}: only cpu and cuda are supported")
    if device.type == 'cuda' and not torch.cuda.is_available():
        parser.error(f"--device={args.device} but CUDA is not available here; use --device=cpu")
    if args.csv and not os.path.isdir(os.path.dirname(os.path.abspath(args.csv))):
        parser.error(f"--csv {args.csv}: the folder {os.path.dirname(os.path.abspath(args.csv))} does not exist")
    if args.compile and args.modes and args.modes != [True]:
        parser.error("--compile is --modes compiled; give one of them")
    if args.profile_only and not args.profile:
        parser.error("--profile_only profiles the settings of --profile; give them")
    args.modes = args.modes or [args.compile]
    args.compile_cache = args.compile_cache and os.path.abspath(args.compile_cache)
    args.repo = list(dict.fromkeys(args.repo or [os.path.relpath(ROOT)]))
    for repo in args.repo:
        if not os.path.isfile(os.path.join(repo, 'train.py')):
            parser.error(f"--repo {repo}: there is no train.py in it")
    if args.settings is None:
        args.settings = dict(SETTINGS)
    args.settings = {BASELINE: SETTINGS[BASELINE], NULL: SETTINGS[NULL], **args.settings, **(args.profile or {})}
    for name, flags in args.settings.items():
        taken = [k for k in flags if k in train_flags(args, '', '', 1)]
        if taken:
            parser.error(f"setting {name} sets --{taken[0]}, which the bench sets itself"
                         f"{f'; use the bench flag --{taken[0]}' if taken[0] in vars(args) else ''}")
    return args


def variant_name(repo, compiled):
    return f"{repo} compiled" if compiled else repo


def result_rows(keys, runs, memory, args):
    """A row per (variant, setting) timed at least once: the medians over its rounds and its ratios
    to its variant's baseline, over those medians and round by round (the rounds both ran)."""
    rows = []
    tokens_per_iter = args.batch_size * args.block_size
    for (repo, compiled), s in keys:
        v = (repo, compiled)
        base, this = runs[v, BASELINE], runs[v, s]
        if not this or not base:
            continue
        median = lambda rounds, what: statistics.median(run[what] for run in rounds.values())
        ms, base_ms = median(this, 'ms'), median(base, 'ms')
        round_ratios = [base[r]['ms'] / this[r]['ms'] for r in this if r in base]
        peak = max(run['peak'] for run in this.values()) if args.device.startswith('cuda') else memory[v, s]
        base_peak = max(run['peak'] for run in base.values()) if args.device.startswith('cuda') else memory[v, BASELINE]
        rows.append(dict(setting=s, repo=repo, flags=flags_text(args.settings[s]), ms_per_iter=ms,
                         device_ms_per_step=median(this, 'device_ms'), host_ms_per_step=median(this, 'host_ms'),
                         tokens_per_s=tokens_per_iter / ms * 1e3, ratio=base_ms / ms,
                         ratio_rounds=statistics.median(round_ratios), ratio_min=min(round_ratios),
                         ratio_max=max(round_ratios), setup_s=median(this, 'setup_s'), peak_mem_mib=peak / 2**20,
                         mem_ratio=peak / base_peak, device=args.device, dtype=args.dtype, compile=compiled,
                         n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, block_size=args.block_size,
                         batch_size=args.batch_size, vocab_size=args.vocab_size, iters=args.iters, warmup=args.warmup,
                         rounds=len(this)))
    return rows


def write_csv(path, rows):
    if not rows:
        return

    def write(f):
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    atomic_write(path, write, mode='w')  # whole or not at all: an interrupted write leaves the previous file


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    repos, settings = args.repo, list(args.settings)
    variants = [(repo, compiled) for compiled in args.modes for repo in repos]  # each timed against its own nn
    tokens_per_iter = args.batch_size * args.block_size
    cuda = args.device.startswith('cuda')
    where = torch.cuda.get_device_name(args.device) if cuda else f"cpu, {args.threads or torch.get_num_threads()} threads"
    print(f"train.py's GPT {args.n_layer} layers x {args.n_embd} wide, {args.n_head} heads, block {args.block_size}, "
          f"batch {args.batch_size} ({tokens_per_iter:,} tokens/iter), vocabulary {args.vocab_size}; {args.dtype}, "
          f"{' and '.join('compiled' if c else 'eager' for c in args.modes)}, {where}")
    rounds = 0 if args.profile_only else args.rounds
    print(f"{len(settings)} settings x {len(repos)} checkout(s) x {len(args.modes)} mode(s) x {rounds} rounds, "
          f"each a fresh train.py timing one window of {args.iters} iterations after {args.warmup} warmup ones"
          f"{f', within {args.time_limit:g} s' if args.time_limit else ''}", flush=True)
    keys = [(v, s) for s in settings for v in variants]  # a setting's checkouts and modes side by side in each round
    name = lambda v, s: s if len(variants) == 1 else f"{s} in {variant_name(*v)}"
    deadline = Deadline(args.time_limit)
    runs = {k: {} for k in keys}  # per (variant, setting): round -> its run
    memory = {k: math.nan for k in keys}
    n_params = None  # as train.py prints it
    with tempfile.TemporaryDirectory(prefix='bench-throughput-') as work:
        os.makedirs(os.path.join(work, 'data'))
        write_dataset(os.path.join(work, 'data'), args.vocab_size, args.block_size, args.seed)
        try:
            for r in range(rounds):
                timed = []
                for k in keys:
                    if not deadline.fits(k):
                        break
                    run = run_train(k[0][0], k[1], args, work, compiled=k[0][1])
                    deadline.took(k, run['run_s'])
                    runs[k][r] = run
                    timed.append(k)
                    n_params = n_params or re.search(r'number of parameters: (\S+)', run['stdout'])
                    if args.csv:  # after every run: a command stopped from outside keeps what was timed
                        write_csv(args.csv, result_rows(keys, runs, memory, args))
                if timed:
                    print(f"  round {r + 1}/{rounds}: " + ', '.join(f"{name(*k)} {runs[k][r]['ms']:.1f}" for k in timed)
                          + f" ms/iter; {min(runs[k][r]['setup_s'] for k in timed):.0f}-"
                          f"{max(runs[k][r]['setup_s'] for k in timed):.0f} s before the windows", flush=True)
                if len(timed) < len(keys):
                    print(f"  --time_limit {args.time_limit:g} s: stopped before round {r + 1} ended", flush=True)
                    break
            if args.profile:
                profile(variants, list(args.profile), args, work)
            if rounds and not cuda and not args.no_memory:  # on CUDA the timed runs measured it
                print("peak memory: one more run of each ...", flush=True)
                for k in keys:
                    if runs[k] and deadline.fits(k):
                        memory[k] = run_train(k[0][0], k[1], args, work, memory=True, compiled=k[0][1])['peak']
        except BenchError as e:
            print(f"bench/throughput.py: error: {e}", file=sys.stderr)
            return e.code
    if not rounds:
        return 0

    rows = result_rows(keys, runs, memory, args)
    mem_what = 'max_memory_allocated of the timed runs' if cuda else \
        'not measured (--no_memory)' if args.no_memory else 'peak RSS increase, one more run each'
    width = max(len(s) for s in settings + ['setting'])
    print(f"\n{n_params.group(1) if n_params else '?'} parameters (train.py's count)")
    header = (f"{'setting':<{width}} {'ms/iter':>9} {'device':>7} {'host':>7} {'tokens/s':>10} {'vs nn':>7} "
              f"{'by round (min-max)':>24} {'setup s':>7} {'peak MiB':>9} {'vs nn':>6}  {'checkout':<12} flags")
    print(header)
    print('-' * (len(header) + 40))
    for row in rows:
        memory_text = f"{'-':>9} {'-':>6}" if math.isnan(row['peak_mem_mib']) else \
            f"{row['peak_mem_mib']:9.1f} {row['mem_ratio']:5.2f}x"
        device_text = f"{'-':>7}" if math.isnan(row['device_ms_per_step']) else f"{row['device_ms_per_step']:7.2f}"
        print(f"{row['setting']:<{width}} {row['ms_per_iter']:9.2f} {device_text} {row['host_ms_per_step']:7.2f} "
              f"{row['tokens_per_s']:10,.0f} {row['ratio']:6.3f}x {row['ratio_rounds']:9.3f}x "
              f"({row['ratio_min']:.3f}-{row['ratio_max']:.3f}) {row['setup_s']:7.0f} {memory_text}  "
              f"{variant_name(row['repo'], row['compile']):<12} {row['flags']}")
    untimed = [name(*k) for k in keys if not runs[k] or not runs[k[0], BASELINE]]
    if untimed:
        print(f"not timed within --time_limit {args.time_limit:g} s: {', '.join(untimed)}")
    print(f"(ms/iter: the median over rounds of each run's window, the wall-clock time from one synchronisation of "
          f"the device to the next over the {args.iters} iterations between them; device, host: the median ms per "
          f"step of the device (CUDA events) and of the host (waiting for nothing); vs nn: tokens/s over the same checkout's "
          f"baseline, from the medians; by round: the median and range of each round's ratio to the same round's "
          f"baseline, which cancels drift between rounds; setup s: the median seconds before the window (start-up, "
          f"compilation); peak memory: {mem_what})")
    for row in rows:
        if row['setting'] == NULL:
            of = '' if len(variants) == 1 else ' of ' + variant_name(row['repo'], row['compile'])
            print(f"noise floor{of}: "
                  f"{NULL}, nn's flags under a second name, at {row['ratio']:.3f}x of nn (by round "
                  f"{row['ratio_rounds']:.3f}x, {row['ratio_min']:.3f}-{row['ratio_max']:.3f}): a setting's "
                  f"difference from 1 within this is the machine's, not the setting's")
    if args.csv:
        try:
            write_csv(args.csv, rows)
        except OSError as e:
            print(f"bench/throughput.py: error: cannot write {args.csv} ({e.strerror})", file=sys.stderr)
            return 1
        print(f"wrote {args.csv}")
    return 0


if __name__ == '__main__':
    sys.exit(main())
