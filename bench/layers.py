"""
What measuring per-example gradient norms costs a whole model, on CPU: the shakespeare_char
baby GPT (6 layers, 384 wide, 6 heads, block 256, vocabulary 65) trained with AdamW, with plain
torch layers against every layer `gns` (fused) and every layer `shim`. Each setting runs in a
fresh subprocess so that its peak resident memory (ru_maxrss) is its own.

Reports ms per iteration (forward + backward + AdamW step, after warmup), median and fastest over
all timed iterations of all rounds, the median process CPU time per iteration (all threads; less
sensitive than wall time to other load on the machine), and the peak resident memory, total and
above what the process held before its first step (the largest over rounds).

    python bench/layers.py                    # batch 8
    python bench/layers.py --batch_size 64    # nanoGPT's shakespeare_char batch (slow on CPU)
    python bench/layers.py --sweep            # one layer: ghost vs materialise over T and shapes
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import nanogns.layers as buffered  # noqa: E402
from bench.runs import dies_with_parent  # noqa: E402
from nanogns.logread import ToolParser  # noqa: E402
from nanogns.layers.config import classes_for_flags, set_contextual_config  # noqa: E402

# train.py's layer flags of each setting, every value the registry's (buffered.MEASURED_CLASSES);
# the normalisations have no gns class, their separated one serves both
SETTINGS = {"nn": {}, **{value: dict(linearclass=value, embeddingclass=value, lnclass="shim")
                         for value in buffered.MEASURED_CLASSES["linear"]}}


def maxrss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def child(args):
    """One setting, in this process: time training iterations, report JSON on stdout."""
    from model import GPT, GPTConfig
    torch.manual_seed(0)
    config = GPTConfig(n_layer=6, n_head=6, n_embd=384, block_size=256, vocab_size=65, dropout=0.0, bias=False)
    with set_contextual_config(**classes_for_flags(**SETTINGS[args.child])):
        model = GPT(config)
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.99), "cpu")
    x = torch.randint(0, 65, (args.batch_size, 256))
    y = torch.randint(0, 65, (args.batch_size, 256))
    before = maxrss_mib()
    times, cpu_times = [], []
    for i in range(args.warmup + args.iters):
        start, cpu_start = time.perf_counter(), time.process_time()
        _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        buffered.zero_sqgradnorm_buffers(model)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    measured = len(buffered.find_sqgradnorm_buffers(model))
    print(json.dumps(dict(setting=args.child, ms=[1000 * t for t in times[args.warmup:]],
                          cpu_ms=[1000 * t for t in cpu_times[args.warmup:]],
                          peak_mib=maxrss_mib(), extra_mib=maxrss_mib() - before, measured=measured)))


def sweep(args):
    """Fused and shim Linear, forward + backward, ghost vs materialise, at 16384 tokens."""
    def best_ms(layer, x, n=3):
        ts = []
        for _ in range(n + 1):
            start = time.perf_counter()
            layer(x).backward(torch.ones(*x.shape[:-1], layer.out_features))
            ts.append(time.perf_counter() - start)
        return 1000 * min(ts[1:])
    print(f"{'K x L':>10} {'T':>4} {'nn':>7} {'gns ghost':>10} {'gns mat':>8} {'shim ghost':>11} {'shim mat':>9}"
          f" {'T^2(K+L)/KL':>12} {'T(K+L)/KL':>10}")
    for K, L in [(384, 384), (384, 1536), (384, 65)]:
        for T in [4, 16, 64, 256]:
            x = torch.randn(16384 // T, T, K, requires_grad=True)
            row = [best_ms(nn.Linear(K, L), x)]
            for cls in buffered.MEASURED_CLASSES["linear"].values():  # gns, shim: the registry's
                for mode in ("ghost", "materialise"):
                    layer = cls(K, L)
                    layer.per_example_mode = mode
                    row.append(best_ms(layer, x))
            print(f"{f'{K}x{L}':>10} {T:>4} {row[0]:>7.0f} {row[1]:>10.0f} {row[2]:>8.0f} {row[3]:>11.0f} {row[4]:>9.0f}"
                  f" {T * T * (K + L) / (K * L):>12.1f} {T * (K + L) / (K * L):>10.2f}", flush=True)


def main():
    parser = ToolParser(prog="bench/layers.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--iters", type=int, default=5, help="timed iterations (median reported)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="times each setting is run, interleaved")
    parser.add_argument("--sweep", action="store_true", help="per-layer ghost vs materialise timings instead")
    parser.add_argument("--child", choices=sorted(SETTINGS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.batch_size < 1 or args.iters < 1 or args.rounds < 1 or args.warmup < 0:
        parser.error("--batch_size, --iters and --rounds must be positive, --warmup non-negative")
    if args.child:
        return child(args)
    if args.sweep:
        return sweep(args)
    print(f"baby GPT (6x384, block 256, vocab 65, bias=False) on CPU, batch {args.batch_size}, "
          f"{torch.get_num_threads()} threads; {args.rounds} rounds of the settings in turn, each a fresh "
          f"process timing {args.iters} iterations after {args.warmup} warmup")
    results = {name: [] for name in SETTINGS}
    for _ in range(args.rounds):  # interleaved, so a change in machine load hits every setting
        for name in SETTINGS:
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", name,
                                  f"--batch_size={args.batch_size}", f"--iters={args.iters}",
                                  f"--warmup={args.warmup}"], capture_output=True, text=True,
                                 preexec_fn=dies_with_parent())
            if out.returncode != 0:
                sys.exit(f"setting {name} failed:\n{out.stderr}")
            results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{'layers':>6} {'median ms':>10} {'x nn':>6} {'min ms':>8} {'x nn':>6} {'CPU ms':>8} {'x nn':>6}"
          f" {'peak MiB':>9} {'extra MiB':>10} {'measured params':>16}")
    base = None
    for name, runs in results.items():
        times = [t for r in runs for t in r["ms"]]
        cpu = statistics.median([t for r in runs for t in r["cpu_ms"]])  # less sensitive to other load
        median, fastest = statistics.median(times), min(times)
        base = base or (median, fastest, cpu)
        print(f"{name:>6} {median:>10.0f} {median / base[0]:>6.2f} {fastest:>8.0f} {fastest / base[1]:>6.2f}"
              f" {cpu:>8.0f} {cpu / base[2]:>6.2f} {max(r['peak_mib'] for r in runs):>9.0f}"
              f" {max(r['extra_mib'] for r in runs):>10.0f} {runs[0]['measured']:>16}")


if __name__ == "__main__":
    main()
