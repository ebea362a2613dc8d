"""
What per-example gradient norms cost in training: the same GPT trained under each setting, in
one invocation, interleaved round by round (nn, ln-shim, ..., nn, ln-shim, ...) so that drift of
a shared machine hits every setting alike.

Each step is train.py's: forward (under autocast unless float32), backward through a GradScaler,
the GNS tracker read (gnstracking.MeasurementTracker.step, which also zeroes the buffers), the
approximate hooks' measurements where they are on, clipping, AdamW, zero_grad, the buffers
zeroed, and the two host syncs of the log line (loss.item(), grad_norm.item()). Not counted:
data loading (a few random-token batches made up front) and writing log.csv.

Settings (train.py's flags for each):
    nn           plain torch layers, no measurement: the baseline
    ln-shim      --lnclass=shim                          LayerNorm only, separated LayerNorm
    ln-fused     --lnclass=fused                         LayerNorm only, fused kernel
    all-gns      --linearclass=gns --embeddingclass=gns --lnclass=shim    every parameter
    all-shim     --linearclass=shim --embeddingclass=shim --lnclass=shim  every parameter
    hooks-sogns  --gns_hooks=sogns                       SOGNS hooks on plain Linears
    hooks-exact  --gns_hooks=exact                       ghost-norm hooks on plain Linears

Reported per setting: median milliseconds per iteration over all timed iterations, tokens/s,
their ratio to the nn baseline (tokens/s over tokens/s), the same ratio taken round by round
(each round's median against that round's baseline: the median of those cancels drift between
rounds, and their range says how noisy the machine was), and peak memory. Peak memory is measured for each setting in a fresh subprocess that builds the
model and trains a few steps: on CUDA torch.cuda.max_memory_allocated (everything: weights,
optimizer state, activations, buffers); on CPU the peak resident set size above the one before
the model was built (VmHWM after resetting it through /proc/self/clear_refs). A fresh process
is needed because RSS peaks are process-global and the allocator keeps freed memory, so in one
process the settings would see each other's memory.

    python bench/throughput.py --quick
    python bench/throughput.py --rounds 10 --csv small.csv
    python bench/throughput.py --n_layer 6 --n_embd 384 --n_head 6 --block_size 256 --batch_size 16
    python bench/throughput.py --settings nn,all-gns --profile all-gns
"""
import argparse
import contextlib
import csv
import gc
import importlib
import io
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext

import torch
import torch.nn as nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import gnshooks  # noqa: E402
from buffered import find_sqgradnorm_buffers, zero_sqgradnorm_buffers  # noqa: E402
from csv_tools import ToolParser  # noqa: E402
from gnstracking import AccumulateMeasurements, MeasurementTracker  # noqa: E402
from layer_config import set_contextual_config  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

# setting -> train.py flags that differ from the plain model
SETTINGS = {
    'nn': {},
    'ln-shim': dict(lnclass='shim'),
    'ln-fused': dict(lnclass='fused'),
    'all-gns': dict(linearclass='gns', embeddingclass='gns', lnclass='shim'),
    'all-shim': dict(linearclass='shim', embeddingclass='shim', lnclass='shim'),
    'hooks-sogns': dict(gns_hooks='sogns'),
    'hooks-exact': dict(gns_hooks='exact'),
}
BASELINE = 'nn'
# train.py's class for each flag value, as module.attribute (imported when a setting needs it)
LAYER_CLASSES = {
    'linearclass': {'gns': 'buffered.PEGradNormLinear', 'shim': 'buffered.PEGradNormShimLinear'},
    'embeddingclass': {'gns': 'buffered.PEGradNormEmbedding', 'shim': 'buffered.PEGradNormShimEmbedding'},
    'lnclass': {'shim': 'buffered.PEGradNormSeparatedLayerNorm', 'fused': 'fused_gns.PEGradNormFusedLayerNorm'},
}
LAYER_KINDS = {'linearclass': 'Linear', 'embeddingclass': 'Embedding', 'lnclass': 'LayerNorm'}
DTYPES = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}
# (normal, --quick) defaults of the flags --quick changes; a flag given explicitly wins
SIZES = dict(n_layer=(4, 2), n_embd=(128, 64), n_head=(4, 2), block_size=(64, 32), batch_size=(32, 8),
             iters=(10, 4), rounds=(5, 3), warmup=(3, 2))
MEMORY_STEPS = 3  # the optimizer state exists from the first step on, so the third backward sees it all


class BenchError(Exception):
    """Bad input or a setting this checkout cannot build; the message is one line for the user."""


def flags_text(setting):
    flags = SETTINGS[setting]
    return ' '.join(f'--{k}={v}' for k, v in flags.items()) or '(plain nn)'


def layer_classes(setting):
    """The set_contextual_config(...) keyword arguments of a setting."""
    classes = {}
    for flag, kind in LAYER_KINDS.items():
        value = SETTINGS[setting].get(flag, 'nn')
        if value == 'nn':
            continue
        module_name, attr = LAYER_CLASSES[flag][value].split('.')
        cls = getattr(importlib.import_module(module_name), attr, None)
        if cls is None:
            raise BenchError(f"setting {setting} needs {module_name}.{attr}, which this checkout does not have")
        classes[kind] = cls
    return classes


class Run:
    """One setting's model, optimizer and GNS readers, stepping as train.py's loop does."""

    def __init__(self, setting, args):
        self.setting = setting
        self.device = torch.device(args.device)
        self.batch_size = args.batch_size
        torch.manual_seed(args.seed)  # every setting starts from the same weights and data
        config = GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                           block_size=args.block_size, vocab_size=args.vocab_size, bias=args.bias, dropout=0.0)
        with contextlib.redirect_stdout(io.StringIO()), set_contextual_config(**layer_classes(setting)):
            self.raw_model = GPT(config).to(self.device)
            self.optimizer = self.raw_model.configure_optimizers(0.1, 1e-3, (0.9, 0.99), self.device.type)
        self.hooks = SETTINGS[setting].get('gns_hooks')
        if self.hooks is not None:
            add = {'sogns': gnshooks.add_sogns_hooks, 'exact': gnshooks.add_exact_hooks}[self.hooks]
            gnshooks.add_hooks_to_model(self.raw_model, add)
        self.model = torch.compile(self.raw_model) if args.compile else self.raw_model
        self.params = [p for p in self.raw_model.parameters() if p.requires_grad]
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=(args.dtype == 'float16'))
        self.ctx = nullcontext() if args.dtype == 'float32' else \
            torch.autocast(device_type=self.device.type, dtype=DTYPES[args.dtype])
        self.gns_logs = AccumulateMeasurements(prefix='train/gns')
        self.tracker = None
        if find_sqgradnorm_buffers(self.raw_model):  # as train.py: whenever some layer measures
            self.tracker = MeasurementTracker.from_model(self.raw_model, callback=self.gns_logs, scaler=self.scaler)
        ids = torch.randint(args.vocab_size, (4, args.batch_size, args.block_size + 1),
                            generator=torch.Generator().manual_seed(args.seed))
        self.batches = [(b[:, :-1].contiguous().to(self.device), b[:, 1:].contiguous().to(self.device)) for b in ids]
        self.steps = 0

    def step(self):
        X, Y = self.batches[self.steps % len(self.batches)]
        with self.ctx:
            _, loss = self.model(X, Y)
        self.scaler.scale(loss).backward()
        if self.tracker is not None:
            self.tracker.step(batch_size=self.batch_size, step=self.steps)
            self.gns_logs.pop()
        self.scaler.unscale_(self.optimizer)
        if self.hooks is not None:
            gnshooks.hook_measurements(self.raw_model, self.hooks, loss_scale=self.scaler.get_scale())
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        zero_sqgradnorm_buffers(self.raw_model)
        if self.hooks is not None:
            gnshooks.zero_hook_results(self.raw_model)
        loss.item(), grad_norm.item()  # train.py's log line: the step's host syncs
        self.steps += 1

    def timed_steps(self, n):
        """Seconds of each of n steps."""
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            self.step()
            if self.device.type == 'cuda':
                torch.cuda.synchronize(self.device)
            times.append(time.perf_counter() - t0)
        return times


# -- peak memory, one fresh process per setting -------------------------------------------------

def _proc_status_kib(field):
    with open('/proc/self/status') as f:
        m = re.search(rf'^{field}:\s+(\d+) kB', f.read(), re.MULTILINE)
    return int(m.group(1)) if m else None


def measure_memory(setting, args):
    """Peak bytes of building `setting` and training MEMORY_STEPS steps, in this (fresh) process."""
    device = torch.device(args.device)
    # torch's one-time allocations (kernel libraries, thread pools, autograd engine) are no
    # setting's cost: run a throwaway one-layer copy of the setting first
    tiny = argparse.Namespace(**{**vars(args), 'n_layer': 1, 'n_embd': args.n_head * 8, 'batch_size': 2, 'block_size': 8})
    warm = Run(setting, tiny)
    for _ in range(2):
        warm.step()
    del warm
    gc.collect()
    if device.type == 'cuda':
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        run = Run(setting, args)
        for _ in range(MEMORY_STEPS):
            run.step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    try:  # Linux: reset the high-water mark to the current RSS, then read it back afterwards
        before = _proc_status_kib('VmRSS') * 1024
        with open('/proc/self/clear_refs', 'w') as f:
            f.write('5')
        peak = lambda: _proc_status_kib('VmHWM') * 1024
    except (OSError, TypeError):  # elsewhere: the lifetime peak (bytes on macOS, KiB on Linux)
        unit = 1 if sys.platform == 'darwin' else 1024
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit
        peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit
    run = Run(setting, args)
    for _ in range(MEMORY_STEPS):
        run.step()
    return peak() - before


def memory_in_subprocess(setting, args):
    argv = [sys.executable, os.path.abspath(__file__), '--memory_of', setting, '--device', args.device,
            '--dtype', args.dtype, '--vocab_size', str(args.vocab_size), '--seed', str(args.seed)]
    argv += [f'--{k}={getattr(args, k)}' for k in ('n_layer', 'n_embd', 'n_head', 'block_size', 'batch_size')]
    argv += ['--compile'] * args.compile + ['--bias'] * args.bias
    argv += [f'--threads={args.threads}'] if args.threads else []
    # glibc: a fixed mmap threshold (no dynamic raise) maps every tensor above 64 KiB on its own
    # and unmaps it when freed, so RSS follows the live tensors rather than the heap's leftovers
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_='65536')
    done = subprocess.run(argv, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"memory measurement of {setting} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])['peak_bytes']


# -- profile ------------------------------------------------------------------------------------

PROFILE_PASSES = 3  # interleaved, like the timing rounds, so that drift does not land on one setting


def profile(runs, settings, iters, rows):
    """
    torch.profiler over PROFILE_PASSES x `iters` steps of each setting and the baseline, the
    settings taking turns. Prints, per setting: the top ops by self CPU time (last pass), the
    backward nodes by total CPU time, and the ops whose self CPU time per iteration differs most
    from the baseline's: where a setting's extra time goes.
    """
    from torch.profiler import ProfilerActivity, profile as torch_profile
    settings = [BASELINE] + [s for s in settings if s != BASELINE]
    self_ms = {s: {} for s in settings}  # op -> self CPU ms per iteration
    node_ms = {s: {} for s in settings}  # backward node -> total CPU ms per iteration
    wall_ms = {s: 0.0 for s in settings}
    tables = {}
    n = PROFILE_PASSES * iters
    for _ in range(PROFILE_PASSES):
        for s in settings:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if runs[s].device.type == 'cuda' else [])
            with torch_profile(activities=activities) as prof:
                wall_ms[s] += sum(runs[s].timed_steps(iters)) * 1e3 / n
            events = prof.key_averages()
            for e in events:
                self_ms[s][e.key] = self_ms[s].get(e.key, 0.0) + e.self_cpu_time_total / 1e3 / n
                if e.key.startswith('autograd::engine::evaluate_function: '):
                    name = e.key.split(': ', 1)[1]
                    node_ms[s][name] = node_ms[s].get(name, 0.0) + e.cpu_time_total / 1e3 / n
            tables[s] = events.table(sort_by='self_cpu_time_total', row_limit=rows)
    base = self_ms[BASELINE]
    for s in settings:
        in_ops = sum(self_ms[s].values())
        print(f"\nprofile of {s} ({flags_text(s)}), {PROFILE_PASSES} x {iters} iterations: {wall_ms[s]:.1f} ms per "
              f"iteration under the profiler, {in_ops:.1f} ms of it inside ops; ops by self CPU time (last pass):")
        print(tables[s])
        print(f"backward nodes of {s}, total CPU time per iteration (the ops inside them included):")
        for name, ms in sorted(node_ms[s].items(), key=lambda kv: -kv[1])[:rows]:
            print(f"  {name:<56} {ms:9.2f} ms")
        if s == BASELINE:
            continue
        deltas = sorted(((ms - base.get(op, 0.0), op) for op, ms in self_ms[s].items()), reverse=True)
        deltas += sorted((-ms, op) for op, ms in base.items() if op not in self_ms[s])
        print(f"self CPU time per iteration against {BASELINE}'s ({in_ops - sum(base.values()):+.1f} ms inside ops, "
              f"{wall_ms[s] - wall_ms[BASELINE]:+.1f} ms wall), the largest differences:")
        for delta, op in sorted(deltas, key=lambda d: -abs(d[0]))[:rows]:
            print(f"  {op:<56} {delta:+8.2f} ms  ({base.get(op, 0.0):.2f} -> {self_ms[s].get(op, 0.0):.2f})")


# -- command line -------------------------------------------------------------------------------

def positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not positive")
    return value


def settings_list(text):
    names = [s.strip() for s in text.split(',') if s.strip()]
    unknown = [s for s in names if s not in SETTINGS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown setting(s) {', '.join(unknown) or repr(text)}; "
                                         f"choose from {', '.join(SETTINGS)}")
    return list(dict.fromkeys(names))


def parse_args(argv):
    parser = ToolParser(prog='bench/throughput.py', description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--settings', type=settings_list, default=list(SETTINGS),
                        help=f"comma-separated subset of {','.join(SETTINGS)} (default: all); "
                             f"{BASELINE} is always run as the baseline")
    parser.add_argument('--device', default='cpu', help="cpu, cuda or cuda:N (default: cpu)")
    parser.add_argument('--dtype', choices=list(DTYPES), default='float32',
                        help="float32, or autocast to bfloat16/float16 as train.py does (default: float32)")
    parser.add_argument('--compile', action='store_true', help="torch.compile every model (default: eager)")
    quick = lambda k: f"(default: {SIZES[k][0]}, --quick: {SIZES[k][1]})"
    for k, what in (('n_layer', 'transformer blocks'), ('n_embd', 'model width'), ('n_head', 'attention heads'),
                    ('block_size', 'tokens per example'), ('batch_size', 'examples per step')):
        parser.add_argument(f'--{k}', type=positive_int, help=f"{what} {quick(k)}")
    parser.add_argument('--vocab_size', type=positive_int, default=65,
                        help="vocabulary (default: 65, shakespeare_char's)")
    parser.add_argument('--bias', action='store_true', help="biases in Linears and LayerNorms (train.py's default: none)")
    parser.add_argument('--iters', type=positive_int, help=f"timed iterations per setting and round {quick('iters')}")
    parser.add_argument('--rounds', type=positive_int, help=f"rounds over all settings {quick('rounds')}")
    parser.add_argument('--warmup', type=positive_int,
                        help=f"untimed iterations per setting before the first round {quick('warmup')}")
    parser.add_argument('--quick', action='store_true', help="a small model and few iterations: about a minute on 2 CPU cores")
    parser.add_argument('--csv', metavar='PATH', help="also write the results to this CSV file")
    parser.add_argument('--profile', type=settings_list, metavar='SETTINGS',
                        help=f"after timing, profile these settings and the baseline (torch.profiler, {PROFILE_PASSES} "
                             f"interleaved passes of --iters iterations): top ops, backward nodes, and the ops whose "
                             f"time differs most from the baseline's")
    parser.add_argument('--profile_rows', type=positive_int, default=15, help="rows of each profile table (default: 15)")
    parser.add_argument('--threads', type=positive_int,
                        help="CPU threads for torch (default: torch's own choice); on a busy machine 1 is steadier")
    parser.add_argument('--seed', type=int, default=1337)
    parser.add_argument('--memory_of', help=argparse.SUPPRESS)  # internal: one setting's peak memory, as JSON
    args = parser.parse_args(argv)

    for k, (normal, small) in SIZES.items():
        if getattr(args, k) is None:
            setattr(args, k, small if args.quick else normal)
    if args.n_embd % args.n_head:
        parser.error(f"--n_embd={args.n_embd} is not divisible by --n_head={args.n_head}")
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
    if BASELINE not in args.settings:
        args.settings.insert(0, BASELINE)
    if args.profile:
        args.settings += [s for s in args.profile if s not in args.settings]
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_of:
        print(json.dumps({'peak_bytes': measure_memory(args.memory_of, args)}))
        return 0
    try:
        runs = {s: Run(s, args) for s in args.settings}
    except BenchError as e:
        print(f"bench/throughput.py: error: {e}", file=sys.stderr)
        return 2
    tokens_per_iter = args.batch_size * args.block_size
    n_params = runs[BASELINE].raw_model.get_num_params()
    where = torch.cuda.get_device_name(args.device) if args.device.startswith('cuda') else \
        f"cpu, {torch.get_num_threads()} threads"
    print(f"GPT {args.n_layer} layers x {args.n_embd} wide, {args.n_head} heads, block {args.block_size}, "
          f"batch {args.batch_size} ({n_params / 1e6:.2f}M parameters, {tokens_per_iter:,} tokens/iter); "
          f"{args.dtype}, {'compiled' if args.compile else 'eager'}, {where}")
    print(f"{len(args.settings)} settings x {args.rounds} rounds x {args.iters} iterations, "
          f"after {args.warmup} warmup iterations each", flush=True)

    for run in runs.values():
        run.timed_steps(args.warmup)
    times = {s: [] for s in args.settings}  # per setting, per round: seconds of each iteration
    for r in range(args.rounds):
        for s in args.settings:
            times[s].append(runs[s].timed_steps(args.iters))
        print(f"  round {r + 1}/{args.rounds}: " + ', '.join(
            f"{s} {statistics.median(times[s][-1]) * 1e3:.1f}" for s in args.settings) + " ms/iter", flush=True)
    if args.profile:
        profile(runs, args.profile, args.iters, args.profile_rows)
    del runs
    gc.collect()

    print("peak memory: one fresh process per setting ...", flush=True)
    memory = {s: memory_in_subprocess(s, args) for s in args.settings}
    rows = []
    base_ms = statistics.median(t for rnd in times[BASELINE] for t in rnd) * 1e3
    for s in args.settings:
        ms = statistics.median(t for rnd in times[s] for t in rnd) * 1e3
        round_ratios = [statistics.median(b) / statistics.median(t) for b, t in zip(times[BASELINE], times[s])]
        rows.append(dict(setting=s, flags=flags_text(s), ms_per_iter=ms, tokens_per_s=tokens_per_iter / ms * 1e3,
                         ratio=base_ms / ms, ratio_rounds=statistics.median(round_ratios),
                         ratio_min=min(round_ratios), ratio_max=max(round_ratios),
                         peak_mem_mib=memory[s] / 2**20, mem_ratio=memory[s] / memory[BASELINE],
                         device=args.device, dtype=args.dtype, compile=args.compile, n_layer=args.n_layer,
                         n_embd=args.n_embd, n_head=args.n_head, block_size=args.block_size,
                         batch_size=args.batch_size, iters=args.iters, rounds=args.rounds))
    mem_what = 'max_memory_allocated' if args.device.startswith('cuda') else 'peak RSS increase'
    print()
    header = (f"{'setting':<12} {'ms/iter':>9} {'tokens/s':>10} {'vs nn':>7} {'by round (min-max)':>24} "
              f"{'peak MiB':>9} {'vs nn':>6}  flags")
    print(header)
    print('-' * (len(header) + 40))
    for row in rows:
        print(f"{row['setting']:<12} {row['ms_per_iter']:9.2f} {row['tokens_per_s']:10,.0f} {row['ratio']:6.3f}x "
              f"{row['ratio_rounds']:9.3f}x ({row['ratio_min']:.3f}-{row['ratio_max']:.3f}) "
              f"{row['peak_mem_mib']:9.1f} {row['mem_ratio']:5.2f}x  "
              f"{row['flags']}")
    print(f"(vs nn: tokens/s over the baseline's, from the medians over all timed iterations; by round: the "
          f"median and range of each round's ratio to the same round's baseline, which cancels drift between "
          f"rounds, a wide range says the machine was noisy; peak memory: {mem_what}, one process per setting)")
    if args.csv:
        try:
            with open(args.csv, 'w', newline='') as f:
                writer = csv.DictWriter(f, fieldnames=list(rows[0]))
                writer.writeheader()
                writer.writerows(rows)
        except OSError as e:
            print(f"bench/throughput.py: error: cannot write {args.csv} ({e.strerror})", file=sys.stderr)
            return 1
        print(f"wrote {args.csv}")
    return 0


if __name__ == '__main__':
    sys.exit(main())
