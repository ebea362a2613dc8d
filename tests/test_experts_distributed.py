"""The MoE GPT under torchrun on CPU with gloo, DDP and FSDP2 (which shards each experts weight over its
experts' dimension): 2 ranks x 2 examples log what 1 process x 4 examples logs, every expert's columns and
the examples that reached it included. Without the load-balancing loss: it is a function of each
micro-batch's tokens, so ranks holding other micro-batches than one process train another loss."""
import pandas as pd
import pytest

from conftest import TINY, made_once, run_train

ONE, TWO = ["--batch_size=4", "--gradient_accumulation_steps=2"], ["--batch_size=2", "--gradient_accumulation_steps=4"]
MOE = ["--n_expert=4", "--n_expert_active=2", "--linearclass=gns", "--embeddingclass=gns", "--lnclass=shim",
       "--per_example_mode=shapes"]


@pytest.fixture(scope="module")
def moe_runs(tiny_dataset, tmp_path_factory):
    common = [*TINY, f"--dataset={tiny_dataset}", "--max_iters=3", "--eval_interval=100", "--backend=gloo", *MOE]

    def make(d):
        run_train(*common, f"--out_dir={d / 'one'}", *ONE)
        run_train(*common, f"--out_dir={d / 'ddp'}", *TWO, torchrun_procs=2)
        run_train(*common, f"--out_dir={d / 'fsdp'}", *TWO, "--fsdp=True", torchrun_procs=2)
    d = made_once(tmp_path_factory, "moe_distributed", make)
    return {name: pd.read_csv(d / name / "log.csv") for name in ("one", "ddp", "fsdp")}


@pytest.mark.slow
@pytest.mark.parametrize("run", ["ddp", "fsdp"])
def test_moe_gns_under_ddp_and_fsdp_is_one_process_s(moe_runs, run):
    one, two = moe_runs["one"], moe_runs[run]
    cols = [c for c in one.columns if c.startswith("train/gns/")]
    experts = [c for c in cols if "experts" in c]
    assert len(experts) == 2 * (2 * 4 * 3 + 4)  # 2 layers: 2 weights x 4 experts x 3 cells, 4 reached
    assert set(cols) <= set(two.columns)
    assert (two["train/gns/transformer.h.1.mlp.experts.c_fc[3]/batch_size"] == 8).all()
    # (train/loss is rank 0's last micro-batch's under DDP, the global batch's under FSDP)
    for c in cols + ["grad_norm"] + (["train/loss"] if run == "fsdp" else []):
        assert two[c].to_numpy() == pytest.approx(one[c].to_numpy(), rel=1e-5, nan_ok=True), c
