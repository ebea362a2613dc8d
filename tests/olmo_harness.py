"""
A tiny OLMo-core run for tests: OLMo-core's own Trainer and TransformerTrainModule on CPU, gloo,
float32, a synthetic token file, so that a callback's numbers can be checked under each parallelism
against one process.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/olmo_harness.py \
        --parallel ddp --steps 3 --out /tmp/x          # writes /tmp/x/result.json on rank 0
    python tests/olmo_harness.py --parallel single --steps 3 --out /tmp/x   # one process, no torchrun

In a worker:  setup(); tr = build(work_dir, "fsdp", steps=3, global_batch=4, micro_batch=1,
seq_len=16, callbacks={"gns": cb}, model_hook=nanogns.measure); tr.trainer.fit(); tr.losses

`parallel`: "single" (one process, or a world of 1), "ddp", "fsdp", "hsdp" (2 replicas x world/2
shards), "tp" (TP over the whole world, FSDP over the dp of 1), "cp" (Ulysses CP over the whole
world, FSDP over dp x cp), "fsdp_tp" and "fsdp_cp" (dp 2 x tp or cp world/2: 4 ranks; a cp group
other than ranks 0..C-1 needs fix_gloo_all_to_all(), which build() applies). Checked on
this CPU: all eight give the single process's per-step losses (rel <= 1e-7) and the same initial
weights; the full gradients at pre_optim_step agree to ~4e-7 rel per tensor at step 1 (AdamW then
amplifies float noise: ~3e-5 at steps 2-3 under TP/CP with lr 1e-2).

What OLMo-core 3.0.0 does (read in its source; the starred points checked by running):

(a) The input. The data loader (NumpyFSLDataLoader, shuffle=False) takes the global batch as the
    file's instances in order and gives dp rank r the instances r, r+W, r+2W, ... (strided, W = dp
    world size; the CP and TP ranks of one dp rank get the same instances). The train module cuts
    the rank's batch into micro-batches of rank_microbatch_size // seq_len instances, in order. Under
    CP the model's forward (Transformer._prepare_inputs) shards input_ids, labels and the RoPE
    buffers on the sequence dim with the CP load balancer; Ulysses' (UlyssesLoadBalancer) takes
    CONTIGUOUS chunks: cp rank c gets tokens [c*S/C, (c+1)*S/C) (labels padded with -100 to a
    multiple of C), and the attention all-to-alls to heads-parallel and back. (Ring CP's zig_zag and
    llama3 balancers interleave, but ring attention does not run on CPU.) Under TP every rank gets the
    whole micro-batch: the embedding is RowwiseParallel (vocab-sharded) with output Shard(1), so the
    norms run sequence-parallel on contiguous token chunks, w_q/w_k/w_v/w1/w3 colwise, w_out/w2
    rowwise, lm_head.w_out colwise (vocab-sharded), the loss on Shard(1) tokens.
(b) Loss and gradient. labels = input_ids shifted left with -100 last (seq_len-1 loss tokens per
    instance). Per rank and step N = that rank's loss tokens over ALL its micro-batches (not reduced
    over ranks); each micro-batch's loss = sum(CE over its tokens) / N, backward per micro-batch.
    Under CP the LM head divides by N/C instead (N counted on the full sequence), so each cp rank's
    loss is C x (its tokens' CE sum) / N. Under TP the loss is summed over the TP group before the
    division. DDP (torch's composable replicate) all-reduces with AVG on the last micro-batch only
    (no_sync before); FSDP reduce-scatters with AVG over the dp model mesh, which under CP is the
    flattened dp x cp mesh "dp_cp" (the x C compensates the /(dp*C) average). So the local .grad
    after backward, before the reduction, is dL_r/dtheta (x C under CP), and after it the gradient of
    the global-batch mean loss = the single process's gradient (* checked). At pre_optim_step, and
    with one micro-batch per rank also right after the last backward, .grad is already reduced: plain
    tensors (DDP), or the reduced shard as a DTensor like the parameter (FSDP, TP: p.grad.full_tensor()
    is the single-process gradient; TP's replicated norm weights' grads come out Replicate). The
    logged 'train/CE loss' is each rank's CE sum / N (x C, x TP for its unreduced ce_loss) averaged
    over all ranks: the global mean.
(c) The model (llama_like, d_model 32, 2 layers, 2 heads, vocab 128, MLP 96): Transformer with
    embeddings = torch.nn.Embedding; blocks["0"], blocks["1"] = TransformerBlock with attention_norm
    and feed_forward_norm = olmo_core.nn.layer_norm.RMSNorm (OLMo-core's own class, NOT
    torch.nn.RMSNorm; weight only, no bias, eps 1e-5), attention = Attention with w_q, w_k, w_v,
    w_out = torch.nn.Linear (no bias) and RoPE, feed_forward = FeedForward (SwiGLU) with w1, w2, w3 =
    torch.nn.Linear; lm_head = LMHead with norm = RMSNorm and w_out = torch.nn.Linear(32, 128), not tied.
    Names: embeddings.weight, blocks.0.attention.w_q.weight, blocks.0.attention_norm.weight,
    blocks.0.feed_forward.w1.weight, blocks.0.feed_forward_norm.weight, lm_head.norm.weight,
    lm_head.w_out.weight. model_hook runs on this model before the train module, but the weights are
    NOT config.build()'s: parallelize_model applies CP, TP, FSDP/DDP, then model.init_weights(), which
    calls model.to_empty() (fresh UNINITIALISED storage for every parameter and buffer), then
    reset_parameters() of every module that has one, then the init from init_seed through the module
    attributes (block.attention.w_q, ...). So a swapped module must keep the attribute names, and a
    buffer the hook adds is garbage after build() (* checked: a torch.ones buffer comes back as junk;
    under TP a sequence-parallel norm's buffer becomes a Replicate DTensor on the tp mesh) unless the
    module's reset_parameters() or the callback (pre_train / pre_step) sets it (* with
    model_hook=nanogns.measure the losses are unchanged, but its weight_sqgradnorm / example_count
    buffers read junk like -1.3e10 and 1.8e20 after build() in one process). Persistent buffers are
    in the model state dict: saved in checkpoints and loaded (strict) on resume.
    The Trainer also runs a dry-run batch (random tokens, the rank batch in micro-batches,
    train_batch(dry_run=True)) before step 1, forward AND backward; its gradients are zeroed before
    step 1, but the model's hooks see it (* a forward-hook counter reads 4 = 4 micro-batches at the
    first pre_step in one process) and it records 'train/masked labels (%)' at step 0.
(d) Parameters after the train module (*): single, ddp: plain tensors. fsdp: DTensor (Shard(0),)
    on the 1-D mesh "dp". hsdp: (Replicate(), Shard(0)) on ("dp_replicate", "dp_shard"). cp, fsdp_cp:
    (Shard(0),) on the flattened 1-D "dp_cp". tp, fsdp_tp: 2-D ("dp", "tp"): colwise weights and the
    embedding (_StridedShard(0), Shard(0)), rowwise weights (Shard(0), Shard(1)), norm weights
    (Shard(0), Replicate()). The world mesh is train_module.world_mesh (None in one process); with
    olmo_core.distributed.parallel: get_dp_process_group(mesh) = train_module.dp_process_group =
    trainer.dp_process_group (the ranks that get different data; not cp/tp), get_dp_model_mesh(mesh)
    (what FSDP/DDP reduce over: "dp", or "dp_cp"), get_tp_mesh(mesh), get_cp_mesh(mesh) (.get_group()
    for a process group). build() returns them in Run.
(e) Checkpoints (*): Trainer.state_dict()["callbacks"] = {name: cb.state_dict()} for every callback,
    written by each rank to save_folder/stepN/train/rank{R}.pt (torch.save) beside model_and_optim/
    (distributed checkpoint). Trainer.fit() with checkpoints on first loads the latest checkpoint in
    save_folder, then calls cb.load_state_dict(its state) for every callback of the same name (rank
    R's file, else rank0.pt), then cb.post_checkpoint_loaded(path). To resume: build() again with the
    same work_dir, save_interval and a larger `steps`, then fit() (* 2 steps, then a resume to 3:
    step 3's loss is the uninterrupted run's, and the callback's state comes back). With save_interval
    None checkpoints are off: no save, no load. Two build()s in one process work (this resets
    OLMo-core's global world mesh); setup() once per process.
(f) Batch size (*): trainer.data_loader.global_batch_size is in tokens (instances x seq_len). It can
    change by an integer factor only, a growth by k only when data_loader.batches_processed % k == 0
    (else RuntimeError); it must stay divisible by rank_microbatch_size x dp world size (checked only
    in pre_train). Set in post_step of step s, it takes effect at step s+1 (the loader rebuilds its
    iterator); single and ddp agree after a doubling at step 2.
(g) Wall times on this 2-core machine, 3 steps, global batch 4, seq 16; torchrun start-up and imports
    are ~3-4 s of each, build() 0.02-0.3 s, fit() 0.15-2 s: single (plain python) 2.7 s, single
    (torchrun, 1 proc) 3.8 s; 2 procs: ddp 4.7-5.2 s, fsdp 4.6-6.2 s, hsdp 4.2-7.9 s, tp 5.1-8.9 s,
    cp 4.8-6.6 s (15 s once under load from other jobs); 4 procs: fsdp_tp 10.2 s, fsdp_cp 8.4-8.9 s.
    Checkpointing every step: ~12 s for 2 steps on 2 procs (the distributed checkpoint saves).
"""
import argparse
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List

if __name__ == "__main__":  # a worker: one thread per rank on 2 cores (before torch loads); an
    os.environ["OMP_NUM_THREADS"] = "1"  # importing test process keeps its env, setup() sets torch's

import numpy as np
import torch
import torch.distributed as dist

from olmo_core.data import NumpyDataLoaderBase, NumpyFSLDataset
from olmo_core.data.collator import DataCollator
from olmo_core.distributed import parallel as olmo_parallel
from olmo_core.distributed.parallel import (
    DataParallelType,
    get_cp_mesh,
    get_dp_model_mesh,
    get_tp_mesh,
)
from olmo_core.distributed.utils import get_rank, get_world_size, is_distributed
from olmo_core.nn.transformer import TransformerConfig
from olmo_core.optim import AdamWConfig
from olmo_core.train import Duration, TrainerConfig, prepare_training_environment
from olmo_core.train.callbacks import Callback, CheckpointerCallback, ConsoleLoggerCallback
from olmo_core.train.train_module import (
    TransformerContextParallelConfig,
    TransformerDataParallelConfig,
    TransformerTensorParallelConfig,
    TransformerTrainModuleConfig,
)

PARALLEL = ("single", "ddp", "fsdp", "hsdp", "tp", "cp", "fsdp_tp", "fsdp_cp")
VOCAB = 128
EOS = VOCAB - 1  # ids the dataset needs; no document structure is used (plain FSL chunks)
PAD = VOCAB - 2


def write_tokens(path, n_tokens, vocab=VOCAB, seed=0):
    """A raw uint16 token file (no .npy header: OLMo-core reads the bytes with np.frombuffer)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab - 2, size=n_tokens, dtype=np.uint16)  # keep PAD/EOS out
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokens.tofile(path)
    return path


def setup(seed=0, quiet=True):
    """Once per process. gloo under torchrun (the default 'cpu:gloo,cuda:nccl' calls
    torch.cuda.set_device), no process group in a plain process."""
    torch.set_num_threads(1)
    backend = "gloo" if "RANK" in os.environ else None
    prepare_training_environment(backend=backend, seed=seed, shared_filesystem=True)
    if quiet:  # OLMo-core logs every build step at INFO
        logging.getLogger("olmo_core").setLevel(logging.WARNING)


def fix_gloo_all_to_all():
    """torch's autograd all_to_all (torch.distributed.nn.functional._AlltoAll, which Ulysses CP uses for
    k and v) falls back on gloo to dist.scatter(..., src=i, group=g) with i a rank IN the group, where
    scatter's src is a GLOBAL rank: a cp group other than ranks 0..C-1 (dp 2 x cp 2 on 4 ranks) fails
    with 'Global rank 0 is not part of group'. Here: the same scatters with group_src=i. Test-only,
    gloo-only (NCCL takes dist.all_to_all)."""
    from torch.distributed.nn import functional as dnf

    def forward(ctx, group, out_tensor_list, *tensors):
        ctx.group = group
        ctx.input_tensor_size_list = [t.size() for t in tensors]
        tensors = tuple(t.contiguous() for t in tensors)
        if dist.get_backend(group=group) != dist.Backend.GLOO:
            dist.all_to_all(out_tensor_list, list(tensors), group=group)
            return tuple(out_tensor_list)
        me = dist.get_rank(group=group)
        for i in range(dist.get_world_size(group=group)):
            dist.scatter(out_tensor_list[i], list(tensors) if i == me else None, group=group,
                         group_src=i)
        return tuple(out_tensor_list)

    dnf._AlltoAll.forward = staticmethod(forward)


def tiny_config(d_model=32, n_layers=2, n_heads=2, vocab=VOCAB, seed=0):
    return TransformerConfig.llama_like(
        d_model=d_model, vocab_size=vocab, n_layers=n_layers, n_heads=n_heads,
        hidden_size_multiple_of=16,  # the default 256 would make the MLP 8x d_model
        attn_backend="torch",  # plain SDPA: runs on CPU, and is what Ulysses CP wraps
        init_seed=seed,  # init_weights() seeds from this, after parallelisation
    )


def parallel_configs(parallel, world):
    """dp, tp, cp configs for the train module. TP and CP need a dp config too (FSDP here)."""
    fsdp = TransformerDataParallelConfig(name=DataParallelType.fsdp)
    if parallel == "single":
        assert world == 1, "'single' is one process: without a dp config gradients are not reduced"
        return None, None, None
    if parallel == "ddp":
        return TransformerDataParallelConfig(name=DataParallelType.ddp), None, None
    if parallel == "fsdp":
        return fsdp, None, None
    if parallel == "hsdp":
        return TransformerDataParallelConfig(name=DataParallelType.hsdp, num_replicas=2), None, None
    if parallel == "tp":
        return fsdp, TransformerTensorParallelConfig(degree=world), None
    if parallel == "cp":
        return fsdp, None, TransformerContextParallelConfig.ulysses(degree=world)
    if parallel == "fsdp_tp":
        return fsdp, TransformerTensorParallelConfig(degree=world // 2), None
    if parallel == "fsdp_cp":
        return fsdp, None, TransformerContextParallelConfig.ulysses(degree=world // 2)
    raise ValueError(f"parallel must be one of {PARALLEL}, got {parallel!r}")


class LossRecorder(Callback):
    """The reduced metrics of every step (metrics_collect_interval=1), as the console logger sees them."""

    def __init__(self):
        self.metrics: Dict[int, Dict[str, float]] = {}

    def log_metrics(self, step, metrics):
        # One step can come in several calls (a checkpoint save flushes the metrics so far), and
        # the dry-run batch records at step 0: merge.
        self.metrics.setdefault(step, {}).update(metrics)

    def losses(self):
        return [m["train/CE loss"] for _, m in sorted(self.metrics.items()) if "train/CE loss" in m]


@dataclass
class Run:
    trainer: Any
    model: Any  # the train module's (parallelised) model
    train_module: Any
    recorder: LossRecorder
    world_mesh: Any = None  # None in one process
    dp_group: Any = None  # ranks with different data (None in one process)
    dp_model_mesh: Any = None  # what DDP/FSDP reduce over (dp, or dp_cp under CP)
    tp_mesh: Any = None
    cp_mesh: Any = None

    @property
    def losses(self) -> List[float]:
        return self.recorder.losses()


def build(work_dir, parallel, *, steps, global_batch, micro_batch, seq_len, callbacks=(), lr=1e-3,
          seed=0, max_grad_norm=1.0, save_interval=None, model_hook=None, n_tokens=None,
          d_model=32, n_layers=2, n_heads=2):
    """The Trainer of a tiny run. global_batch and micro_batch are in instances (sequences of seq_len
    tokens); micro_batch is per rank. Call setup() first (once per process). The token file is
    written once per work_dir (n_tokens, default one batch more than the steps take); with save_interval,
    a work_dir holding checkpoints resumes."""
    work_dir = Path(work_dir)
    world = get_world_size() if is_distributed() else 1
    tokens = work_dir / "tokens.bin"
    n_tokens = n_tokens or (steps + 1) * global_batch * seq_len
    if get_rank() == 0 and not tokens.exists():
        write_tokens(tokens, n_tokens, VOCAB, seed)
    if is_distributed():
        dist.barrier()

    # The model on CPU, then the hook (measured layers must be in before any wrapper).
    model = tiny_config(d_model, n_layers, n_heads, seed=seed).build(init_device="cpu")
    if model_hook is not None:
        model = model_hook(model) or model

    dp, tp, cp = parallel_configs(parallel, world)
    if cp is not None and cp.degree < world:
        fix_gloo_all_to_all()
    olmo_parallel._WORLD_MESH = None  # build_world_mesh refuses a second mesh in one process
    train_module = TransformerTrainModuleConfig(
        rank_microbatch_size=micro_batch * seq_len,  # tokens, counted on the full sequence under CP
        max_sequence_length=seq_len,
        optim=AdamWConfig(lr=lr, weight_decay=0.0, foreach=False),
        max_grad_norm=max_grad_norm,
        dp_config=dp, tp_config=tp, cp_config=cp,
        # float32 everywhere: no autocast, fp32 params and reduction (the defaults)
    ).build(model, device=torch.device("cpu"))

    # The data: file order (shuffle=False), so the global batch is the same for every world size.
    dp_group = train_module.dp_process_group
    dataset = NumpyFSLDataset(tokens, sequence_length=seq_len, pad_token_id=PAD, eos_token_id=EOS,
                              vocab_size=VOCAB, dtype=np.uint16)
    dataset.work_dir = work_dir / "data"
    dataset.prepare()
    data_loader = NumpyDataLoaderBase.wrap_numpy_dataset(
        dataset, global_batch_size=global_batch * seq_len, collator=DataCollator(pad_token_id=PAD),
        work_dir=work_dir / "data", seed=seed, shuffle=False, num_workers=0,
        dp_world_size=get_world_size(dp_group), dp_rank=get_rank(dp_group))

    recorder = LossRecorder()
    cbs = dict(callbacks) if isinstance(callbacks, dict) else {
        type(cb).__name__: cb for cb in callbacks}
    cbs["losses"] = recorder
    cbs["console_logger"] = ConsoleLoggerCallback(log_interval=10**9, metrics_log_interval=10**9)
    if save_interval is not None:
        cbs["checkpointer"] = CheckpointerCallback(save_interval=save_interval, save_async=False,
                                                   pre_train_checkpoint=False, max_checkpoints=None)
    trainer = TrainerConfig(
        save_folder=str(work_dir / "save"), work_dir=str(work_dir), save_overwrite=True,
        max_duration=Duration.steps(steps), metrics_collect_interval=1, cancel_check_interval=10**6,
        no_checkpoints=save_interval is None, no_evals=True, callbacks=cbs,
    ).build(train_module, data_loader)

    mesh = train_module.world_mesh
    return Run(
        trainer=trainer, model=train_module.model, train_module=train_module, recorder=recorder,
        world_mesh=mesh, dp_group=dp_group,
        dp_model_mesh=None if dp is None else get_dp_model_mesh(mesh),
        tp_mesh=None if tp is None else get_tp_mesh(mesh),
        cp_mesh=None if cp is None else get_cp_mesh(mesh),
    )


def placements(model):
    """{name: 'DTensor mesh_dims placements' or 'Tensor'} for the docs and the report."""
    out = {}
    for name, p in model.named_parameters():
        if hasattr(p, "placements"):
            out[name] = (f"{p.device_mesh.mesh_dim_names} {tuple(map(str, p.placements))} "
                         f"local {tuple(p.to_local().shape)}")
        else:
            out[name] = f"Tensor {tuple(p.shape)}"
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--parallel", default="single", choices=PARALLEL)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--global_batch", type=int, default=4)
    ap.add_argument("--micro_batch", type=int, default=1)
    ap.add_argument("--seq_len", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save_interval", type=int, default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    t0 = time.time()
    setup(args.seed)
    out = Path(args.out)
    run = build(out / "work", args.parallel, steps=args.steps, global_batch=args.global_batch,
                micro_batch=args.micro_batch, seq_len=args.seq_len, lr=args.lr, seed=args.seed,
                save_interval=args.save_interval)
    # Initial weights, gathered to full tensors: the same for every parallelism (same seed).
    # (full_tensor() is a collective: every rank runs this loop.)
    init = {}
    for name, p in run.model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        w = full.detach().double().flatten()
        init[name] = [float(w.pow(2).sum()), float((w * torch.arange(len(w))).sum())]  # order too
    t1 = time.time()
    run.trainer.fit()
    t2 = time.time()
    if get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        result = dict(parallel=args.parallel, world=get_world_size() if is_distributed() else 1,
                      losses=run.losses,
                      grad_norms=[m["optim/total grad norm"] for _, m in
                                  sorted(run.recorder.metrics.items()) if "train/CE loss" in m],
                      init_sqnorms=init, placements=placements(run.model),
                      build_s=t1 - t0, fit_s=t2 - t1)
        (out / "result.json").write_text(json.dumps(result, indent=1))
        print(json.dumps(dict(parallel=args.parallel, losses=run.losses, build_s=round(t1 - t0, 2),
                              fit_s=round(t2 - t1, 2))))
    if is_distributed():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
