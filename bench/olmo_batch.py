"""
The batch size from the GNS in OLMo-core (nanogns.olmo.GNSCallback, bs_controller="gns") against OLMo-core's
own BatchSizeSchedulerCallback and a fixed batch, in a short CPU run: a tiny llama-like OLMo-core model on
shakespeare_char's characters (its train.bin: raw uint16 tokens, the format OLMo-core reads), trained to
the same token budget with the same learning rate, three ways:

    fixed      the start batch all along
    schedule   OLMo-core's schedule: the batch doubled at a third and again at two thirds of the budget
               (its callback also scales the learning rate by sqrt(2) at each doubling)
    gns        GNSCallback(bs_controller="gns"): from the start batch up to 4x it, following the live
               GNS of every parameter (fraction 1, warm-up --warmup steps, at most one change per 5% of the budget)

each with --seeds seeds. Reported per run: the optimizer steps taken, the batch at the end, the step of
each change, the final validation loss (the mean loss over the first 64 sequences of val.bin) and the
wall time; the table goes to OUT_DIR/results.md and OUT_DIR/results.csv.

    python data/shakespeare_char/prepare.py
    python bench/olmo_batch.py                  # 6 runs of 1,000,000 tokens, about 25 s each on a CPU
    python bench/olmo_batch.py --seeds 1 --max_tokens 100000
"""
import argparse
import math
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads: one thread a run

import numpy as np
import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from nanogns.runlog import atomic_write  # noqa: E402

SETTINGS = ("fixed", "schedule", "gns")
T, VOCAB, PAD, EOS = 64, 128, 126, 127  # shakespeare_char's 65 symbols are ids 0-64
START = 8  # instances in the start batch (512 tokens)


def build_run(data_dir, out, setting, seed, max_tokens, warmup, lr):
    """A Trainer of the tiny model, measured, with the setting's batch-size callback."""
    from olmo_core.data import NumpyDataLoaderBase, NumpyFSLDataset
    from olmo_core.data.collator import DataCollator
    from olmo_core.nn.transformer import TransformerConfig
    from olmo_core.optim import AdamWConfig
    from olmo_core.train import Duration, TrainerConfig
    from olmo_core.train.callbacks import BatchSizeSchedulerCallback, ConsoleLoggerCallback
    from olmo_core.train.train_module import TransformerTrainModuleConfig

    import nanogns
    from nanogns.olmo import GNSCallback

    config = TransformerConfig.llama_like(d_model=64, vocab_size=VOCAB, n_layers=2, n_heads=4,
                                          hidden_size_multiple_of=16, attn_backend="torch", init_seed=seed)
    model = nanogns.measure(config.build(init_device="cpu"))
    train_module = TransformerTrainModuleConfig(rank_microbatch_size=START * T, max_sequence_length=T,
                                                max_grad_norm=1.0, optim=AdamWConfig(lr=lr, weight_decay=0.0)
                                                ).build(model, device=torch.device("cpu"))
    dataset = NumpyFSLDataset(os.path.join(data_dir, "train.bin"), sequence_length=T, pad_token_id=PAD,
                              eos_token_id=EOS, vocab_size=VOCAB, dtype=np.uint16)
    dataset.work_dir = os.path.join(out, "data")
    dataset.prepare()
    loader = NumpyDataLoaderBase.wrap_numpy_dataset(dataset, global_batch_size=START * T, seed=seed,
                                                    work_dir=os.path.join(out, "data"),
                                                    collator=DataCollator(pad_token_id=PAD))
    gns = GNSCallback(out_dir=os.path.join(out, "gns"))
    callbacks = {"console_logger": ConsoleLoggerCallback(log_interval=10**9)}
    if setting == "schedule":
        third = max_tokens // 3
        callbacks["batch_size"] = BatchSizeSchedulerCallback(
            batch_sizes=[START * T, 2 * START * T, 4 * START * T],
            schedule=[Duration.tokens(0), Duration.tokens(third), Duration.tokens(2 * third)])
    if setting == "gns":
        gns = GNSCallback(out_dir=os.path.join(out, "gns"), bs_controller="gns", bs_max_tokens=4 * START * T,
                          bs_warmup_steps=warmup, bs_update_tokens=max_tokens // 20)
    callbacks["gns"] = gns
    return TrainerConfig(save_folder=os.path.join(out, "save"), max_duration=Duration.tokens(max_tokens),
                         no_checkpoints=True, no_evals=True, metrics_collect_interval=10**9, callbacks=callbacks,
                         cancel_check_interval=10**6).build(train_module, loader)


def val_loss(model, data_dir, n=64):
    """The mean next-token loss over the first n sequences of T tokens of val.bin (fewer if it is shorter)."""
    tokens = np.fromfile(os.path.join(data_dir, "val.bin"), dtype=np.uint16)
    n = min(n, (len(tokens) - 1) // T)
    tokens = tokens[:n * T + 1].astype(np.int64)
    ids = torch.from_numpy(tokens[:n * T]).view(n, T)
    labels = torch.from_numpy(tokens[1:n * T + 1]).view(n, T)
    with torch.no_grad():
        logits = model(ids)
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten()).item()


def batch_changes(log_path):
    """[(step, examples)] where the logged batch changed, from the run's log.csv, and the last batch."""
    import pandas as pd
    log = pd.read_csv(log_path)
    sizes = log[[c for c in log.columns if c.endswith("/batch_size")][0]].astype(int).tolist()
    changes = [(int(step), b) for step, b, before in zip(log["step"], sizes, [None] + sizes[:-1]) if b != before]
    return changes[1:], sizes[-1], len(sizes)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out_dir", default="out-olmo-batch", help="where the runs go (default: out-olmo-batch)")
    parser.add_argument("--data_dir", default=os.path.join(ROOT, "data", "shakespeare_char"),
                        help="train.bin and val.bin (default: data/shakespeare_char)")
    parser.add_argument("--seeds", type=int, default=2, help="seeds per setting (default: 2)")
    parser.add_argument("--max_tokens", type=int, default=1_000_000, help="tokens a run (default: 1000000)")
    parser.add_argument("--warmup", type=int, default=20, help="the controller's bs_warmup_steps (default: 20)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW's learning rate (default: 3e-3)")
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, from {', '.join(SETTINGS)}")
    args = parser.parse_args(argv)
    settings = args.settings.split(",")
    bad = [s for s in settings if s not in SETTINGS]
    if bad or args.seeds < 1 or args.max_tokens < 12 * START * T or args.warmup < 1 or not args.lr > 0:
        parser.error(f"--settings from {', '.join(SETTINGS)} (not {', '.join(bad)}), --seeds >= 1, --max_tokens >= "
                     f"{12 * START * T}, --warmup >= 1, --lr > 0" if bad else
                     f"--seeds >= 1, --max_tokens >= {12 * START * T}, --warmup >= 1, --lr > 0")
    for name in ("train.bin", "val.bin"):
        if not os.path.isfile(os.path.join(args.data_dir, name)):
            parser.error(f"{os.path.join(args.data_dir, name)} is missing: run python data/shakespeare_char/prepare.py")
    from olmo_core.train import prepare_training_environment
    import logging
    prepare_training_environment(backend=None)
    logging.getLogger("olmo_core").setLevel(logging.WARNING)
    rows = []
    runs = [(s, seed) for s in settings for seed in range(1, args.seeds + 1)]
    for i, (setting, seed) in enumerate(runs):
        out = os.path.join(args.out_dir, f"{setting}-s{seed}")
        if os.path.exists(os.path.join(out, "gns", "log.csv")):
            parser.error(f"{out} holds a finished or started run: delete it, or give another --out_dir")
        print(f"[{i + 1}/{len(runs)}] {setting} seed {seed}", flush=True)
        began = time.time()
        torch.manual_seed(seed)
        trainer = build_run(args.data_dir, out, setting, seed, args.max_tokens, args.warmup, args.lr)
        trainer.fit()
        changes, last, steps = batch_changes(os.path.join(out, "gns", "log.csv"))
        rows.append(dict(setting=setting, seed=seed, steps=steps, final_batch=last,
                         changes=" ".join(f"{b}@{s}" for s, b in changes) or "-",
                         val_loss=val_loss(trainer.train_module.model, args.data_dir),
                         seconds=time.time() - began))
        print(f"    {steps} steps, batch {START} -> {last}, val loss {rows[-1]['val_loss']:.4f}, "
              f"{rows[-1]['seconds']:.0f} s", flush=True)
    import pandas as pd
    table = pd.DataFrame(rows)
    lines = ["| setting | seed | steps | batch at the end | changes (examples@step) | val loss | seconds |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r.setting} | {r.seed} | {r.steps} | {r.final_batch} | {r.changes} | {r.val_loss:.4f} | "
              f"{r.seconds:.0f} |" for r in table.itertuples()]
    text = "\n".join(lines) + "\n"
    atomic_write(os.path.join(args.out_dir, "results.md"), lambda f: f.write(text), mode="w")
    atomic_write(os.path.join(args.out_dir, "results.csv"), lambda f: f.write(table.to_csv(index=False)), mode="w")
    print(text)
    if not all(math.isfinite(v) for v in table.val_loss):
        print("warning: a run's validation loss is not finite", file=sys.stderr)


if __name__ == "__main__":
    main()
