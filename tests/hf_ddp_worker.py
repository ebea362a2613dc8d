"""
Worker for tests/test_hf.py: the Hugging Face Trainer with GNSCallback on two CPU ranks (gloo),
    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/hf_ddp_worker.py ROWS.pt OUT_DIR
each rank taking half of every micro-batch of test_hf's single-process run; rank 0 writes OUT_DIR/log.csv.
"""
import sys

import torch

from test_hf import ACCUMULATION, BATCH, STEPS, trainer
from nanogns.hf import GNSCallback
import nanogns.layers.linear as linear_module
from nanogns.stopping import leave

linear_module._MeasuredLinear.per_example_mode = "shapes"  # as the tests it is compared with (gns_fixtures.shapes_rule)

torch.set_num_threads(1)
rows_path, out_dir = sys.argv[1:3]
world_size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 2
hf = trainer(out_dir, torch.load(rows_path), GNSCallback(), batch=BATCH // 2, ddp_backend="gloo")
assert hf.args.world_size == 2, hf.args.world_size
hf.train()

# leave as train.py's ranks do (stopping.leave says why): gloo's threads can abort an interpreter that
# finalises normally ("terminate called without an active exception"), now and then
if torch.distributed.is_initialized():
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
leave(0, distributed=True)
