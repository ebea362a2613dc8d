"""
Worker for tests/test_meter.py: our own loop with GNSMeter on a GPT sharded with FSDP2 over two CPU
ranks (gloo), each rank taking half of every micro-batch,
    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/meter_fsdp_worker.py ROWS.pt OUT_DIR
or, with a third argument `ddp`, wrapped in DistributedDataParallel as its users wrap it (broadcast_buffers
left at its default, True); and, without torchrun, the same loop in one process on whole micro-batches.
Rank 0 writes OUT_DIR/log.csv.
"""
import sys

import torch

from nanogns.meter import GNSMeter
import nanogns.layers.linear as linear_module
from model import GPT, GPTConfig, fully_shard_gpt
from nanogns.stopping import leave

linear_module._MeasuredLinear.per_example_mode = "shapes"  # as the tests it is compared with (gns_fixtures.shapes_rule)

ACCUMULATION, BATCH = 2, 4  # micro-steps per optimizer step, examples per micro-batch over all ranks


def train(rows, out_dir, rank=0, world_size=1, wrap="fsdp"):
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32, dropout=0.0))
    meter = GNSMeter(model, out_dir=out_dir)  # measured first, then sharded or wrapped
    if world_size > 1 and wrap == "fsdp":
        fully_shard_gpt(model, "cpu", world_size)
    elif world_size > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)  # broadcast_buffers=True, its default
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    share = BATCH // world_size
    for step in range(len(rows) // (BATCH * ACCUMULATION)):
        for micro in range(ACCUMULATION):
            start = (step * ACCUMULATION + micro) * BATCH + rank * share
            mine = rows[start:start + share]
            x, y = mine[:, :-1].contiguous(), mine[:, 1:].contiguous()
            _, loss = model(x, y)
            (loss / ACCUMULATION).backward()
        meter.step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    meter.close()


if __name__ == "__main__":
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    train(torch.load(sys.argv[1]), sys.argv[2], torch.distributed.get_rank(), torch.distributed.get_world_size(),
          *sys.argv[3:])
    torch.distributed.barrier()  # leave together, as train.py's ranks do (stopping.leave says why)
    torch.distributed.destroy_process_group()
    leave(0, distributed=True)
