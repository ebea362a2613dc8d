"""
train.py with a known GNS for the batch-size controller's tests:

    python tests/synthetic_gns_train.py RECORD_DIR [train.py flags ...]
    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/synthetic_gns_train.py RECORD_DIR ...

The live GNS the controller reads is replaced by one that grows with the tokens the model has
seen, GNS = 1 + tokens / SYNTHETIC_GNS_TOKENS (default 100); rank r adds r * SYNTHETIC_GNS_SKEW
(default 0), so that ranks disagree unless the decision is rank 0's. How many steps the EMA has
averaged stays the real estimator's (the warm-up is real). Every rank appends "tokens steps" (its
accumulation steps per rank for the step starting at tokens) to RECORD_DIR/rank{r}.txt, after
sleeping SYNTHETIC_GNS_SLEEP seconds (default 0: a test that signals the run mid-way slows it).
"""
import os
import runpy
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import nanogns.estimators.exact as gnstracking  # noqa: E402
import nanogns.schedules as schedules  # noqa: E402

record_dir, sys.argv = sys.argv[1], [os.path.join(REPO, "train.py"), *sys.argv[2:]]
rank = int(os.environ.get("RANK", 0))
real_live_gns, real_steps_at = gnstracking.live_gns, schedules.GNSBatchController.steps_at


def synthetic_live_gns(estimators, group="total"):
    tokens = int(estimators[0].model.tokens_processed)
    _, averaged = real_live_gns(estimators, group)
    skew = rank * float(os.environ.get("SYNTHETIC_GNS_SKEW", 0))
    return 1 + tokens / float(os.environ.get("SYNTHETIC_GNS_TOKENS", 100)) + skew, averaged


def recorded_steps_at(self, tokens, world_size=1):
    steps = real_steps_at(self, tokens, world_size)
    time.sleep(float(os.environ.get("SYNTHETIC_GNS_SLEEP", 0)))
    with open(os.path.join(record_dir, f"rank{rank}.txt"), "a") as f:
        f.write(f"{tokens} {steps}\n")
    return steps


gnstracking.live_gns = synthetic_live_gns
schedules.GNSBatchController.steps_at = recorded_steps_at
runpy.run_path(sys.argv[0], run_name="__main__")
