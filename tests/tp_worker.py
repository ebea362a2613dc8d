"""
Worker for tests/test_tensor_parallel.py: a small MLP block (a normalisation, a ColwiseParallel Linear,
GELU, a RowwiseParallel Linear, biases on) measured with nanogns.measure() and then sharded by torch's
parallelize_module over CPU ranks (gloo),
    python -m torch.distributed.run --standalone --nproc_per_node=N tests/tp_worker.py
Every configuration below runs one optimizer step of two micro-steps through ExactGNS and compares
each parameter's |G_1|^2 = (1/B) sum_b ||g_b||^2 and |G_B|^2 with the unsharded model's in one process,
from one backward per example. Configurations: tensor parallelism (the normalisation outside it), sequence
parallelism (the normalisation under SequenceParallel, tokens split over the ranks: a LayerNorm and an
RMSNorm; "sp-out": the output reduce-scattered onto the sequence again, each rank's loss its tokens' part),
with both Linear classes; with 4 ranks also FSDP2 over 2 data-parallel ranks x 2 TP ranks.
The last configuration runs once more through GNSMeter (told the data-parallel ranks and their group),
and "sp-out" with the fused normalisations (torch's normalisation for a DTensor, measured as separated).
Then context parallelism (plain tensors, each example's tokens split over the ranks; with 4 processes
2 data-parallel x 2 cp ranks): the normalisations measured through split_tokens, a measured Linear refused.
Prints one "ok <configuration>" line per configuration on rank 0; raises on any mismatch.
"""
import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

import nanogns
from nanogns.estimators.exact import ExactGNS
from nanogns.maths import parse_column
from nanogns.meter import GNSMeter

B, T, D, H = 4, 8, 8, 16  # examples per micro-step, tokens, width, hidden width (all divisible by 4)
MICRO = 2
RTOL = 1e-5


class Block(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.norm = nn.LayerNorm(D) if norm == "layernorm" else nn.RMSNorm(D)
        self.fc = nn.Linear(D, H)
        self.proj = nn.Linear(H, D)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(self.norm(x))))


def example_losses(out, target):
    """l_b, each example's loss: the mean over its tokens and features."""
    return (out - target).square().mean((1, 2))


def reference(model, xs, targets):
    """{name: ((1/B) sum_b ||g_b||^2, |G_B|^2)} of the loss (1/MICRO) sum_micro mean_b l_b, from one
    backward per example of the unsharded model."""
    n = MICRO * B
    per_example = {name: 0.0 for name, _ in model.named_parameters()}
    total = {name: torch.zeros_like(p, dtype=torch.float64) for name, p in model.named_parameters()}
    for x, target in zip(xs, targets):
        for b in range(B):
            model.zero_grad()
            example_losses(model(x[b:b + 1]), target[b:b + 1]).sum().backward()
            for name, p in model.named_parameters():
                g = p.grad.double()
                per_example[name] += g.square().sum().item()
                total[name] += g / n
    return {name: (per_example[name] / n, total[name].square().sum().item()) for name in per_example}


def measured_step(model, xs, targets, estimator, shard_tokens, rank_examples, split_output, reduce=None,
                  loss_scale=1):
    """One step of MICRO micro-steps on this rank's part of the batch; the ExactGNS row. split_output:
    the output is this rank's slice of the sequence too, and the loss this rank's part of the mean (times
    loss_scale). reduce: what reduces the gradients after the last backward, if anything."""
    for x, target in zip(xs, targets):
        x, target = x[rank_examples], target[rank_examples]
        if shard_tokens is not None:  # sequence parallelism: the ranks hold the sequence's slices
            x = x.chunk(shard_tokens[1], dim=1)[shard_tokens[0]].contiguous()
        if split_output:
            target = target.chunk(shard_tokens[1], dim=1)[shard_tokens[0]]
            loss = loss_scale * ((model(x) - target).square().sum((1, 2)) / (T * D)).mean() / MICRO
        else:
            loss = example_losses(model(x), target).mean() / MICRO
        loss.backward()
    if reduce is not None:
        reduce()
    return estimator.measure(0, MICRO * B, None)


def check(row, want, where):
    """The row's (1/B) sum_b ||g_b||^2 and |G_B|^2 of each parameter against want's, within RTOL."""
    got = {}
    for col, value in row.items():
        parsed = parse_column(col)
        if parsed is not None and parsed[2] in ("norm", "pegn"):
            got.setdefault(parsed[1], {})[parsed[2]] = value
    assert set(got) == set(want), (sorted(got), sorted(want))
    for name, (small, big) in want.items():
        for kind, expected in (("pegn", small), ("norm", big)):
            measured = got[name][kind] ** 2
            assert abs(measured - expected) <= RTOL * abs(expected), \
                f"{where}: {name} {kind}^2 {measured!r} != {expected!r}"


def run(config, linear, norm, rank, world, meter=False, norm_class="shim"):
    torch.manual_seed(0)
    plain = Block(norm)
    with torch.no_grad():  # gains and biases away from their inits, so that every norm is a real test
        for p in plain.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model = nanogns.measure(copy.deepcopy(plain), linear=linear, norm=norm_class)
    xs = [torch.randn(B, T, D) for _ in range(MICRO)]
    targets = [torch.randn(B, T, D) for _ in range(MICRO)]
    want = reference(plain, xs, targets)

    dp, tp = (2, world // 2) if config == "fsdp-tp" else (1, world)
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    plan = {"fc": ColwiseParallel(), "proj": RowwiseParallel()}
    if config in ("sp", "sp-out"):  # sp-out: the output too split on the sequence (reduce-scattered)
        plan = {"norm": SequenceParallel(), "fc": ColwiseParallel(input_layouts=Shard(1)),
                "proj": RowwiseParallel(output_layouts=Shard(1) if config == "sp-out" else None)}
    parallelize_module(model, mesh["tp"], plan)
    group = None
    if config == "fsdp-tp":
        from torch.distributed.fsdp import fully_shard
        fully_shard(model, mesh=mesh["dp"])
        group = mesh["dp"].get_group()
    if meter:  # the user-facing loop's meter, told the data-parallel ranks
        estimator = GNSMeter(model, world_size=dp, group=group)
        estimator.measure = lambda step, examples, scaler: estimator.step(examples=examples)
    else:
        estimator = ExactGNS(model, world_size=dp, group=group)
    dp_rank = mesh["dp"].get_local_rank()
    share = B // dp
    rank_examples = slice(dp_rank * share, (dp_rank + 1) * share)
    shard_tokens = (mesh["tp"].get_local_rank(), tp) if config.startswith("sp") else None
    row = measured_step(model, xs, targets, estimator, shard_tokens, rank_examples, config == "sp-out")

    check(row, want, f"{config} {linear} {norm} rank {rank}")
    # the Linears chose their method from the shapes alone (global ones): every rank the same
    methods = [layer.norm_method for layer in (model.fc, model.proj)]
    gathered = [None] * world
    dist.all_gather_object(gathered, methods)
    assert all(m == gathered[0] for m in gathered), gathered
    if meter:
        estimator.close()
    if rank == 0:
        extra = (" meter" if meter else "") + (f" {norm_class}" if norm_class != "shim" else "")
        print(f"ok {config} {linear} {norm}{extra} methods={methods}", flush=True)


def context_parallel(norm, rank, world, norm_class="shim", average=False):
    """Context parallelism: each example's tokens split over the cp ranks (with 4 processes, 2 data-parallel
    x 2 cp), the normalisation measured (split_tokens), the Linears not (they are refused); the gradients
    summed over the cp ranks and averaged over the data-parallel ones. average: each rank's loss is cp times
    its share and the gradients are averaged over dp x cp, as OLMo-core's context parallelism does."""
    torch.manual_seed(0)
    plain = Block(norm)
    with torch.no_grad():
        for p in plain.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model = nanogns.measure(copy.deepcopy(plain), linear=None, norm=norm_class)
    xs = [torch.randn(B, T, D) for _ in range(MICRO)]
    targets = [torch.randn(B, T, D) for _ in range(MICRO)]
    want = {name: v for name, v in reference(plain, xs, targets).items() if name.startswith("norm.")}
    dp = 2 if world == 4 else 1
    mesh = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "cp"))
    cp = world // dp
    assert nanogns.split_tokens(model, mesh["cp"].get_group(), average=average) == 1
    estimator = ExactGNS(model, world_size=dp, group=mesh["dp"].get_group())

    def reduce():
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dp * cp if average else dp

    dp_rank, share = mesh["dp"].get_local_rank(), B // dp
    row = measured_step(model, xs, targets, estimator, (mesh["cp"].get_local_rank(), cp),
                        slice(dp_rank * share, (dp_rank + 1) * share), True, reduce, cp if average else 1)
    check(row, want, f"cp {norm} {norm_class} rank {rank}")
    if rank == 0:
        print(f"ok cp {norm} {norm_class}{' average' if average else ''}", flush=True)
    try:  # a measured Linear under context parallelism: refused in one line
        nanogns.split_tokens(nanogns.measure(Block(norm)), mesh["cp"].get_group())
    except ValueError as e:
        assert "fc (PEGradNormLinear) is measured" in str(e) and "\n" not in str(e), str(e)
    else:
        raise AssertionError("split_tokens took a measured Linear")


def embedding_parallel(style, embedding, rank, world):
    """A measured Embedding (13 rows, padding_idx 3: an uneven vocabulary split, a padding id among the ids)
    whose weight parallelize_module shards over the vocabulary (RowwiseParallel) or the features
    (ColwiseParallel), then a LayerNorm; each parameter's norms as one process measures them."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Embedding(13, D, padding_idx=3), nn.LayerNorm(D))
    model = nanogns.measure(copy.deepcopy(plain), embedding=embedding)
    xs = [torch.randint(0, 13, (B, T)) for _ in range(MICRO)]
    xs[0][0, :3] = 3
    targets = [torch.randn(B, T, D) for _ in range(MICRO)]
    want = reference(plain, xs, targets)
    mesh = init_device_mesh("cpu", (world,))
    plan = (RowwiseParallel(input_layouts=Replicate()) if style == "rowwise" else
            ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
    parallelize_module(model, mesh, {"0": plan})
    row = measured_step(model, xs, targets, ExactGNS(model, world_size=1), None, slice(0, B), False)
    check(row, want, f"embedding {style} {embedding} rank {rank}")
    if rank == 0:
        print(f"ok embedding {style} {embedding}", flush=True)


def refusals(rank):
    """What is not measured says so in one line: a Linear whose tokens are split over the ranks (its
    parameters replicated under SequenceParallel)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    cases = [(nanogns.measure(nn.Sequential(nn.Linear(D, D)), linear=linear), "other ranks' tokens")
             for linear in ("gns", "shim")]
    for model, words in cases:
        parallelize_module(model, mesh, {"0": SequenceParallel()})
        try:
            model(torch.randn(B, T // dist.get_world_size(), D)).to_local().sum().backward()
        except RuntimeError as e:
            assert words in str(e) and "\n" not in str(e), str(e)
        else:
            raise AssertionError(f"{model} under SequenceParallel was not refused")
    if rank == 0:
        print("ok refusals", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    configs = [("tp", "gns", "layernorm"), ("tp", "shim", "layernorm"), ("sp", "gns", "layernorm"),
               ("sp", "shim", "rmsnorm"), ("sp-out", "gns", "layernorm")]
    if world == 4:
        configs += [("fsdp-tp", "gns", "layernorm"), ("fsdp-tp", "shim", "rmsnorm")]
    for config in configs:
        run(*config, rank, world)
    run(configs[-1][0], "gns", "layernorm", rank, world, meter=True)
    for norm in ("layernorm", "rmsnorm"):  # the fused classes, which hand a DTensor to torch's normalisation
        run("sp-out", "shim", norm, rank, world, norm_class="fused")
    refusals(rank)
    for style, embedding in (("rowwise", "gns"), ("rowwise", "shim"), ("colwise", "gns")):
        embedding_parallel(style, embedding, rank, world)
    for norm, norm_class in (("layernorm", "shim"), ("rmsnorm", "shim"), ("layernorm", "fused")):
        context_parallel(norm, rank, world, norm_class)
    context_parallel("rmsnorm", rank, world, average=True)
    dist.barrier()
    dist.destroy_process_group()
