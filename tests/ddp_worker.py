"""
Worker for tests/test_estimators_ddp.py, launched on CPU with gloo:
    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/ddp_worker.py OUT_DIR
Each rank runs every check and writes OUT_DIR/rank{r}.json; the test compares ranks and
brute-force values there (the shared oracle of tests/gns_fixtures.py). Nothing is asserted here,
so a failure shows up as a readable diff.
"""
import copy
import json
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import nanogns.estimators.ddp as ddpgns  # noqa: E402
from nanogns.stopping import leave  # noqa: E402
import nanogns.estimators.exact as gnstracking  # noqa: E402
from nanogns.layers import (NORM_METHODS, linear_norm_methods, measure, measured_linears,  # noqa: E402
                      register_sqgradnorm_buffers, set_linear_norm_methods)
from gns_fixtures import MEASURED, example_sqnorms, per_example_grads, tiny_gpt, tiny_hf  # noqa: E402

MICRO_STEPS = 2
MICRO_BATCH = 3
LOSS_SCALES = [1.0, 2.0 ** 10]  # step 1 stands in for a float16 GradScaler's scale


def sq_norm(tensors):
    return sum(float(t.double().pow(2).sum()) for t in tensors)


def hook_vs_brute_force(rank, world, dtype):
    """Two optimizer steps of 2 micro-steps each through a hooked DDP GPT, a plain DDP GPT and a
    non-DDP copy of the same GPT, all on the same rank-dependent batches. The hook measures each
    rank's own gradient, so its brute force is that copy's backward, in the model's dtype (bfloat16
    too), not per-example gradients."""
    base = tiny_gpt(0).to(dtype)  # the same weights on every rank (DDP would broadcast them anyway)
    local = copy.deepcopy(base)
    # small buckets, so that the stats must be summed over several of them
    hooked = DDP(copy.deepcopy(base), broadcast_buffers=False, bucket_cap_mb=0.002)
    plain = DDP(copy.deepcopy(base), broadcast_buffers=False, bucket_cap_mb=0.002)
    hook = ddpgns.DDPGradientStatsHook(hooked)
    steps = []
    for step, scale in enumerate(LOSS_SCALES):
        for micro_step in range(MICRO_STEPS):
            g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro_step)
            x = torch.randint(0, 32, (MICRO_BATCH, 8), generator=g)
            y = torch.randint(0, 32, (MICRO_BATCH, 8), generator=g)
            for m in (hooked, plain, local):
                if m is not local:
                    m.require_backward_grad_sync = micro_step == MICRO_STEPS - 1
                _, loss = m(x, y)
                (loss / MICRO_STEPS * scale).backward()
            if micro_step == 0:
                buckets_after_no_sync = len(hook.local_sq)  # the hook must not have fired yet
        n_buckets = len(hook.local_sq)
        recorded = dict(hook.local_sq), dict(hook.averaged_sq)
        sq_small, sq_big = hook.get_sq_norms(loss_scale=scale)
        # the same step again through get_stats(), the reference's one-float form
        hook.local_sq.update(recorded[0])
        hook.averaged_sq.update(recorded[1])
        stats = hook.get_stats(loss_scale=scale)
        try:  # a second call in the same step has nothing new to report
            hook.get_stats()
            second_call_raises = False
        except RuntimeError:
            second_call_raises = True
        local_grads = [p.grad for p in local.parameters()]
        # the average DDP should produce, done by hand with one all_reduce per parameter
        averaged = [g.clone() for g in local_grads]
        for g in averaged:
            dist.all_reduce(g)
            g.div_(world)
        hooked_grads = [p.grad for p in hooked.parameters()]
        plain_grads = [p.grad for p in plain.parameters()]
        steps.append(dict(
            n_buckets=n_buckets, buckets_after_no_sync=buckets_after_no_sync,
            second_call_raises=second_call_raises,
            sq_small=sq_small, sq_big=sq_big, stats=stats, stats_type=type(stats).__name__,
            local_sq=sq_norm(local_grads) / scale ** 2,
            averaged_sq=sq_norm(averaged) / scale ** 2,
            hooked_grad_sq=sq_norm(hooked_grads) / scale ** 2,
            max_diff_hooked_plain=max(float((a - b).abs().max()) for a, b in zip(hooked_grads, plain_grads)),
            max_diff_hooked_by_hand=max(float((a - b).abs().max()) for a, b in zip(hooked_grads, averaged)),
        ))
        for m in (hooked, plain, local):
            m.zero_grad(set_to_none=True)
    return steps


def buffers_allreduce(rank, world):
    """Fill the per-example-norm buffers of a small MLP the way the layers would, from brute-force
    per-example gradients of this rank's batch, then make them global."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    for layer in (mlp[0], mlp[2]):
        register_sqgradnorm_buffers(layer)
    batch = 4  # the same on every rank, as in train.py; the data differ
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(batch, 5, generator=g), torch.randn(batch, 3, generator=g)
    per_example = per_example_grads(mlp, lambda forward, xb, yb: (forward(xb) - yb).pow(2).sum(), x, y)
    example_sq = {n: sq.tolist() for n, sq in example_sqnorms(per_example).items()}  # ||g_b||^2
    for layer, prefix in ((mlp[0], '0.'), (mlp[2], '2.')):
        for pname in ('weight', 'bias'):
            # what a layer sees on this rank: g_b / B_rank, squared and summed over the batch
            getattr(layer, f'{pname}_sqgradnorm').fill_(sum(example_sq[prefix + pname]) / batch ** 2)
        layer.example_count.fill_(batch)
    before = {n: float(b) for n, b in mlp.named_buffers()}
    calls = []
    all_reduce = dist.all_reduce
    dist.all_reduce = lambda *a, **k: (calls.append(1), all_reduce(*a, **k))[1]
    try:
        ddpgns.allreduce_sqgradnorm_buffers(mlp)
    finally:
        dist.all_reduce = all_reduce
    return dict(batch=batch, example_sq=example_sq, before=before,
                after={n: float(b) for n, b in mlp.named_buffers()}, collectives=len(calls))


def known_noise_scale(rank, world, steps=400, batch=8, dim=4, noise=1.0):
    """Linear regression at fixed weights w, x ~ N(0, I), y = w*.x + noise * eps, per-example
    loss (w.x - y)^2 / 2: with d = w - w*, the true gradient is d and the per-example covariance
    has trace (dim + 1)|d|^2 + dim * noise^2 (Isserlis), so the GNS is known in closed form."""
    torch.manual_seed(0)
    lin = nn.Linear(dim, 1, bias=False, dtype=torch.float64)
    w_star = lin.weight.detach().clone() - torch.tensor([[1.0, 0.5, 0.0, 0.0]], dtype=torch.float64)
    model = DDP(lin, broadcast_buffers=False)
    hook = ddpgns.DDPGradientStatsHook(model)
    gns = ddpgns.GradientNoiseScale(beta=0.999)
    g = torch.Generator().manual_seed(100 + rank)
    raw = []
    for _ in range(steps):
        x = torch.randn(batch, dim, generator=g, dtype=torch.float64)
        y = x @ w_star.T + noise * torch.randn(batch, 1, generator=g, dtype=torch.float64)
        loss = 0.5 * (model(x) - y).pow(2).mean()
        loss.backward()
        sq_small, sq_big = hook.get_sq_norms()
        gns.update(sq_small, sq_big, batch, world * batch)
        raw.append((sq_small, sq_big))
        model.zero_grad(set_to_none=True)
    d = (lin.weight - w_star).detach()
    true_gtg = float(d.pow(2).sum())
    true_trsigma = (dim + 1) * true_gtg + dim * noise ** 2
    gtg, trsigma = gns.get_stats()
    return dict(raw=raw, batch=batch, beta=gns.beta, gtg=gtg, trsigma=trsigma, gns=gns.get_gns(),
                true_gtg=true_gtg, true_trsigma=true_trsigma, state=gns.state_dict(),
                log=ddpgns.ddp_gns_log(gns, *raw[-1], batch, world * batch))


def interface_batch(step, micro_step, rank):
    """Rank `rank`'s micro-batch: the test builds one process's global batch from the same calls."""
    g = torch.Generator().manual_seed(1000 * step + 10 * micro_step + rank)
    return torch.randint(0, 32, (MICRO_BATCH, 8), generator=g), torch.randint(0, 32, (MICRO_BATCH, 8), generator=g)


INTERFACE_STEPS = 2


def every_estimator(rank, world):
    """train.py's loop through gnstracking's interface: a measuring GPT under DDP with the Linear
    hooks, the micro-batch estimator and a GradScaler, each step's columns and status lines."""
    raw = tiny_gpt(0, **MEASURED)  # every layer measures; the same weights on every rank
    model = DDP(raw, broadcast_buffers=False)
    estimators = gnstracking.estimators_for(raw, ddp_model=model, world_size=world, hooks='exact', microbatch=True)
    scaler = torch.amp.GradScaler('cpu', init_scale=2.0 ** 10)
    optimizer = torch.optim.SGD(raw.parameters(), lr=0.1)
    steps = []
    for step in range(INTERFACE_STEPS):
        for micro_step in range(MICRO_STEPS):
            model.require_backward_grad_sync = micro_step == MICRO_STEPS - 1
            _, loss = model(*interface_batch(step, micro_step, rank))
            scaler.scale(loss / MICRO_STEPS).backward()
        row = gnstracking.measure_all(estimators, step, MICRO_STEPS * MICRO_BATCH * world, scaler)
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        gnstracking.reset_all(estimators)
        steps.append(dict(row=row, status=[e.status() for e in estimators], line=gnstracking.status_line(estimators)))
    states = {}
    gnstracking.save_states(estimators, states)
    return dict(names=[e.name for e in estimators], steps=steps, states=states[gnstracking.CHECKPOINT_KEY],
                methods=linear_norm_methods(raw))


def rank_zero_methods_win(rank, world):
    """Each rank's Linears start from methods of their own (as if each had restored others):
    after the exact estimator's first measure() every rank holds rank 0's, from one broadcast; the
    second step broadcasts nothing."""
    raw = tiny_gpt(0, **MEASURED)
    model = DDP(raw, broadcast_buffers=False)
    names = [name for name, _ in measured_linears(raw)]
    own = {name: NORM_METHODS[(i + rank) % 2] for i, name in enumerate(names)}  # rank 1: each the other one
    set_linear_norm_methods(raw, own)
    estimators = gnstracking.estimators_for(raw, world_size=world, ddp_model=model)
    calls = []
    broadcast = dist.broadcast
    dist.broadcast = lambda *a, **k: (calls.append(1), broadcast(*a, **k))[1]
    try:
        optimizer = torch.optim.SGD(raw.parameters(), lr=0.1)
        interface_steps(model, raw, estimators, optimizer, 2,
                        lambda m, step, micro_step: m(*interface_batch(step, micro_step, rank))[1], "train/gns/")
    finally:
        dist.broadcast = broadcast
    return dict(own=own, after=linear_norm_methods(raw), broadcasts=len(calls))


def hf_batch(step, micro_step, rank):
    """Rank `rank`'s micro-batch of token ids for the Hugging Face GPT-2 (the test concatenates the ranks')."""
    g = torch.Generator().manual_seed(2000 * step + 10 * micro_step + rank)
    return torch.randint(0, 97, (MICRO_BATCH, 8), generator=g)


def interface_steps(model, raw, estimators, optimizer, steps, loss_of, prefix):
    """train.py's step through gnstracking's interface, `steps` times: MICRO_STEPS micro-steps of
    loss_of(model, step, micro_step) (DDP's gradient sync on the last only), measure_all, the
    optimizer's step, reset_all; returns each step's columns that start with `prefix`."""
    rows = []
    for step in range(steps):
        for micro_step in range(MICRO_STEPS):
            if model is not raw:  # DDP; FSDP2 shards the module itself
                model.require_backward_grad_sync = micro_step == MICRO_STEPS - 1
            (loss_of(model, step, micro_step) / MICRO_STEPS).backward()
        row = gnstracking.measure_all(estimators, step, MICRO_STEPS * MICRO_BATCH * dist.get_world_size(), None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        gnstracking.reset_all(estimators)
        rows.append({k: v for k, v in row.items() if k.startswith(prefix)})
    return rows


def hf_loss(rank):
    def loss_of(model, step, micro_step):
        x = hf_batch(step, micro_step, rank)
        return model(input_ids=x, labels=x).loss
    return loss_of


def measured_hf_gpt2(rank, world):
    """A Hugging Face GPT-2 put through buffered.measure, under DDP, through gnstracking's
    interface: each step's exact-estimator columns (the buffers summed over the ranks)."""
    try:
        raw = measure(tiny_hf("gpt2").train())
    except ImportError:  # transformers is a test dependency: without it there is nothing to compare
        return None
    model = DDP(raw, broadcast_buffers=False)
    estimators = gnstracking.estimators_for(raw, ddp_model=model, world_size=world)
    optimizer = torch.optim.SGD(raw.parameters(), lr=0.1)
    rows = interface_steps(model, raw, estimators, optimizer, INTERFACE_STEPS, hf_loss(rank), "train/gns/")
    return dict(rows=rows, line=gnstracking.status_line(estimators[:1]))


def fsdp_hf_gpt2(rank, world):
    """measured_hf_gpt2's model and steps with the model sharded by FSDP2 (fully_shard on each block,
    then the root, which keeps the tied wte = lm_head) instead of DDP's replicas."""
    try:
        raw = measure(tiny_hf("gpt2").train())
    except ImportError:
        return None
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (world,))
    for block in raw.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(raw, mesh=mesh)
    estimators = gnstracking.estimators_for(raw, world_size=world, fsdp=True)
    optimizer = torch.optim.SGD(raw.parameters(), lr=0.1)
    return dict(rows=interface_steps(raw, raw, estimators, optimizer, INTERFACE_STEPS, hf_loss(rank), "train/gns/"))


ADAM_STEPS = 3  # the first has no optimizer state: two measured steps


def adam_preconditioned(rank, world):
    """The Adam-preconditioned GNS (nanogns/estimators/adam.py) of a measuring GPT's LayerNorms under DDP: its
    per-coordinate sums summed over the ranks, P from AdamW's replicated state; each step's columns."""
    raw = tiny_gpt(0, **MEASURED)
    model = DDP(raw, broadcast_buffers=False)
    optimizer = torch.optim.AdamW(raw.parameters(), lr=1e-2)
    estimators = gnstracking.estimators_for(raw, ddp_model=model, world_size=world, adam_optimizer=optimizer)
    return interface_steps(model, raw, estimators, optimizer, ADAM_STEPS,
                             lambda m, step, micro_step: m(*interface_batch(step, micro_step, rank))[1],
                             "train/adam_gns/")


def main():
    out_dir = sys.argv[1]
    # train.py keeps broadcast_buffers=False (rank-local per-example buffers); so do we
    warnings.filterwarnings('ignore', message='`broadcast_buffers` is deprecated')
    dist.init_process_group('gloo')
    rank, world = dist.get_rank(), dist.get_world_size()
    result = dict(rank=rank, world=world,
                  float32=hook_vs_brute_force(rank, world, torch.float32),
                  bfloat16=hook_vs_brute_force(rank, world, torch.bfloat16),
                  buffers=buffers_allreduce(rank, world),
                  known=known_noise_scale(rank, world),
                  interface=every_estimator(rank, world),
                  methods=rank_zero_methods_win(rank, world),
                  hf=measured_hf_gpt2(rank, world),
                  adam=adam_preconditioned(rank, world),
                  hf_fsdp=fsdp_hf_gpt2(rank, world))
    with open(os.path.join(out_dir, f'rank{rank}.json'), 'w') as f:
        json.dump(result, f)
    dist.barrier()  # leave together, and as train.py's ranks do (stopping.leave says why)
    dist.destroy_process_group()
    leave(0, distributed=True)


if __name__ == '__main__':
    main()
