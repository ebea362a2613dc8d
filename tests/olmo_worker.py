"""
Worker for tests/test_olmo.py: tiny OLMo-core runs (tests/olmo_harness.py) measured by nanogns.olmo.GNSCallback,
one after another in the same processes,
    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/olmo_worker.py OUT ddp fsdp tp cp
    python tests/olmo_worker.py OUT single resume
Each parallelism measures what it can measure exactly (context parallelism: the normalisations; the others
every layer) and writes OUT/<configuration>/gns/log.csv; rank 0 prints
"ok <configuration>" and the live GNS that OLMo-core's metrics got at the last step. The other configurations:
- resume-<parallelism>: STEPS steps saved at step 1, then a new Trainer in the same folder resumes from that
  checkpoint to the end: OUT/resume-<parallelism>/gns/log.csv, to be compared with the straight run's;
- bs: the batch from the GNS (bs_controller="gns"), which grows to its ceiling on every rank alike, and the
  same run resumed after the change (OUT/bs-resumed/gns/log.csv, to be compared with OUT/bs's);
- refusals: what the callback cannot measure, one line each (under 2 ranks: tensor and context parallelism).
"""
import sys

import olmo_harness as harness
import torch.distributed as dist

import nanogns
from nanogns.olmo import GNSCallback, GNSCallbackError

STEPS, GLOBAL_BATCH, MICRO_BATCH, SEQ_LEN = 3, 4, 1, 16
LAYERS = {"cp": dict(linear=None, embedding=None), "fsdp_cp": dict(linear=None, embedding=None)}


def rank0():
    return not dist.is_initialized() or dist.get_rank() == 0


def build(work, parallel, callback, steps=STEPS, layers=None, compiled=False, **kwargs):
    layers = LAYERS.get(parallel, {}) if layers is None else layers

    def hook(model):
        nanogns.measure(model, **layers)
        if compiled:  # as compile_model=True does on CUDA (OLMo-core skips it on a CPU)
            for block in model.blocks.values():
                block.compile(fullgraph=False)
    return harness.build(work, parallel, steps=steps, global_batch=GLOBAL_BATCH, micro_batch=MICRO_BATCH,
                         seq_len=SEQ_LEN, lr=1e-3, callbacks={"gns": callback}, model_hook=hook, **kwargs)


def measured(out, parallel):
    run = build(f"{out}/{parallel}", parallel, GNSCallback(out_dir=f"{out}/{parallel}/gns"))
    run.trainer.fit()
    if rank0():
        live = {k: round(v, 6) for k, v in run.recorder.metrics[STEPS].items() if k.startswith("gns/")}
        print(f"ok {parallel} {live}", flush=True)


def resumed(out, parallel):
    work = f"{out}/resume-{parallel}"
    tokens = (STEPS + 1) * GLOBAL_BATCH * SEQ_LEN  # the straight run's data, though the first run is shorter
    first = build(work, parallel, GNSCallback(out_dir=f"{work}/gns"), steps=1, save_interval=1, n_tokens=tokens)
    first.trainer.fit()  # saves at step 1, and closes its log
    second = build(work, parallel, GNSCallback(out_dir=f"{work}/gns"), save_interval=STEPS)  # one save, at the end
    second.trainer.fit()  # loads step 1's checkpoint, the callback's state with it
    if rank0():
        print(f"ok resume-{parallel}", flush=True)


def controlled(out_dir):
    """A callback whose batch doubles (its ceiling) as soon as the EMA has averaged 2 steps."""
    return GNSCallback(out_dir=out_dir, bs_controller="gns", bs_max_tokens=2 * GLOBAL_BATCH * SEQ_LEN,
                       bs_warmup_steps=2, bs_update_tokens=0)


def batch_from_gns(out):
    """The batch doubles at step 3, on every rank; the same run saved at step 3 and resumed writes its log."""
    start = GLOBAL_BATCH * SEQ_LEN
    parallel = "ddp" if dist.is_initialized() else "single"
    run = build(f"{out}/bs", parallel, controlled(f"{out}/bs/gns"), steps=5, n_tokens=12 * start)
    run.trainer.fit()
    build(f"{out}/bs-resumed", parallel, controlled(f"{out}/bs-resumed/gns"), steps=3, n_tokens=12 * start,
          save_interval=3).trainer.fit()
    resumed = build(f"{out}/bs-resumed", parallel, controlled(f"{out}/bs-resumed/gns"), steps=5,
                    n_tokens=12 * start, save_interval=5)
    resumed.trainer.fit()  # from step 3's checkpoint, its batch already doubled
    assert resumed.trainer.data_loader.global_batch_size == 2 * start
    sizes = [None] * dist.get_world_size() if dist.is_initialized() else [None]
    if dist.is_initialized():
        dist.all_gather_object(sizes, run.trainer.data_loader.global_batch_size)
    else:
        sizes = [run.trainer.data_loader.global_batch_size]
    assert sizes == [2 * start] * len(sizes), sizes
    if rank0():
        print("ok bs", flush=True)


def refusals(out):
    """Each refused setting raises one line when the Trainer is built (at the callback's post_attach)."""
    parallel = "tp" if dist.is_initialized() else "single"
    cases = [("single", dict(linear=None, embedding=None, norm=None), False, "no measured layers")]
    if dist.is_initialized():
        cases = [("cp", dict(embedding=None), False, "blocks.0.attention.w_q (PEGradNormLinear) is measured"),
                 ("cp", None, True, "a compiled model (compile_model=True) under context parallelism")]
    for parallel, layers, compiled, words in cases:
        try:
            build(f"{out}/refused-{parallel}", parallel, GNSCallback(out_dir=f"{out}/refused"), layers=layers,
                  compiled=compiled)
        except GNSCallbackError as e:
            assert words in str(e) and "\n" not in str(e), str(e)
        else:
            raise AssertionError(f"{parallel} {layers} was not refused")
    if rank0():
        print("ok refusals", flush=True)


if __name__ == "__main__":
    harness.setup()
    for config in sys.argv[2:]:
        if config.startswith("resume-"):
            resumed(sys.argv[1], config.removeprefix("resume-"))
        elif config == "bs":
            batch_from_gns(sys.argv[1])
        elif config == "refusals":
            refusals(sys.argv[1])
        else:
            measured(sys.argv[1], config)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
