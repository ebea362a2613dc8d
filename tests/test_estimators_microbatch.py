"""nanogns/estimators/microbatch.py against brute force: each micro-batch's gradient, the mean of its examples' own."""
import copy
import math
import time

import pytest
import torch

from gns_fixtures import one_thread  # noqa: F401  (an autouse fixture)
from gns_fixtures import gpt_batches, gpt_loss, per_example_grads, tiny_gpt
from nanogns.estimators.microbatch import MicrobatchGNS
from nanogns.stopping import leave


def direct(model, batches):
    """Per parameter: (mean_k ||g_k||^2, ||mean_k g_k||), g_k the micro-batch k's mean gradient,
    the mean of its examples' gradients by the shared oracle."""
    grads = [{n: g.double().mean(0) for n, g in per_example_grads(model, gpt_loss, X, Y).items()} for X, Y in batches]
    return {n: (sum(g[n].square().sum() for g in grads).item() / len(grads),
                (sum(g[n] for g in grads) / len(grads)).norm().item()) for n in grads[0]}


def accumulate(model, batches, scaler=None):
    for X, Y in batches:
        loss = model(X, Y)[1] / len(batches)
        (scaler.scale(loss) if scaler is not None else loss).backward()


def test_matches_separate_backward_per_micro_batch():
    model = tiny_gpt()
    oracle = copy.deepcopy(model)
    mb = MicrobatchGNS(model)
    m, b = 3, 2
    batches = gpt_batches(m, b)
    accumulate(model, batches)

    want = direct(oracle, batches)
    # the tied wte/lm_head weight is measured, once, under its first name; hooks fire once per backward
    assert [n for n, _, _ in mb.results()] == [n for n, _ in model.named_parameters()]
    assert 'transformer.wte.weight' in want and 'lm_head.weight' not in want
    assert all(k == m for _, _, k in mb.results())
    for name, sqsum, _ in mb.results():  # raw sums: sum_k ||g_k / m||^2
        assert sqsum.item() == pytest.approx(want[name][0] * m / m ** 2, rel=1e-5), name
    logged = mb.measurements(micro_batch_size=b)
    assert len(logged) == 4 * len(want)
    for name, (small_sq, big) in want.items():
        key = f"train/microbatch_gns/{name}"
        assert logged[f"{key}/pegn"] == pytest.approx(math.sqrt(small_sq), rel=1e-5)
        assert logged[f"{key}/norm"] == pytest.approx(big, rel=1e-5)
        assert logged[f"{key}/batch_size"] == m * b
        assert logged[f"{key}/small_batch_size"] == b

    mb.zero()
    assert mb.measurements(micro_batch_size=b) == {}
    mb.remove()
    accumulate(model, batches)
    assert mb.results() == []


def test_grad_scaler_scale_is_divided_out():
    """A float32 GradScaler at 65536 (only the scale matters here) gives the unscaled numbers."""
    model, reference = tiny_gpt(), tiny_gpt()
    mb, mb_ref = MicrobatchGNS(model), MicrobatchGNS(reference)
    batches = gpt_batches(2, 3)
    scaler = torch.amp.GradScaler('cpu', init_scale=65536.0)
    accumulate(model, batches, scaler)
    accumulate(reference, batches)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler.unscale_(opt)
    got = mb.measurements(3, loss_scale=scaler.get_scale())
    want = mb_ref.measurements(3)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-4), k


def test_gpt_loop_with_accumulation_all_finite():
    model = tiny_gpt()
    mb = MicrobatchGNS(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = gpt_batches(6, 4)
    for step in range(3):
        accumulate(model, batches[2 * step:2 * step + 2])
        logged = mb.measurements(micro_batch_size=4)
        assert logged and all(math.isfinite(v) for v in logged.values())
        assert {v for k, v in logged.items() if k.endswith('/batch_size') and 'small' not in k} == {8}
        assert all(k == 2 for _, _, k in mb.results())  # zeroed between steps
        opt.step()
        opt.zero_grad(set_to_none=True)
        mb.zero()


def _ddp_worker(rank, world_size, port, out_path):
    """Two processes, two micro-steps each under no_sync, on the same 8 examples as the
    single-process run in the test; rank 0 saves its measurements."""
    import nanogns.estimators.hooks as gnshooks
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.set_num_threads(1)
    torch.distributed.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}',
                                         rank=rank, world_size=world_size)
    raw = tiny_gpt()
    gnshooks.add_hooks_to_model(raw, gnshooks.add_exact_hooks)
    gnshooks.add_hooks_to_model(raw, gnshooks.add_sogns_hooks)
    mb = MicrobatchGNS(raw)
    model = DDP(raw, broadcast_buffers=False)
    batches = gpt_batches(4, 2)
    m = 2
    for k in range(m):
        model.require_backward_grad_sync = (k == m - 1)
        X, Y = batches[2 * k + rank]
        (model(X, Y)[1] / m).backward()
    logged = mb.measurements(micro_batch_size=2)
    logged.update(gnshooks.hook_measurements(raw, 'exact'))
    logged.update(gnshooks.hook_measurements(raw, 'sogns'))
    if rank == 0:
        torch.save(logged, out_path)
    torch.distributed.barrier()  # leave together, and as train.py's ranks do (stopping.leave says why)
    torch.distributed.destroy_process_group()
    leave(0, distributed=True)


@pytest.mark.slow
def test_ddp_two_ranks_equal_one_process(tmp_path):
    """The rank rescaling: 2 processes x 2 micro-steps x 2 examples log what 1 process x 4
    micro-steps x 2 examples logs on the same examples (micro-batch and hook estimators)."""
    import socket
    import nanogns.estimators.hooks as gnshooks
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    out_path = str(tmp_path / 'rank0.pt')
    # spawn, not fork: a fork of a process whose torch thread pools already ran can deadlock
    workers = torch.multiprocessing.start_processes(_ddp_worker, args=(2, port, out_path), nprocs=2,
                                                    join=False, start_method='spawn')
    deadline = time.time() + 120
    while not workers.join(timeout=1):  # raises if a worker failed
        if time.time() > deadline:
            for p in workers.processes:
                p.kill()
            pytest.fail("the DDP workers hung")
    got = torch.load(out_path)

    model = tiny_gpt()
    gnshooks.add_hooks_to_model(model, gnshooks.add_exact_hooks)
    gnshooks.add_hooks_to_model(model, gnshooks.add_sogns_hooks)
    mb = MicrobatchGNS(model)
    accumulate(model, gpt_batches(4, 2))
    want = mb.measurements(micro_batch_size=2)
    want.update(gnshooks.hook_measurements(model, 'exact'))
    want.update(gnshooks.hook_measurements(model, 'sogns'))
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-4), k
