"""
Worker for tests/test_lightning.py: Lightning's Trainer with GNSCallback on two CPU ranks (gloo)
under torchrun,
    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/lightning_ddp_worker.py ROWS.pt OUT_DIR
each rank taking its half of every micro-batch of test_lightning's single-process fit (dealt out
here, with Lightning's own sampler off); rank 0 writes OUT_DIR/log.csv.
"""
import sys

import os

import lightning
import torch

from nanogns.lightning import GNSCallback
import nanogns.layers.linear as linear_module
from nanogns.stopping import leave
from test_lightning import ACCUMULATION, BATCH, MAX_GRAD_NORM, STEPS, CausalLM

linear_module._MeasuredLinear.per_example_mode = "shapes"  # as the tests it is compared with (gns_fixtures.shapes_rule)

torch.set_num_threads(1)
rows_path, out_dir = sys.argv[1:3]
trainer = lightning.Trainer(
    default_root_dir=out_dir, max_steps=STEPS, accumulate_grad_batches=ACCUMULATION, gradient_clip_val=MAX_GRAD_NORM,
    accelerator="cpu", devices=2, strategy="ddp", logger=False, enable_checkpointing=False, enable_progress_bar=False,
    enable_model_summary=False, use_distributed_sampler=False, callbacks=[GNSCallback()])
rows, rank, share = torch.load(rows_path), int(os.environ["RANK"]), BATCH // 2
mine = torch.cat([rows[start + rank * share:start + (rank + 1) * share] for start in range(0, len(rows), BATCH)])
trainer.fit(CausalLM(), torch.utils.data.DataLoader(mine, batch_size=share, shuffle=False))

# leave as train.py's ranks do (stopping.leave says why): gloo's threads can abort an interpreter that
# finalises normally ("terminate called without an active exception"), now and then
if torch.distributed.is_initialized():
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
leave(0, distributed=True)
