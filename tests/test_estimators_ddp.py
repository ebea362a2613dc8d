"""nanogns/estimators/ddp.py: the GNS estimator's maths and checkpointing in one process, then the DDP hook and the
buffer all-reduce across two gloo processes on CPU against brute force (tests/ddp_worker.py)."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO, made_once
from nanogns.estimators.ddp import DDPGradientStatsHook, GradientNoiseScale, ddp_gns_log
from gns_fixtures import MEASURED, gpt_loss, per_example_grads, tiny_gpt, tiny_hf
from nanogns.refusals import ReferenceNameError

WORLD = 2


def sq_norms_for(gtg, trsigma, n_small, n_big):
    """Noise-free inputs: E|G_n|^2 = |G|^2 + tr(Sigma)/n (McCandlish et al. 2018, eq. A.1)."""
    return gtg + trsigma / n_small, gtg + trsigma / n_big


def test_one_update_recovers_gtg_and_trsigma_exactly():
    gns = GradientNoiseScale(beta=0.9)
    gns.update(*sq_norms_for(2.0, 30.0, 4, 32), 4, 32)
    gtg, trsigma = gns.get_stats()
    assert gtg == pytest.approx(2.0, rel=1e-12) and trsigma == pytest.approx(30.0, rel=1e-12)
    assert gns.get_gns() == pytest.approx(15.0, rel=1e-12)


def test_emas_are_debiased_and_gns_is_their_ratio_not_an_ema_of_ratios():
    beta = 0.5
    gns = GradientNoiseScale(beta=beta)
    steps = [(1.0, 10.0, 8, 16), (3.0, 2.0, 4, 64), (0.5, 40.0, 16, 48)]
    for gtg, trsigma, n_small, n_big in steps:
        gns.update(*sq_norms_for(gtg, trsigma, n_small, n_big), n_small, n_big)
    # by hand: after k updates the EMA weighs update i by (1 - beta) beta^(k-1-i), and the
    # debiasing divides by 1 - beta^k, the sum of those weights
    weights = [(1 - beta) * beta ** (len(steps) - 1 - i) for i in range(len(steps))]
    want_gtg = sum(w * s[0] for w, s in zip(weights, steps)) / sum(weights)
    want_trsigma = sum(w * s[1] for w, s in zip(weights, steps)) / sum(weights)
    gtg, trsigma = gns.get_stats()
    assert gtg == pytest.approx(want_gtg, rel=1e-12)
    assert trsigma == pytest.approx(want_trsigma, rel=1e-12)
    assert gns.get_gns() == pytest.approx(want_trsigma / want_gtg, rel=1e-12)
    ema_of_ratios = sum(w * s[1] / s[0] for w, s in zip(weights, steps)) / sum(weights)
    assert abs(gns.get_gns() - ema_of_ratios) > 1.0


def test_nan_before_any_update_and_nonfinite_steps_are_skipped():
    gns = GradientNoiseScale()
    assert math.isnan(gns.get_gns()) and all(math.isnan(v) for v in gns.get_stats())
    gns.update(*sq_norms_for(1.0, 8.0, 2, 4), 2, 4)
    before = gns.state_dict()
    gns.update(float('inf'), 1.0, 2, 4)  # a float16 overflow step
    gns.update(1.0, float('nan'), 2, 4)
    assert gns.state_dict() == before


def test_bad_batch_sizes_are_refused():
    gns = GradientNoiseScale()
    for n_small, n_big in [(8, 8), (8, 4), (0, 4)]:
        with pytest.raises(ValueError, match="n_small < n_big"):
            gns.update(1.0, 0.5, n_small, n_big)


def test_negative_emas_are_reported_raw_but_clamped_in_the_gns():
    gns = GradientNoiseScale(beta=0.9, eps=1e-3)
    # sq_small < sq_big: noise made tr(Sigma) come out negative
    gns.update(1.0, 2.0, 1, 2)
    gtg, trsigma = gns.get_stats()
    assert trsigma < 0 < gtg
    # as in the reference: the clamp applies to the EMAs before debiasing (0.1 * the debiased here)
    assert gns.ema_sq_norm == pytest.approx(0.1 * gtg) and gns.ema_var == pytest.approx(0.1 * trsigma)
    assert gns.get_gns() == gns.gradient_noise_scale == pytest.approx(1e-3 / (0.1 * gtg))


def test_state_dict_round_trip_through_a_checkpoint_continues_identically(tmp_path):
    a = GradientNoiseScale(beta=0.99)
    for i in range(5):
        a.update(*sq_norms_for(1.0 + i, 10.0 - i, 4, 16), 4, 16)
    torch.save({'ddp_gns': a.state_dict()}, tmp_path / 'ckpt.pt')
    b = GradientNoiseScale()  # default beta: the checkpoint's must win
    b.load_state_dict(torch.load(tmp_path / 'ckpt.pt', weights_only=True)['ddp_gns'])
    assert b.state_dict() == a.state_dict()
    for gns in (a, b):
        gns.update(*sq_norms_for(3.0, 5.0, 4, 16), 4, 16)
    assert b.get_stats() == a.get_stats() and b.get_gns() == a.get_gns()


def test_msg_and_log_dict():
    gns = GradientNoiseScale()
    gns.update(*sq_norms_for(2.0, 30.0, 4, 32), 4, 32)
    msg = gns.get_msg('ddp/')
    assert msg == {'ddp/gtg': pytest.approx(2.0), 'ddp/trsigma': pytest.approx(30.0), 'ddp/gns': pytest.approx(15.0)}
    assert list(msg) == ['ddp/gtg', 'ddp/trsigma', 'ddp/gns'] and list(gns.get_msg()) == ['gtg', 'trsigma', 'gns']
    # before any update: NaN where the reference would divide by zero
    assert all(math.isnan(v) for v in GradientNoiseScale().get_msg().values())
    sq_small, sq_big = sq_norms_for(2.0, 30.0, 4, 32)
    log = ddp_gns_log(gns, sq_small, sq_big, 4, 32)
    assert list(log) == ['ddp/big_batch_norm', 'ddp/small_batch_norm', 'ddp/big_batch_size',
                         'ddp/small_batch_size', 'ddp/gtg', 'ddp/trsigma', 'ddp/gns']
    assert log['ddp/big_batch_norm'] == pytest.approx(math.sqrt(sq_big))
    assert log['ddp/small_batch_norm'] == pytest.approx(math.sqrt(sq_small))
    assert (log['ddp/small_batch_size'], log['ddp/big_batch_size']) == (4, 32)
    assert (log['ddp/gtg'], log['ddp/trsigma'], log['ddp/gns']) == (*gns.get_stats(), gns.get_gns())


def test_reference_defaults_attributes_and_state_dict():
    gns = GradientNoiseScale()
    assert (gns.beta, gns.eps) == (0.995, 1e-8)
    assert (gns.ema_sq_norm, gns.ema_var, gns.beta_cumprod) == (0.0, 0.0, 1.0)
    assert math.isnan(gns.gradient_noise_scale) and math.isnan(gns.get_gns())
    steps = [(2.0, 30.0), (3.0, 20.0)]
    for gtg, trsigma in steps:
        returned = gns.update(*sq_norms_for(gtg, trsigma, 4, 32), 4, 32)
    # the EMAs as the reference keeps them: not debiased
    assert gns.ema_sq_norm == pytest.approx(0.995 * 0.005 * 2.0 + 0.005 * 3.0, rel=1e-12)
    assert gns.ema_var == pytest.approx(0.995 * 0.005 * 30.0 + 0.005 * 20.0, rel=1e-12)
    assert gns.beta_cumprod == pytest.approx(0.995 ** 2, rel=1e-15)
    assert returned == gns.gradient_noise_scale == gns.get_gns() == pytest.approx(gns.ema_var / gns.ema_sq_norm)
    state = gns.state_dict()
    assert state == dict(beta=0.995, eps=1e-8, ema_sq_norm=gns.ema_sq_norm, ema_var=gns.ema_var,
                         beta_cumprod=gns.beta_cumprod, gradient_noise_scale=gns.gradient_noise_scale)


def test_load_state_dict_takes_this_forks_older_checkpoints_and_the_reference_dict():
    a = GradientNoiseScale(beta=0.99)
    for i in range(3):
        a.update(*sq_norms_for(1.0 + i, 10.0 - i, 4, 16), 4, 16)
    older = dict(beta=0.99, eps=1e-8, ema_gtg=a.ema_sq_norm, ema_trsigma=a.ema_var, beta_cumprod=a.beta_cumprod)
    b = GradientNoiseScale()
    b.load_state_dict(older)
    assert b.state_dict() == pytest.approx(a.state_dict(), rel=1e-15)
    fresh = GradientNoiseScale(beta=0.9)
    c = GradientNoiseScale()
    c.load_state_dict(dict(beta=0.9, eps=1e-8, ema_gtg=0.0, ema_trsigma=0.0, beta_cumprod=1.0))
    assert math.isnan(c.get_gns()) and c.state_dict().keys() == fresh.state_dict().keys()
    # the reference's state_dict() is its __dict__: the same six keys
    d = GradientNoiseScale()
    d.load_state_dict(dict(a.state_dict()))
    assert d.state_dict() == a.state_dict()
    with pytest.raises(ValueError, match=r"unknown keys \['ema_something'\]"):
        d.load_state_dict({**a.state_dict(), 'ema_something': 1.0})


def test_hook_refuses_a_model_without_ddp():
    with pytest.raises(ValueError, match="DistributedDataParallel"):  # the reference's error type
        DDPGradientStatsHook(torch.nn.Linear(2, 2))


def test_the_reference_hooks_bucket_list_is_refused():
    hook = object.__new__(DDPGradientStatsHook)
    with pytest.raises(ReferenceNameError, match=r"bucket_sq_norms_small_batch is the reference implementation's.*"
                                                 r"get_stats\(\).*get_sq_norms\(\)"):
        hook.bucket_sq_norms_small_batch


# ---------------------------------------------------------------------------------------------
# two processes, gloo on CPU: one launch shared by the tests below

@pytest.fixture(scope="module")
def ddp_worker_ranks(tmp_path_factory):
    def make(out):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}",
               os.path.join(REPO, "tests", "ddp_worker.py"), str(out)]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240, env=env)
        assert p.returncode == 0, f"ddp_worker failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    out = made_once(tmp_path_factory, "ddp_worker", make)
    return [json.load(open(out / f"rank{r}.json")) for r in range(WORLD)]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hook_small_batch_norm_is_the_mean_of_each_ranks_local_gradient_norm(ddp_worker_ranks, dtype):
    rtol = 1e-5 if dtype == "float32" else 1e-3  # bf16: the hook sums in float32, the oracle in float64
    for step in range(2):  # step 1 also checks the reset and the loss-scale division
        local = [r[dtype][step]['local_sq'] for r in ddp_worker_ranks]
        assert abs(local[0] - local[1]) > 1e-2 * local[0]  # different data: the mean is not trivial
        for r in ddp_worker_ranks:
            assert r[dtype][step]['sq_small'] == pytest.approx(sum(local) / WORLD, rel=rtol)
            # get_stats(): the reference's one float, that same mean
            assert r[dtype][step]['stats_type'] == 'float' and r[dtype][step]['stats'] == r[dtype][step]['sq_small']
    # the first synchronised backward has DDP's one big bucket, later ones its real buckets
    assert all(r[dtype][1]['n_buckets'] > 1 for r in ddp_worker_ranks)
    # silent on the micro-step that does not synchronise; reset by each get_stats()
    assert all(s['buckets_after_no_sync'] == 0 and s['second_call_raises'] for r in ddp_worker_ranks for s in r[dtype])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hook_averages_like_default_ddp_and_measures_the_average(ddp_worker_ranks, dtype):
    for r in ddp_worker_ranks:
        for s in r[dtype]:
            assert s['max_diff_hooked_plain'] == 0.0  # bit-identical to DDP's default hook
            assert s['max_diff_hooked_by_hand'] == 0.0
            assert s['sq_big'] == pytest.approx(s['averaged_sq'], rel=1e-5)
            assert s['sq_big'] == pytest.approx(s['hooked_grad_sq'], rel=1e-5)
            assert s['sq_big'] < s['sq_small']  # averaging cancels noise


@pytest.mark.slow
def test_buffer_allreduce_sums_in_one_collective_and_gives_the_global_pegn(ddp_worker_ranks):
    b0, b1 = ddp_worker_ranks[0]['buffers'], ddp_worker_ranks[1]['buffers']
    assert b0['collectives'] == 1 and b1['collectives'] == 1
    assert b0['before'] != b1['before']
    for name in b0['before']:
        want = b0['before'][name] + b1['before'][name]
        assert b0['after'][name] == pytest.approx(want, rel=1e-6)
        assert b1['after'][name] == b0['after'][name]
    # the rescaling of the docstring: |G_1|^2 = (B_rank^2 / B) S = B S / W^2 equals the mean
    # per-example squared norm over the global batch, from brute-force per-example gradients
    batch = WORLD * b0['batch']
    for pname, examples in b0['example_sq'].items():
        module, leaf = pname.split('.')
        assert b0['after'][f'{module}.example_count'] == batch
        all_examples = examples + b1['example_sq'][pname]
        pegn_sq = batch * b0['after'][f'{module}.{leaf}_sqgradnorm'] / WORLD ** 2
        assert pegn_sq == pytest.approx(sum(all_examples) / batch, rel=1e-5)


@pytest.mark.slow
def test_ddp_gns_matches_a_problem_with_known_noise_scale(ddp_worker_ranks):
    k = ddp_worker_ranks[0]['known']
    assert ddp_worker_ranks[1]['known'] == k  # every rank computes the same estimate
    assert math.isfinite(k['gns']) and k['gns'] > 0
    # replay the logged raw norms: the EMA can be recomputed offline from the CSV columns
    replay = GradientNoiseScale(beta=k['beta'])
    for sq_small, sq_big in k['raw']:
        replay.update(sq_small, sq_big, k['batch'], WORLD * k['batch'])
    assert replay.state_dict() == pytest.approx(k['state'])
    # 400 steps of 2 x 8 examples: the estimates are within a few percent of the truth
    assert k['gtg'] == pytest.approx(k['true_gtg'], rel=0.15)
    assert k['trsigma'] == pytest.approx(k['true_trsigma'], rel=0.15)
    assert k['gns'] == pytest.approx(k['true_trsigma'] / k['true_gtg'], rel=0.2)
    assert k['log']['ddp/gns'] == k['gns'] and k['log']['ddp/big_batch_size'] == WORLD * k['batch']


def one_process_reference(ddp_worker):
    """The two ranks' steps on one process: every micro-batch of the global batch, the exact, hook
    and micro-batch estimators through the interface, and each rank's own gradient (the mean of its
    examples' gradients by the shared oracle, through a plain GPT at the same weights) for the DDP
    estimator's brute force."""
    import nanogns.estimators.exact as gnstracking
    from model import GPT
    raw = tiny_gpt(0, **MEASURED)
    estimators = gnstracking.estimators_for(raw, hooks='exact', microbatch=True)
    plain = GPT(raw.config)
    optimizer = torch.optim.SGD(raw.parameters(), lr=0.1)
    m = ddp_worker.MICRO_STEPS
    steps = []
    for step in range(ddp_worker.INTERFACE_STEPS):
        plain.load_state_dict(raw.state_dict())
        rank_grads = []
        for rank in range(WORLD):
            micro_batches = [ddp_worker.interface_batch(step, k, rank) for k in range(m)]
            grads = per_example_grads(plain, gpt_loss, *(torch.cat(t) for t in zip(*micro_batches)))
            rank_grads.append(torch.cat([g.double().mean(0).flatten() for g in grads.values()]))
        for k in range(m):
            for rank in range(WORLD):
                (raw(*ddp_worker.interface_batch(step, k, rank))[1] / (m * WORLD)).backward()
        row = gnstracking.measure_all(estimators, step, m * ddp_worker.MICRO_BATCH * WORLD, None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        gnstracking.reset_all(estimators)
        sq_small = sum(g.square().sum().item() for g in rank_grads) / WORLD
        sq_big = (sum(rank_grads) / WORLD).square().sum().item()
        steps.append(dict(row=row, sq_small=sq_small, sq_big=sq_big))
    return steps, estimators[0].state_dict()


@pytest.mark.slow
def test_every_estimator_through_the_interface_on_two_ranks_equals_one_process(ddp_worker_ranks):
    """train.py's loop through gnstracking's interface under DDP and a GradScaler: the exact
    (buffers all-reduced), hook and micro-batch estimators log what one process logs on the same
    global batch, and the DDP estimator the brute-force norms of each rank's own gradient."""
    import ddp_worker
    got = [r['interface'] for r in ddp_worker_ranks]
    assert got[0]['names'] == ['train/gns', 'train/hooks_gns', 'train/microbatch_gns', 'ddp']
    assert got[0]['steps'] == got[1]['steps'] and got[0]['states'] == got[1]['states']  # every rank alike
    want, exact_state = one_process_reference(ddp_worker)
    replay = GradientNoiseScale()
    n_small, n_big = ddp_worker.MICRO_STEPS * ddp_worker.MICRO_BATCH, ddp_worker.MICRO_STEPS * ddp_worker.MICRO_BATCH * WORLD
    for g, w in zip(got[0]['steps'], want):
        per_parameter = {c: v for c, v in g['row'].items() if not c.startswith('ddp/')}
        assert per_parameter.keys() == w['row'].keys()
        assert {c.split('/')[1] for c in per_parameter} == {'gns', 'hooks_gns', 'microbatch_gns'}
        for c, v in w['row'].items():
            assert per_parameter[c] == pytest.approx(v, rel=1e-4), c
        replay.update(w['sq_small'], w['sq_big'], n_small, n_big)
        assert g['row']['ddp/small_batch_norm'] == pytest.approx(math.sqrt(w['sq_small']), rel=1e-4)
        assert g['row']['ddp/big_batch_norm'] == pytest.approx(math.sqrt(w['sq_big']), rel=1e-4)
        assert (g['row']['ddp/small_batch_size'], g['row']['ddp/big_batch_size']) == (n_small, n_big)
        assert g['row']['ddp/gns'] == pytest.approx(replay.get_gns(), rel=1e-3)
        exact, hooks, microbatch, ddp = g['status']
        assert exact.startswith('gns ') and hooks == microbatch == '' and ddp == f"ddp gns {g['row']['ddp/gns']:.4g}"
        assert g['line'] == f"{exact}, {ddp}"
    states = got[0]['states']
    assert set(states) == {'train/gns', 'ddp'} and states['ddp']['beta'] == 0.995
    assert states['train/gns'] == pytest.approx(exact_state, rel=1e-4)



@pytest.mark.slow
def test_the_ranks_measure_each_linear_with_rank_zeros_method(ddp_worker_ranks):
    """Each rank chooses its Linears' methods from the table or the shapes, nothing timed, so alike; where
    they start from methods of their own, the exact estimator gives all ranks rank 0's (one broadcast of
    them all, once), so the ranks measure alike."""
    chosen = [r['interface']['methods'] for r in ddp_worker_ranks]
    assert chosen[0] == chosen[1] and len(chosen[0]) > 0
    own = [r['methods']['own'] for r in ddp_worker_ranks]
    assert all(own[0][name] != own[1][name] for name in own[0])  # each rank started from other methods
    for r in ddp_worker_ranks:
        assert r['methods']['after'] == own[0] and r['methods']['broadcasts'] == 1


@pytest.mark.slow
def test_measured_hugging_face_gpt2_on_two_ranks_equals_one_process(ddp_worker_ranks):
    """buffered.measure on Hugging Face's GPT-2 (Conv1D layers, the wte = lm_head tie, [1, T]
    positions) under DDP: each parameter's norms and the GNS are what one process gets on the same
    global batch (the per-example buffers summed over ranks and rescaled, McCandlish App. A)."""
    pytest.importorskip("transformers")
    import ddp_worker
    import nanogns.estimators.exact as gnstracking
    from nanogns.layers import measure
    got = [r['hf'] for r in ddp_worker_ranks]
    assert got[0] == got[1]  # every rank alike
    raw = measure(tiny_hf("gpt2").train())
    estimators = gnstracking.estimators_for(raw)
    optimizer = torch.optim.SGD(raw.parameters(), lr=0.1)
    m = ddp_worker.MICRO_STEPS
    for step, logged in enumerate(got[0]['rows']):
        for k in range(m):
            x = torch.cat([ddp_worker.hf_batch(step, k, rank) for rank in range(WORLD)])  # the global micro-batch
            (raw(input_ids=x, labels=x).loss / m).backward()
        row = gnstracking.measure_all(estimators, step, m * ddp_worker.MICRO_BATCH * WORLD, None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        gnstracking.reset_all(estimators)
        assert logged.keys() == row.keys() and len(row) == 3 * len(list(raw.parameters()))
        for c, v in row.items():
            assert logged[c] == pytest.approx(v, rel=1e-4), c
    assert got[0]['line'] == gnstracking.status_line(estimators)


@pytest.mark.slow
def test_adam_preconditioned_gns_on_two_ranks_equals_one_process(ddp_worker_ranks):
    """adamgns.AdamGNS under DDP: the ranks' per-coordinate sums are summed and rescaled as the
    exact estimator's buffers are, and P is AdamW's (replicated) state: each LayerNorm parameter's
    preconditioned norms are one process's on the same global batch."""
    import ddp_worker
    import nanogns.estimators.exact as gnstracking
    got = [r['adam'] for r in ddp_worker_ranks]
    assert got[0] == got[1]  # every rank alike
    raw = tiny_gpt(0, **MEASURED)
    optimizer = torch.optim.AdamW(raw.parameters(), lr=1e-2)
    estimators = gnstracking.estimators_for(raw, adam_optimizer=optimizer)
    m = ddp_worker.MICRO_STEPS
    for step, logged in enumerate(got[0]):
        for k in range(m):
            batches = [ddp_worker.interface_batch(step, k, rank) for rank in range(WORLD)]
            _, loss = raw(torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches]))
            (loss / m).backward()
        row = gnstracking.measure_all(estimators, step, m * ddp_worker.MICRO_BATCH * WORLD, None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        gnstracking.reset_all(estimators)
        row = {k: v for k, v in row.items() if k.startswith("train/adam_gns/")}
        assert logged.keys() == row.keys() and (len(row) > 0) == (step > 0)  # step 0: no AdamW state yet
        assert all(".ln_" in c for c in row)  # the normalisation layers alone
        for c, v in row.items():
            assert logged[c] == pytest.approx(v, rel=1e-4), c


@pytest.mark.slow
def test_measured_hugging_face_gpt2_sharded_by_fsdp2_logs_what_ddp_logs(ddp_worker_ranks):
    """The same measured Hugging Face GPT-2 and global batches under FSDP2 (fully_shard per block and
    the root) as under DDP, which the test above checks against one process: the same columns and
    values, the buffers summed over ranks and |G_B|^2 from the gradient shards."""
    pytest.importorskip("transformers")
    ddp, fsdp = ddp_worker_ranks[0]['hf'], [r['hf_fsdp'] for r in ddp_worker_ranks]
    assert fsdp[0] == fsdp[1]  # every rank alike
    for logged, expected in zip(fsdp[0]['rows'], ddp['rows'], strict=True):
        assert logged.keys() == expected.keys()
        for c, v in expected.items():
            assert logged[c] == pytest.approx(v, rel=1e-4), c
