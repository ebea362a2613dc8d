"""
nanogns.layers (the reference's buffered.py) against brute force: per-example gradients of the plain torch layer by the shared
oracle (tests/gns_fixtures.py), in float64 sums. A layer that sees the gradient of
L = (1/N) sum_b l_b over N examples (split into micro-steps) must hold sum_b ||g_b||^2 / N^2.
"""
import gc
import os
import sys
import time
import warnings
from copy import deepcopy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import nanogns.layers as buffered  # noqa: E402
import nanogns.layers.buffers as buffers_module  # noqa: E402  (its warn-once memory)
import nanogns.layers.linear as linear_module  # noqa: E402  (where the Linear maths is patched)
from nanogns.refusals import ReferenceNameError  # noqa: E402
from nanogns.layers import (PEGradNormEmbedding, PEGradNormLinear, PEGradNormSeparatedLayerNorm,  # noqa: E402
                      PEGradNormSeparatedRMSNorm, PEGradNormShimEmbedding, PEGradNormShimLinear,
                      find_sqgradnorm_buffers, tie_weights, zero_sqgradnorm_buffers)
from gns_fixtures import output_grad_loss, sqgradnorm_sums  # noqa: E402

LINEARS = [PEGradNormLinear, PEGradNormShimLinear]
EMBEDDINGS = [PEGradNormEmbedding, PEGradNormShimEmbedding]
SHIMS = (PEGradNormShimLinear, PEGradNormShimEmbedding, PEGradNormSeparatedRMSNorm)  # torch's own .grad
PLAIN = {PEGradNormLinear: nn.Linear, PEGradNormShimLinear: nn.Linear, PEGradNormEmbedding: nn.Embedding,
         PEGradNormShimEmbedding: nn.Embedding, PEGradNormSeparatedLayerNorm: nn.LayerNorm,
         PEGradNormSeparatedRMSNorm: nn.RMSNorm}


def bias_kwargs(cls, bias):
    """bias=... for the layers whose torch class takes it (not Embedding, not RMSNorm)."""
    return dict(bias=bias) if PLAIN[cls] in (nn.Linear, nn.LayerNorm) else {}


def example_loss(y, r):
    """l_b for an output y of one or more examples: a fixed random functional of y."""
    return (torch.sin(y.float()) * r).sum()


def brute_force(plain, batches, loss=lambda forward, x, r: example_loss(forward(x), r)):
    """{parameter name: sum_b ||g_b||^2 / N^2} over all examples of all micro-batches, from
    per-example gradients of the plain torch module."""
    return sqgradnorm_sums(plain, loss, batches)


def run(layer, batches, scale=1.0, autocast=None):
    """Micro-steps of forward + backward on L = (1/N) sum_b l_b (times a loss scale)."""
    N = sum(x.shape[0] for x, _ in batches)
    for x, r in batches:
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            y = layer(x)
        (example_loss(y, r) * (scale / N)).backward()


def measured(layer):
    return {n: buf.item() for n, _, buf, _ in find_sqgradnorm_buffers(layer)}


def float_batches(steps, shape, out_features, dtype=torch.float32, r_scale=1.0):
    batches = []
    for _ in range(steps):
        x = torch.randn(shape, dtype=dtype)
        batches.append((x, r_scale * torch.randn(*shape[:-1], out_features)))
    return batches


def id_batches(steps, shape, num_embeddings, dim, padding_idx=None):
    batches = []
    for _ in range(steps):
        ids = torch.randint(0, num_embeddings, shape)
        if padding_idx is not None:
            ids.view(-1)[::3] = padding_idx  # make sure padding occurs
        batches.append((ids, torch.randn(*shape, dim)))
    return batches


def twins(cls, *args, dtype=torch.float32, **kwargs):
    """(measured layer, plain torch layer) with the same random parameters."""
    layer = cls(*args, **kwargs).to(dtype)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_()
    plain = PLAIN[cls](*args, **kwargs).to(dtype)
    plain.load_state_dict(layer.state_dict())
    return layer, plain


def check(layer, plain, batches, rtol=1e-5, grad_exact=None):
    """Norms against brute force, example count, and .grad against the plain layer's."""
    expected = brute_force(plain, batches)
    run(layer, batches)
    run(plain, batches)
    got = measured(layer)
    assert set(got) == set(expected)
    for n in expected:
        torch.testing.assert_close(torch.tensor(got[n], dtype=torch.float64), expected[n], rtol=rtol, atol=1e-9)
    assert all(c.item() == sum(x.shape[0] for x, _ in batches) for *_, c in find_sqgradnorm_buffers(layer))
    grad_exact = isinstance(layer, SHIMS) if grad_exact is None else grad_exact
    for (n, p), q in zip(layer.named_parameters(), plain.parameters()):
        if p.requires_grad:
            if grad_exact:
                assert torch.equal(p.grad, q.grad), n
            else:
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------
# Linear

@pytest.mark.parametrize("cls", LINEARS)
@pytest.mark.parametrize("mode", buffered.PER_EXAMPLE_MODES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(5, 6), (3, 4, 6), (2, 3, 2, 6)])
@pytest.mark.parametrize("steps", [1, 2, 3])
def test_linear_matches_brute_force(cls, mode, bias, shape, steps):
    torch.manual_seed(0)
    layer, plain = twins(cls, 6, 7, bias=bias)
    layer.per_example_mode = mode
    batches = float_batches(steps, shape, 7)
    with torch.no_grad():
        assert torch.equal(layer(batches[0][0]), plain(batches[0][0]))
    check(layer, plain, batches)
    assert ("bias_sqgradnorm" in layer._buffers) == bias


@pytest.mark.parametrize("cls", LINEARS)
@pytest.mark.parametrize("mode", ["ghost", "materialise"])
def test_linear_chunks_bound_memory_and_agree(cls, mode, monkeypatch):
    """With a tiny chunk budget every example is its own chunk (each batched product takes
    one example), the norms do not change, and the mode asked for is the one that runs."""
    torch.manual_seed(1)
    layer, plain = twins(cls, 6, 5)
    layer.per_example_mode, layer.max_chunk_numel = mode, 1
    batch_sizes, ran = [], []
    bmm = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda a, b: batch_sizes.append(a.shape[0]) or bmm(a, b))
    for name in ("_weight_sqnorm_ghost", "_weight_sqnorm_materialised"):
        fn = getattr(linear_module, name)
        monkeypatch.setattr(linear_module, name, lambda *a, _fn=fn, _name=name, **k: ran.append(_name) or _fn(*a, **k))
    check(layer, plain, float_batches(2, (7, 3, 6), 5))
    assert batch_sizes and set(batch_sizes) == {1}
    other = "_weight_sqnorm_materialised" if mode == "ghost" else "_weight_sqnorm_ghost"
    assert ran and other not in ran


def test_the_shape_rule_follows_the_shapes():
    assert linear_module._use_ghost(1, 384, 384, True, "shapes")  # one token per example: ghost
    assert not linear_module._use_ghost(1024, 768, 768, True, "shapes")  # long sequences: materialise
    assert linear_module._use_ghost(256, 384, 1536, False, "shapes")  # shim: T (K+L) < K L
    assert not linear_module._use_ghost(256, 384, 65, False, "shapes")
    assert linear_module._use_ghost(1024, 8, 8, True, "ghost") and not linear_module._use_ghost(1, 8, 8, True, "materialise")
    with pytest.raises(ValueError):
        linear_module._use_ghost(1, 2, 2, True, "sometimes")


def test_none_is_the_shape_rule_as_before_auto_came():
    for shape in ((1, 384, 384, True), (1024, 768, 768, True), (256, 384, 1536, False), (256, 384, 65, False)):
        assert linear_module._use_ghost(*shape, None) == linear_module._use_ghost(*shape, "shapes")
    layer = buffered.PEGradNormLinear(8, 4)
    buffered.set_per_example_mode(layer, None)
    layer(torch.randn(2, 3, 8)).sum().backward()
    assert layer.norm_method == ("ghost" if linear_module._use_ghost(3, 8, 4, True, "shapes") else "materialise")


class MethodRuns:
    """Counts the runs of the ghost norm and of the materialised weight gradients in
    nanogns.layers.linear, and every read of time.perf_counter while set: a layer that timed its two
    methods would read the clock."""

    def __init__(self, monkeypatch):
        self.runs, self.clock_reads = [], 0
        clock = time.perf_counter
        monkeypatch.setattr(time, "perf_counter", lambda: self.read(clock))
        for name in ("_weight_sqnorm_ghost", "_weight_sqnorm_materialised"):
            fn = getattr(linear_module, name)
            monkeypatch.setattr(linear_module, name, lambda *a, _fn=fn, _name=name, **k:
                                self.runs.append(_name) or _fn(*a, **k))

    def read(self, clock):
        self.clock_reads += 1
        return clock()


def shapes_rule(cls, T, K, L):
    return "ghost" if linear_module._use_ghost(T, K, L, cls.fused, "shapes") else "materialise"


RUN_OF = {"ghost": "_weight_sqnorm_ghost", "materialise": "_weight_sqnorm_materialised"}


@pytest.mark.parametrize("cls", LINEARS)
@pytest.mark.parametrize("tokens", [1, 64], ids=["ghost", "materialise"])
def test_auto_takes_the_shapes_rule_at_its_first_backward_without_timing_and_keeps_it(cls, tokens, monkeypatch):
    """No table (the CPU): an "auto" layer's first backward runs the one method the shapes rule gives,
    reads no clock, and every norm is added once."""
    torch.manual_seed(2)
    runs = MethodRuns(monkeypatch)
    layer, plain = twins(cls, 6, 5)
    assert layer.per_example_mode == "auto" and layer.norm_method is None
    want = shapes_rule(cls, tokens, 6, 5)
    check(layer, plain, float_batches(3, (4, tokens, 6), 5))  # three micro-steps into the buffers
    assert layer.norm_method == want
    assert runs.runs == [RUN_OF[want]] * 3 and runs.clock_reads == 0
    assert not hasattr(linear_module, "_timed_choice")


@pytest.mark.parametrize("cls", LINEARS)
def test_auto_chooses_once_when_two_forwards_precede_the_first_backward(cls, monkeypatch):
    runs = MethodRuns(monkeypatch)
    layer = cls(6, 5)
    x = torch.randn(4, 3, 6)
    y1, y2 = layer(x), layer(x)  # both forwards before any backward
    (y1.sum() + y2.sum()).backward()
    want = shapes_rule(cls, 3, 6, 5)
    assert layer.norm_method == want and runs.runs == [RUN_OF[want]] * 2 and runs.clock_reads == 0


@pytest.mark.parametrize("cls", LINEARS)
def test_a_restored_method_is_kept_and_other_modes_decide_per_call(cls, monkeypatch):
    runs = MethodRuns(monkeypatch)
    model = nn.Sequential(cls(6, 5), nn.Tanh(), cls(5, 4))
    buffered.set_linear_norm_methods(model, {"0": "materialise", "2": "ghost"})
    assert buffered.linear_norm_methods(model) == {"0": "materialise", "2": "ghost"}
    model(torch.randn(4, 3, 6)).sum().backward()
    assert sorted(runs.runs) == ["_weight_sqnorm_ghost", "_weight_sqnorm_materialised"]  # one run each
    # a pinned mode decides per call and says what it used; the restored method is not used
    buffered.set_per_example_mode(model, "shapes")
    model(torch.randn(4, 1, 6)).sum().backward()  # one token per example: the ghost norm in both
    assert buffered.linear_norm_methods(model) == {"0": "ghost", "2": "ghost"}
    assert runs.clock_reads == 0
    with pytest.raises(ValueError, match="sometimes"):
        buffered.set_linear_norm_methods(model, {"0": "sometimes"})
    with pytest.raises(ValueError, match="sometimes"):
        buffered.set_per_example_mode(model, "sometimes")


def test_an_undecided_auto_layer_keeps_no_choice_while_torch_compile_traces(monkeypatch):
    """Under torch.compile (is_compiling) an undecided "auto" layer takes the shape rule and keeps no
    choice: the compiled graph holds one method, and the saved choice or the rule is all it can use."""
    runs = MethodRuns(monkeypatch)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    layer = PEGradNormLinear(6, 5)
    layer(torch.randn(4, 1, 6)).sum().backward()
    assert runs.runs == ["_weight_sqnorm_ghost"] and layer.norm_method is None


@pytest.mark.parametrize("cls", LINEARS)
@pytest.mark.parametrize("faster", ["ghost", "materialise"])
def test_before_compiling_the_undecided_auto_linears_take_the_table_or_the_shapes_rule(cls, faster, monkeypatch,
                                                                                         tmp_path):
    """choose_linear_norm_methods (train.py calls it before torch.compile): each "auto" Linear with no
    method takes the table's where it measured that shape at those tokens, else the shapes rule (a
    tied head too), running and timing nothing; restored methods and other modes are left alone,
    and nothing of the model or of the global random state changes."""
    rows = [("card", "toy", "a", 4, 3, 6, 5, "float32", route, ms, 1.0, 1e-7, 1e-7)
            for route, ms in (("ghost", 0.1 if faster == "ghost" else 0.2), ("bmm", 0.2 if faster == "ghost" else 0.1))]
    cuda_table(monkeypatch, "cpu", rows, tmp_path)
    runs = MethodRuns(monkeypatch)
    model = nn.Sequential(cls(6, 5), nn.Tanh(), cls(5, 4), cls(4, 3), cls(3, 2), cls(2, 2))
    buffered.set_linear_norm_methods(model, {"2": "ghost"})  # restored from a checkpoint
    model[3].per_example_mode = "shapes"
    model[4]._tie = {}  # a tied head (tie_weights)
    state = deepcopy(model.state_dict())
    buffers = [b.clone() for b in buffered.all_sqgradnorm_buffers(model)]
    rng = torch.get_rng_state()
    methods = buffered.choose_linear_norm_methods(model, 4, 3, "cpu")
    assert methods == {"0": faster, "2": "ghost", "4": shapes_rule(cls, 3, 3, 2), "5": shapes_rule(cls, 3, 2, 2)}
    assert runs.runs == [] and runs.clock_reads == 0
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert all(torch.equal(a, b) for a, b in zip(buffered.all_sqgradnorm_buffers(model), buffers))
    assert all(p.grad is None for p in model.parameters())
    # the next backward uses the choices: one run of each measured layer, no clock read
    model[4]._tie = None
    model(torch.randn(4, 3, 6)).sum().backward()
    assert len(runs.runs) == 5 and runs.clock_reads == 0
    assert buffered.linear_norm_methods(model) == {**methods, "3": shapes_rule(cls, 3, 4, 3)}


# T = 4, K = L = 4: the shim materialises (T (K+L) >= K L) where the fused rule would take the ghost
# norm; T = 1: the ghost norm
@pytest.mark.parametrize("shape", [(3, 4, 4), (5, 4), (2, 2, 2, 4)], ids=["materialise", "ghost-2d", "materialise-4d"])
@pytest.mark.parametrize("dy_dtype", [torch.float32, torch.bfloat16])
def test_linear_sqnorms_are_the_shim_layers_own(shape, dy_dtype, monkeypatch):
    """What nanogns/estimators/hooks.py computes beside torch's backward: the numbers of a shim layer that chooses
    from the shapes, to the bit (its ghost/materialise choice and chunks), from an input in another
    dtype than the output gradient (autocast), and against brute force."""
    monkeypatch.setattr(PEGradNormShimLinear, "max_chunk_numel", 40)  # a few examples per chunk
    torch.manual_seed(3)
    layer = PEGradNormShimLinear(4, 4)
    layer.per_example_mode = "shapes"  # linear_sqnorms' rule under the default "auto"
    x = torch.randn(shape)
    dy = torch.randn(*shape[:-1], 4).to(dy_dtype)
    ran = []
    for name in ("_weight_sqnorm_ghost", "_weight_sqnorm_materialised"):
        fn = getattr(linear_module, name)
        monkeypatch.setattr(linear_module, name, lambda *a, _fn=fn, _name=name, **k: ran.append(_name) or _fn(*a, **k))
    w_sq, b_sq = buffered.linear_sqnorms(x, dy)
    assert w_sq.dtype == b_sq.dtype == torch.float32
    assert set(ran) == {"_weight_sqnorm_ghost" if len(shape) == 2 else "_weight_sqnorm_materialised"}
    layer.to(dy_dtype)(x.to(dy_dtype)).backward(dy)
    assert torch.equal(w_sq, layer.weight_sqgradnorm) and torch.equal(b_sq, layer.bias_sqgradnorm)
    brute = sqgradnorm_sums(nn.Linear(4, 4, dtype=torch.float64), output_grad_loss,
                            [(x.to(dy_dtype).double(), dy.double())], mean=False)
    rtol = 1e-5 if dy_dtype == torch.float32 else 1e-2  # bfloat16 W_b, as the layer's
    torch.testing.assert_close(w_sq.double(), brute["weight"], rtol=rtol, atol=0)
    torch.testing.assert_close(b_sq.double(), brute["bias"], rtol=1e-5, atol=0)
    assert buffered.linear_sqnorms(x, dy, weight=False)[0] is None and buffered.linear_sqnorms(x, dy, bias=False)[1] is None


# ---- the materialised routes, the committed sweep table and the choice it makes

def exact_weight_norms(x, dy):
    """(sum_b ||dy_b^T x_b||^2, sum_b dy_b^T x_b) in float64 from x [B, T, K] and dy [B, T, L] as given."""
    per_example = torch.bmm(dy.double().mT, x.double())
    return per_example.square().sum(), per_example.sum(0)


@pytest.mark.parametrize("route", ["bmm", "bmm-f32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("compiling", [False, True], ids=["eager", "traced"])
@pytest.mark.parametrize("chunk", [1 << 24, 60], ids=["one-chunk", "chunks"])
def test_the_cublas_routes_match_brute_force(route, dtype, compiling, chunk, monkeypatch):
    """torch.bmm of each example's dy_b^T x_b (W_b in the compute dtype, or float32), then one pass
    over W_b for both the squares and the weight gradient, a chunk of examples at a time: eager and
    as the compiler traces it (the one-pass expression), against float64."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling)
    g = torch.Generator().manual_seed(4)
    x, dy = (torch.randn(5, 3, width, generator=g).to(dtype) for width in (6, 7))
    sq, grad, _ = linear_module._weight_sqnorm_materialised(x, dy, chunk, True, route=route)
    want_sq, want_grad = exact_weight_norms(x, dy)
    rtol = 1e-5 if dtype == torch.float32 or route == "bmm-f32" else 1e-2  # bfloat16 W_b, rounded
    assert sq.dtype == torch.float32 and grad.dtype == torch.float32
    torch.testing.assert_close(sq.double(), want_sq, rtol=rtol, atol=0)
    torch.testing.assert_close(grad.double(), want_grad, rtol=rtol, atol=rtol * want_grad.abs().max().item())
    alone, none, _ = linear_module._weight_sqnorm_materialised(x, dy, chunk, False, route=route)
    assert none is None
    torch.testing.assert_close(alone.double(), want_sq, rtol=rtol, atol=0)


@pytest.mark.parametrize("route,per_chunk", [("bmm", 4), ("bmm-f32", 2)])
def test_the_cublas_routes_bound_their_transient_by_its_bytes(route, per_chunk, monkeypatch):
    """A chunk's W_b stay within max_chunk_numel float32 elements' worth: twice as many bfloat16 W_b
    as float32 ones; the weight gradient is one float32 [L, K] whatever the chunks."""
    K, L = 6, 7
    outputs = []
    bmm = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda *a, **k: outputs.append(bmm(*a, **k)) or outputs[-1])
    x, dy = torch.randn(7, 3, K).bfloat16(), torch.randn(7, 3, L).bfloat16()
    sq, grad, _ = linear_module._weight_sqnorm_materialised(x, dy, 2 * K * L, True, route=route)
    assert [w.shape[0] for w in outputs] == [per_chunk] * (7 // per_chunk) + [7 % per_chunk]
    assert all(w.numel() * w.element_size() <= 2 * K * L * 4 for w in outputs)
    assert grad.shape == (L, K) and grad.dtype == torch.float32
    torch.testing.assert_close(sq.double(), exact_weight_norms(x, dy)[0], rtol=1e-2, atol=0)


def test_one_read_gives_the_squares_and_the_sum():
    """What a GPU's eager pass over float32 W_b computes in one read (var_mean over the examples):
    the sum of squares and the sum over examples, against float64."""
    g = torch.Generator().manual_seed(5)
    per_example = 3 + torch.randn(4, 9, 11, generator=g)  # a mean far from 0: the identity's weak spot
    sq, total = linear_module._one_read_squares_and_sum(per_example)
    torch.testing.assert_close(sq.double(), per_example.double().square().sum(), rtol=1e-6, atol=0)
    torch.testing.assert_close(total.double(), per_example.double().sum(0), rtol=1e-6, atol=1e-5)


ROUTE_ROWS = [  # card, model, layer, B, T, K, L, dtype, route, ms, vs_gemm, norm_err, grad_err
    ("NVIDIA H100 80GB HBM3", "gpt2-small", "mlp.c_fc", 8, 1024, 768, 3072, "bfloat16", "gemm", 0.09, 1.0, "", 1e-3),
    ("NVIDIA H100 80GB HBM3", "gpt2-small", "mlp.c_fc", 8, 1024, 768, 3072, "bfloat16", "bmm", 0.20, 2.2, 1e-6, 1e-3),
    ("NVIDIA H100 80GB HBM3", "gpt2-small", "mlp.c_fc", 8, 1024, 768, 3072, "bfloat16", "kernel 128x128 t64 w8 s3",
     0.11, 1.2, 1e-6, 1e-3),
    ("NVIDIA H100 80GB HBM3", "gpt2-small", "mlp.c_fc", 8, 1024, 768, 3072, "bfloat16", "kernel 64x64 t32 w4 s3",
     0.05, 0.6, 0.3, 1e-3),  # fast and wrong: never chosen
    ("NVIDIA H100 80GB HBM3", "gpt2-small", "mlp.c_fc", 8, 1024, 768, 3072, "bfloat16", "ghost", 1.5, 16.0, 1e-6, 1e-3),
    ("NVIDIA H100 80GB HBM3", "toy", "fc", 8, 4, 768, 3072, "bfloat16", "ghost", 0.01, 0.1, 1e-6, 1e-3),
    ("NVIDIA H100 80GB HBM3", "toy", "fc", 8, 4, 768, 3072, "bfloat16", "bmm-f32", 0.02, 0.2, 1e-6, 1e-3),
]


def write_route_table(path, rows=ROUTE_ROWS):
    import csv
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(buffered.ROUTE_COLUMNS)
        writer.writerows(rows)
    return path


def test_the_sweep_table_ranks_the_exact_routes_of_each_shape(tmp_path):
    table = buffered.read_route_table(write_route_table(tmp_path / "linear-routes-sm90.csv"))
    assert table == {(768, 3072, "bfloat16"): {1024: ["kernel 128x128 t64 w8 s3", "bmm", "ghost"],
                                               4: ["ghost", "bmm-f32"]}}
    assert buffered.read_route_table(tmp_path / "none.csv") == {}
    (tmp_path / "bad.csv").write_text("layer,ms\nmlp,0.1\n")
    with pytest.raises(buffered.LinearRouteTableError, match="bench/gpu_check.py --steps linear"):
        buffered.read_route_table(tmp_path / "bad.csv")


@pytest.mark.parametrize("name,family", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H100 PCIe", "h100"),
                                         ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA H200", "h200"),
                                         ("NVIDIA GeForce RTX 4090", "rtx-4090"), ("Tesla T4", "t4")])
def test_a_cards_family_is_named_from_its_name(name, family):
    assert buffered.card_family(name) == family


@pytest.mark.parametrize("capability,file", [((9, 0), "linear-routes-sm90.csv"), ((8, 0), "linear-routes-sm80.csv"),
                                             ((8, 9), "linear-routes-sm89.csv"), ((10, 0), "linear-routes-sm100.csv")])
def test_a_gpus_table_is_named_by_its_compute_capability(capability, file, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    routes = os.path.join("nanogns", "layers", "routes")
    assert buffered.route_table_path(torch.device("cuda", 0)).endswith(os.path.join(routes, file))
    assert buffered.route_table_path("cpu").endswith(os.path.join(routes, "linear-routes-cpu.csv"))


def test_an_h200_reads_the_sm90_table_and_a_capability_without_one_reads_none(monkeypatch, tmp_path):
    """The table is found by compute capability, not by the card's name: an H200 (9, 0) reads
    linear-routes-sm90.csv; a capability with no table of its own gets none (the shapes rule) and
    borrows no other capability's or family's."""
    write_route_table(tmp_path / "linear-routes-sm90.csv")
    write_route_table(tmp_path / "linear-routes-h200.csv")
    write_route_table(tmp_path / "linear-routes-h100.csv")
    monkeypatch.setattr(linear_module, "ROUTES_DIR", str(tmp_path))
    monkeypatch.setattr(linear_module, "_route_tables", {})
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda", 0)
    assert linear_module._route_table(cuda) == buffered.read_route_table(tmp_path / "linear-routes-sm90.csv") != {}
    assert buffered.table_method(4, 768, 3072, torch.bfloat16, cuda) == "ghost"
    monkeypatch.setattr(linear_module, "_route_tables", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    assert linear_module._route_table(cuda) == {}
    assert buffered.table_method(4, 768, 3072, torch.bfloat16, cuda) is None


def cuda_table(monkeypatch, device, rows=ROUTE_ROWS, tmp_path=None):
    """The sweep table rows as the one device's compute capability has committed (a CPU device stands in)."""
    import csv
    import io
    text = io.StringIO()
    writer = csv.writer(text)
    writer.writerow(buffered.ROUTE_COLUMNS)
    writer.writerows(rows)
    path = tmp_path / "table.csv"
    path.write_text(text.getvalue())
    monkeypatch.setattr(linear_module, "_route_tables", {str(device): buffered.read_route_table(path)})


def test_a_gpu_takes_its_tables_fastest_exact_route_and_the_cublas_route_without_one(monkeypatch, tmp_path):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(linear_module, "_route_tables", {})
    monkeypatch.setattr(linear_module, "ROUTES_DIR", str(tmp_path))  # no table for its capability
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (99, 9))
    assert buffered.materialised_route(1024, 768, 3072, torch.bfloat16, cuda) == "bmm"
    assert buffered.table_method(1024, 768, 3072, torch.bfloat16, cuda) is None
    cuda_table(monkeypatch, cuda, tmp_path=tmp_path)
    monkeypatch.setattr(linear_module, "HAS_TRITON", True)
    assert buffered.materialised_route(1024, 768, 3072, torch.bfloat16, cuda) == "kernel 128x128 t64 w8 s3"
    assert buffered.materialised_route(2048, 768, 3072, torch.bfloat16, cuda) == "kernel 128x128 t64 w8 s3"  # nearest T
    assert buffered.materialised_route(4, 768, 3072, torch.bfloat16, cuda) == "bmm-f32"  # the ghost is not materialised
    assert buffered.materialised_route(1024, 768, 768, torch.bfloat16, cuda) == "bmm"  # a shape it lacks
    assert buffered.materialised_route(1024, 768, 3072, torch.float32, cuda) == "bmm"  # a dtype it lacks
    assert buffered.table_method(1024, 768, 3072, torch.bfloat16, cuda) == "materialise"
    assert buffered.table_method(4, 768, 3072, torch.bfloat16, cuda) == "ghost"
    assert buffered.table_method(2048, 768, 3072, torch.bfloat16, cuda) is None  # not measured there: the shapes
    monkeypatch.setattr(linear_module, "HAS_TRITON", False)  # a kernel route needs Triton: the next exact one
    assert buffered.materialised_route(1024, 768, 3072, torch.bfloat16, cuda) == "bmm"
    assert buffered.materialised_route(1024, 768, 3072, torch.bfloat16, torch.device("cpu")) == "bmm"


def test_auto_takes_the_tables_method_and_route_without_timing(monkeypatch, tmp_path):
    """Where the card's table measured the layer's shape at its tokens per example, "auto" takes the
    table's fastest route (no timing), "materialise" its fastest materialised one, "ghost" the ghost."""
    clock = MethodRuns(monkeypatch)
    rows = [("card", "toy", "a", 4, 3, 6, 5, "float32", "bmm-f32", 0.1, 1.0, 1e-7, 1e-7),
            ("card", "toy", "a", 4, 3, 6, 5, "float32", "ghost", 0.2, 2.0, 1e-7, 1e-7)]
    cuda_table(monkeypatch, "cpu", rows, tmp_path)
    routes = []
    fn = buffered.materialised_route
    monkeypatch.setattr(linear_module, "materialised_route", lambda *a: routes.append(fn(*a)) or routes[-1])
    for mode, method in (("auto", "materialise"), ("materialise", "materialise"), ("ghost", "ghost")):
        torch.manual_seed(6)
        layer, plain = twins(PEGradNormLinear, 6, 5)
        layer.per_example_mode = mode
        clock.runs.clear()
        routes.clear()
        check(layer, plain, float_batches(2, (4, 3, 6), 5))
        assert layer.norm_method == method and len(clock.runs) == 2 and clock.clock_reads == 0
        assert routes == ([] if method == "ghost" else ["bmm-f32", "bmm-f32"])


def test_a_compiled_every_layer_gpt_takes_the_tables_routes_in_one_graph(monkeypatch, tmp_path):
    """torch.compile (fullgraph: no graph break) of a GPT whose every layer is measured takes the method
    and route the table gives each Linear shape (here the float32 cuBLAS route and the ghost norm), exact."""
    from gns_fixtures import TINY_GPT, gpt_batches, tiny_gpt, gpt_loss, sqgradnorm_sums
    from nanogns.layers.config import classes_for_flags
    T, D, V = TINY_GPT["block_size"], TINY_GPT["n_embd"], TINY_GPT["vocab_size"]
    shapes = {(D, 3 * D): "bmm-f32", (D, D): "ghost", (D, 4 * D): "bmm-f32", (4 * D, D): "bmm-f32", (D, V): "ghost"}
    rows = [("card", "tiny", "x", 2, T, K, L, "float32", route, 0.1, 1.0, 1e-7, 1e-7) for (K, L), route in shapes.items()]
    rows += [("card", "tiny", "x", 2, T, K, L, "float32", "bmm", 0.5, 5.0, 1e-7, 1e-7) for K, L in shapes]
    cuda_table(monkeypatch, "cpu", rows, tmp_path)
    methods = []  # the table's, looked up in the layers' forward (a list the traced backward may not append to)
    fn = buffered.table_method
    monkeypatch.setattr(linear_module, "table_method", lambda *a: methods.append(fn(*a)) or methods[-1])
    layers = classes_for_flags(linearclass="gns", embeddingclass="gns", lnclass="shim")
    model = tiny_gpt(**layers)
    plain = tiny_gpt(**classes_for_flags())
    plain.load_state_dict(model.state_dict())
    batches = gpt_batches(2, 2)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        for ids, targets in batches:
            (compiled(ids, targets)[1] / 2).backward()
    finally:
        torch._dynamo.reset()
    # traced: each layer's method from the table (the head's too), the materialised ones' route with it
    assert methods and set(methods) == {"ghost", "materialise"}  # None: a shape the table would not know
    assert buffered.materialised_route(T, D, 4 * D, torch.float32, torch.device("cpu")) == "bmm-f32"
    assert {m.norm_method for _, m in buffered.measured_linears(model)} == {None}  # compiled: nothing kept
    want = sqgradnorm_sums(plain, gpt_loss, batches)
    for name, _, buf, _ in find_sqgradnorm_buffers(model):
        torch.testing.assert_close(buf.double(), want[name], rtol=1e-5, atol=1e-12, msg=name)


def test_no_environment_switch_chooses_the_linear_route():
    """GNS_LINEAR_KERNEL is gone: the table chooses, and no code reads it any more."""
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    found = subprocess.run(["git", "grep", "-l", "GNS_LINEAR_KERNEL", "--", "*.py"], cwd=root,
                           capture_output=True, text=True).stdout.split()
    assert [f for f in found if not f.startswith("tests/")] == []


@pytest.mark.parametrize("numel", [100, 65536, 3 * 65536, 3 * 65536 + 7, 1_000_003])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
def test_sum_of_squares_is_precise_in_pieces(numel, dtype):
    """A float32 sum of squares over a million elements as close to the float64 one as over one
    piece of CPU_DOT_PIECE (1e-5), whole pieces and a remainder alike; a plain float32 dot over
    them all is off by ~1e-4."""
    t = (torch.randn(numel, generator=torch.Generator().manual_seed(numel)) + 0.3).to(dtype)
    got = buffered.sum_of_squares(t.view(-1, 1) if numel % 2 else t)
    assert got.dtype == torch.float32 and got.shape == ()
    torch.testing.assert_close(got.double(), t.double().square().sum(), rtol=1e-5, atol=0)


def test_all_sqgradnorm_buffers_lists_each_norm_buffer_once():
    torch.manual_seed(4)
    model = nn.Sequential(PEGradNormLinear(3, 4), nn.Linear(4, 4), PEGradNormSeparatedLayerNorm(4, bias=False))
    model[1].register_buffer("running", torch.ones(()))  # not a norm buffer
    model[0].register_buffer("shared_sqgradnorm", model[2].weight_sqgradnorm)  # one tensor in two modules
    bufs = buffered.all_sqgradnorm_buffers(model)
    want = [model[0].weight_sqgradnorm, model[0].bias_sqgradnorm, model[0].example_count,
            model[2].weight_sqgradnorm, model[2].example_count]
    assert len(bufs) == len(want) and all(b is w for b, w in zip(bufs, want))
    model(torch.randn(2, 3)).sum().backward()
    zero_sqgradnorm_buffers(model)
    assert all(float(b) == 0 for b in bufs) and float(model[1].running) == 1.0


def transposed_loss(forward, x, r):
    """A loss of the output read transposed: its gradient arrives non-contiguous."""
    return (torch.sin(forward(x).transpose(1, 2)) * r).sum()


@pytest.mark.parametrize("cls", LINEARS)
@pytest.mark.parametrize("mode", ["ghost", "materialise"])
def test_linear_noncontiguous_output_gradient(cls, mode):
    """The loss reads the output transposed, so the incoming gradient is not contiguous."""
    torch.manual_seed(2)
    layer, plain = twins(cls, 4, 3)
    layer.per_example_mode = mode
    x = torch.randn(5, 6, 4)
    r = torch.randn(5, 3, 6)
    expected = brute_force(plain, [(x, r)], transposed_loss)
    for module in (layer, plain):
        transposed_loss(module, x, r).div(5).backward()
    for n, buf in measured(layer).items():
        torch.testing.assert_close(buf, expected[n].item(), rtol=1e-5, atol=0)
    torch.testing.assert_close(layer.weight.grad, plain.weight.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls", LINEARS)
@pytest.mark.parametrize("frozen", ["weight", "bias"])
def test_linear_frozen_parameter_is_not_measured(cls, frozen):
    torch.manual_seed(3)
    layer, plain = twins(cls, 4, 3)
    getattr(layer, frozen).requires_grad_(False)
    getattr(plain, frozen).requires_grad_(False)
    check(layer, plain, float_batches(2, (3, 2, 4), 3))
    assert [n for n, *_ in find_sqgradnorm_buffers(layer)] == [{"weight": "bias", "bias": "weight"}[frozen]]
    assert getattr(layer, f"{frozen}_sqgradnorm").item() == 0


@pytest.mark.parametrize("cls", LINEARS)
def test_linear_all_frozen_and_no_grad_measure_nothing(cls):
    layer = cls(4, 3)
    x = torch.randn(2, 4, requires_grad=True)
    with torch.no_grad():
        layer(x)
    layer.requires_grad_(False)
    layer(x).sum().backward()
    assert x.grad is not None and find_sqgradnorm_buffers(layer) == []
    assert all(b.item() == 0 for b in layer.buffers())


@pytest.mark.parametrize("cls", LINEARS)
def test_linear_parametrized_weight_is_not_measured(cls):
    """Spectral norm makes the weight a computed tensor: only the bias is the layer's own."""
    layer = torch.nn.utils.parametrizations.spectral_norm(cls(4, 3))
    layer(torch.randn(2, 5, 4)).square().sum().backward()
    assert [n for n, *_ in find_sqgradnorm_buffers(layer)] == ["bias"]
    assert layer.bias_sqgradnorm.item() > 0 and layer.weight_sqgradnorm.item() == 0


# --------------------------------------------------------------------------------------------
# Embedding

@pytest.mark.parametrize("cls", EMBEDDINGS)
@pytest.mark.parametrize("num_embeddings", [3, 40])  # V <= T: dense per-example table; V > T: sorted rows
@pytest.mark.parametrize("padding_idx", [None, 1])
@pytest.mark.parametrize("shape", [(6,), (3, 5), (2, 3, 4)])
@pytest.mark.parametrize("steps", [1, 3])
def test_embedding_matches_brute_force(cls, num_embeddings, padding_idx, shape, steps):
    torch.manual_seed(4)
    layer, plain = twins(cls, num_embeddings, 6, padding_idx=padding_idx)
    batches = id_batches(steps, shape, num_embeddings, 6, padding_idx)
    with torch.no_grad():
        assert torch.equal(layer(batches[0][0]), plain(batches[0][0]))
    check(layer, plain, batches)
    if padding_idx is not None:
        assert layer.weight.grad[padding_idx].abs().sum() == 0


def test_embedding_rows_on_cuda_are_added_without_index_add(monkeypatch):
    """On CUDA the rows are added by index_put_(accumulate=True), which sorts and adds in order, never by
    index_add_, whose CUDA kernel adds with atomics in no fixed order (the shapes rule promises runs that
    agree bit for bit). Shown on the CPU with the tensors taken for CUDA ones."""
    import nanogns.layers.embedding as embedding_module
    torch.manual_seed(6)
    src, index = torch.randn(40, 5), torch.randint(0, 7, (40,))
    expected = torch.zeros(7, 5).index_add_(0, index, src)

    def no_index_add(*args, **kwargs):
        raise AssertionError("index_add_ called: its CUDA sums are not repeatable")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.Tensor, "index_add_", no_index_add)
    torch.testing.assert_close(embedding_module._rows_added(7, index, src), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("cls", EMBEDDINGS)
def test_cuda_embedding_backward_repeats_bit_for_bit(cls):
    """Many positions of many examples on few rows: the sums that atomics would reorder."""
    torch.manual_seed(7)
    layer = cls(50, 256).cuda()
    ids = torch.randint(0, 50, (16, 512), device="cuda")
    dy = torch.randn(16, 512, 256, device="cuda")
    results = []
    for _ in range(20):
        layer.zero_grad()
        zero_sqgradnorm_buffers(layer)
        layer(ids).backward(dy)
        results.append((layer.weight_sqgradnorm.clone(), layer.weight.grad.clone()))
    for sq, grad in results[1:]:
        assert torch.equal(sq, results[0][0]) and torch.equal(grad, results[0][1])


@pytest.mark.parametrize("cls", EMBEDDINGS)
def test_embedding_noncontiguous_gradient_and_frozen(cls):
    torch.manual_seed(5)
    layer, plain = twins(cls, 9, 4)
    ids = torch.randint(0, 9, (3, 5))
    r = torch.randn(3, 4, 5)
    expected = brute_force(plain, [(ids, r)], transposed_loss)["weight"].item()
    for module in (layer, plain):
        transposed_loss(module, ids, r).div(3).backward()
    torch.testing.assert_close(layer.weight_sqgradnorm.item(), expected, rtol=1e-5, atol=0)
    torch.testing.assert_close(layer.weight.grad, plain.weight.grad, rtol=1e-6, atol=1e-7)
    layer.weight.requires_grad_(False)
    zero_sqgradnorm_buffers(layer)
    layer(ids).sum()  # frozen: plain lookup, nothing measured or reported
    assert find_sqgradnorm_buffers(layer) == [] and layer.example_count.item() == 0


def test_embedding_rejects_what_it_cannot_measure():
    with pytest.raises(ValueError):
        PEGradNormEmbedding(5, 3, sparse=True)
    with pytest.raises(ValueError):
        PEGradNormShimEmbedding(5, 3, scale_grad_by_freq=True)


@pytest.mark.parametrize("cls", EMBEDDINGS)
def test_embedding_max_norm_like_torch(cls):
    torch.manual_seed(6)
    layer, plain = twins(cls, 7, 4, max_norm=1.0)
    batches = id_batches(1, (3, 4), 7, 4)
    run(layer, batches)
    run(plain, batches)
    torch.testing.assert_close(layer.weight.detach(), plain.weight.detach())  # rows renormalised alike
    assert torch.equal(layer.weight.grad, plain.weight.grad)
    renormed = nn.Embedding(7, 4)  # vmap cannot renormalise in place: brute force on the renormalised rows
    renormed.load_state_dict(plain.state_dict())
    expected = brute_force(renormed, batches)["weight"].item()
    torch.testing.assert_close(layer.weight_sqgradnorm.item(), expected, rtol=1e-5, atol=0)


# --------------------------------------------------------------------------------------------
# LayerNorm

@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(5, 6), (3, 4, 6), (2, 2, 3, 6)])
@pytest.mark.parametrize("steps", [1, 2])
def test_layernorm_matches_brute_force(bias, shape, steps):
    torch.manual_seed(7)
    layer, plain = twins(PEGradNormSeparatedLayerNorm, 6, bias=bias)
    batches = float_batches(steps, shape, 6)
    check(layer, plain, batches)
    assert ("bias_sqgradnorm" in layer._buffers) == bias


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [True, False])
def test_layernorm_output_and_input_gradient_are_torchs_own(dtype, bias):
    """Bit-identical output and dx, in float32 and under autocast."""
    torch.manual_seed(15)
    layer, plain = twins(PEGradNormSeparatedLayerNorm, 6, bias=bias)
    x = torch.randn(3, 4, 6, dtype=dtype or torch.float32)
    r = torch.randn(3, 4, 6)
    grads = []
    for module in (layer, plain):
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            y = module(xi)
        example_loss(y, r).backward()
        grads.append((y.detach(), xi.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


@pytest.mark.parametrize("cls,args,x", [
    (PEGradNormLinear, (6, 3), torch.randn(6)), (PEGradNormShimLinear, (6, 3), torch.randn(6)),
    (PEGradNormEmbedding, (5, 3), torch.tensor(2)), (PEGradNormShimEmbedding, (5, 3), torch.tensor(2)),
    (PEGradNormSeparatedLayerNorm, (6,), torch.randn(6)),
    (PEGradNormSeparatedLayerNorm, ((3, 4),), torch.randn(3, 4)),
    (PEGradNormSeparatedRMSNorm, (6,), torch.randn(6)), (PEGradNormSeparatedRMSNorm, ((3, 4),), torch.randn(3, 4))])
def test_unbatched_input_is_one_example(cls, args, x):
    # torch's layers take an input without a batch dimension: one example, whose norm is the
    # whole gradient's
    torch.manual_seed(16)
    layer, plain = twins(cls, *args)
    r = torch.randn(plain(x).shape)
    example_loss(layer(x), r).backward()
    example_loss(plain(x), r).backward()
    for n, p, buf, count in find_sqgradnorm_buffers(layer):
        assert count.item() == 1
        q = dict(plain.named_parameters())[n]
        torch.testing.assert_close(buf.item(), q.grad.double().square().sum().item(), rtol=1e-5, atol=0)
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_shim_linear_half_bias_sums_beyond_float16_range():
    # float16, T = 64 rows of dy ~ 2000 each: an example's bias gradient (~1.3e5) is past
    # float16's largest value (65504), so its sum over t must be taken in float32
    torch.manual_seed(17)
    layer = PEGradNormShimLinear(4, 3).half()
    x = torch.randn(2, 64, 4).half()
    y = layer(x)
    y.backward(torch.full(y.shape, 2000.0, dtype=torch.float16))
    expected = 2 * 3 * (64 * 2000.0) ** 2  # two examples, three outputs, each summing 64 x 2000
    assert torch.isfinite(layer.bias_sqgradnorm)
    torch.testing.assert_close(layer.bias_sqgradnorm.item(), expected, rtol=1e-6, atol=0)


def test_layernorm_multidimensional_normalized_shape():
    torch.manual_seed(8)
    layer, plain = twins(PEGradNormSeparatedLayerNorm, (3, 4))
    check(layer, plain, float_batches(2, (2, 5, 3, 4), 4))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CPU autocast leaves layer_norm alone)")
def test_layernorm_under_cuda_autocast_like_torch():
    # CUDA autocast runs layer_norm in float32 on a bfloat16 input (as after a Linear): so must
    # the separated LayerNorm, in forward and backward, and its norms are those of float32 maths
    torch.manual_seed(18)
    layer, plain = twins(PEGradNormSeparatedLayerNorm, 64)
    reference = PLAIN[PEGradNormSeparatedLayerNorm](64)
    reference.load_state_dict(plain.state_dict())
    layer, plain = layer.cuda(), plain.cuda()
    x = torch.randn(4, 8, 64, device="cuda")
    r = torch.randn(4, 8, 64, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        h = nn.functional.linear(x, torch.eye(64, device="cuda"))
        y, y_plain = layer(h), plain(h)
    assert h.dtype == torch.bfloat16 and y.dtype == y_plain.dtype == torch.float32
    torch.testing.assert_close(y, y_plain)
    (example_loss(y, r) / 4).backward()
    (example_loss(y_plain, r) / 4).backward()
    torch.testing.assert_close(layer.weight.grad, plain.weight.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.bias.grad, plain.bias.grad, rtol=1e-5, atol=1e-6)
    expected = brute_force(reference, [(h.float().cpu(), r.cpu())])
    got = measured(layer)
    for n in ("weight", "bias"):
        torch.testing.assert_close(got[n], expected[n].item(), rtol=1e-4, atol=0)
    assert layer.example_count.item() == 4


@pytest.mark.parametrize("frozen", ["weight", "bias"])
def test_layernorm_frozen_parameter_is_not_measured(frozen):
    torch.manual_seed(9)
    layer, plain = twins(PEGradNormSeparatedLayerNorm, 5)
    getattr(layer, frozen).requires_grad_(False)
    getattr(plain, frozen).requires_grad_(False)
    check(layer, plain, float_batches(2, (3, 2, 5), 5))
    assert len(find_sqgradnorm_buffers(layer)) == 1


def test_layernorm_without_affine_is_plain():
    layer = PEGradNormSeparatedLayerNorm(4, elementwise_affine=False)
    x = torch.randn(2, 3, 4)
    assert torch.equal(layer(x), nn.LayerNorm(4, elementwise_affine=False)(x))
    assert find_sqgradnorm_buffers(layer) == []


def test_every_normalisation_runs_normgnorms_one_function():
    """One autograd Function per normalisation: the separated and the fused layers, normgnorm's
    layer_norm and rms_norm and the reference's PEGLayerNorm all run normgnorm._NormFn, and
    PEGLayerNorm is an adapter onto it, not a Function of its own; the layers define none."""
    import nanogns.layers.norms as norms
    import nanogns.normgnorm as normgnorm
    torch.manual_seed(27)
    x = torch.randn(2, 3, 8, requires_grad=True)
    w, b = torch.ones(8, requires_grad=True), torch.zeros(8, requires_grad=True)
    zero = lambda: torch.zeros(())  # noqa: E731
    outputs = [cls(8)(x) for cls in (PEGradNormSeparatedLayerNorm, PEGradNormSeparatedRMSNorm,
                                     buffered.PEGradNormFusedLayerNorm, buffered.PEGradNormFusedRMSNorm)]
    outputs += [normgnorm.layer_norm(x, w, b, zero(), zero(), zero()), normgnorm.rms_norm(x, w, zero(), zero()),
                normgnorm.PEGLayerNorm.apply(x, w, b, torch.zeros(2), torch.zeros(2), (8,), 1e-5)]
    assert [type(y.grad_fn).__name__ for y in outputs] == ["_NormFnBackward"] * len(outputs)
    functions = [name for module in (norms, normgnorm) for name, value in vars(module).items()
                 if isinstance(value, type) and issubclass(value, torch.autograd.Function)]
    assert functions == ["_NormFn"]


# torch's order, nanoGPT's and the reference's (ndim, bias), and keywords: (args, kwargs, eps, bias)
LAYERNORM_CALLS = [
    ((8,), {}, 1e-5, True),
    ((8, True), {}, 1e-5, True),
    ((8, False), {}, 1e-5, False),
    ((8,), dict(bias=False), 1e-5, False),
    ((8, 1e-3), {}, 1e-3, True),
    ((8, 0), {}, 0.0, True),  # an int second argument is torch's eps, as nn.LayerNorm(8, 0) takes it
    ((8, 1e-3, True, False), {}, 1e-3, False),
    ((8,), dict(eps=1e-3, bias=False), 1e-3, False),
    ((8, False), dict(eps=1e-3), 1e-3, False),
    ((), dict(normalized_shape=8, bias=False), 1e-5, False),
]
BAD_LAYERNORM_CALLS = [
    ((8, True), dict(bias=False)),  # bias twice
    ((8, 1e-3), dict(eps=1e-4)),  # eps twice
    ((8, True, 1e-5), {}),  # (ndim, bias) takes nothing more by position
    ((8, 1e-5, True, True, None, None, 1), {}),  # more than torch's six
    ((8,), dict(eps=True)),  # a bool eps is a misplaced bias
    ((8,), dict(ndim=8)),
    ((), dict(bias=True)),
]


@pytest.mark.parametrize("cls", [buffered.LayerNorm, PEGradNormSeparatedLayerNorm])
@pytest.mark.parametrize("args,kwargs,eps,bias", LAYERNORM_CALLS)
def test_layernorm_takes_torchs_and_the_references_arguments(cls, args, kwargs, eps, bias):
    layer = cls(*args, **kwargs)
    assert layer.eps == eps and layer.normalized_shape == (8,) and isinstance(layer, nn.LayerNorm)
    params = dict(layer.named_parameters())
    assert list(params) == (["weight", "bias"] if bias else ["weight"])
    assert torch.equal(params["weight"], torch.ones(8))
    if bias:
        assert torch.equal(params["bias"], torch.zeros(8))
    assert ("bias_sqgradnorm" in layer._buffers) == (bias and cls is PEGradNormSeparatedLayerNorm)


@pytest.mark.parametrize("cls", [buffered.LayerNorm, PEGradNormSeparatedLayerNorm])
def test_layernorm_takes_torchs_other_arguments(cls):
    layer = cls((2, 4), 1e-6, elementwise_affine=True, bias=False, dtype=torch.float64)
    assert layer.normalized_shape == (2, 4) and layer.weight.dtype == torch.float64 and layer.bias is None
    plain = cls(4, elementwise_affine=False)
    assert plain.weight is None and plain.bias is None


@pytest.mark.parametrize("cls", [buffered.LayerNorm, PEGradNormSeparatedLayerNorm])
@pytest.mark.parametrize("args,kwargs", BAD_LAYERNORM_CALLS)
def test_layernorm_contradictory_or_unknown_arguments_are_one_line_errors(cls, args, kwargs):
    with pytest.raises(TypeError, match=cls.__name__) as error:
        cls(*args, **kwargs)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("bias", [True, False])
def test_plain_layernorm_is_nanogpts(bias):
    """buffered.LayerNorm(ndim, bias): nanoGPT's unmeasured LayerNorm, the same output and keys."""
    torch.manual_seed(19)
    layer = buffered.LayerNorm(6, bias)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_()
    x = torch.randn(2, 3, 6)
    assert torch.equal(layer(x), F.layer_norm(x, (6,), layer.weight, layer.bias, 1e-5))
    assert list(layer.state_dict()) == (["weight", "bias"] if bias else ["weight"])
    assert dict(layer.named_buffers()) == {}


# --------------------------------------------------------------------------------------------
# RMSNorm

@pytest.mark.parametrize("eps", [None, 1e-6])
@pytest.mark.parametrize("shape", [(5, 6), (3, 4, 6), (2, 2, 3, 6)])
@pytest.mark.parametrize("steps", [1, 2])
def test_rmsnorm_matches_brute_force(eps, shape, steps):
    torch.manual_seed(26)
    layer, plain = twins(PEGradNormSeparatedRMSNorm, 6, eps=eps)
    check(layer, plain, float_batches(steps, shape, 6))  # and .grad is torch's to the bit (SHIMS)


@pytest.mark.parametrize("dtype,x_scale", [(torch.float32, 1e-4), (torch.float64, 1e-9)])
@pytest.mark.parametrize("eps", [None, 1e-6])
def test_rmsnorm_rows_with_tiny_mean_square(dtype, x_scale, eps):
    """mean(x^2) far below eps (None: torch's machine epsilon of the computation type, 1.2e-7 in
    float32 and 2.2e-16 in float64), so that eps sets most of rstd: a layer that dropped it or
    took another default would be off by a factor of several."""
    torch.manual_seed(27)
    layer, plain = twins(PEGradNormSeparatedRMSNorm, 6, eps=eps, dtype=dtype)
    batches = [(x * x_scale, r) for x, r in float_batches(2, (3, 4, 6), 6, dtype=dtype)]
    check(layer, plain, batches)


def test_rmsnorm_multidimensional_normalized_shape():
    torch.manual_seed(29)
    layer, plain = twins(PEGradNormSeparatedRMSNorm, (3, 4), eps=1e-5)
    check(layer, plain, float_batches(2, (2, 5, 3, 4), 4))


@pytest.mark.filterwarnings("ignore:Mismatch dtype")  # torch's, for a half input and float32 weights
@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("eps", [None, 1e-5])
def test_rmsnorm_output_and_gradients_are_torchs_own(dtype, eps):
    """Bit-identical output, dx and .grad, whatever the input's dtype (a half one as a Linear
    under autocast gives it), and the norms within the autocast tolerance of float32 brute force
    on the same input values."""
    torch.manual_seed(28)
    layer, plain = twins(PEGradNormSeparatedRMSNorm, 6, eps=eps)
    batches = [(x.to(dtype or torch.float32), r) for x, r in float_batches(2, (4, 3, 6), 6)]
    for module in (layer, plain):
        outputs = []
        for x, r in batches:
            xi = x.clone().requires_grad_()
            y = module(xi)
            (example_loss(y, r) / 8).backward()
            outputs.append((y.detach(), xi.grad))
        module.outputs = outputs
    for (y, dx), (y_plain, dx_plain) in zip(layer.outputs, plain.outputs):
        assert torch.equal(y, y_plain) and torch.equal(dx, dx_plain)
    assert torch.equal(layer.weight.grad, plain.weight.grad)
    reference = nn.RMSNorm(6, eps=eps)  # float32 maths on the very values the layer saw
    reference.load_state_dict(plain.state_dict())
    expected = brute_force(reference, [(x.float(), r) for x, r in batches])["weight"]
    rtol = AUTOCAST_RTOL.get(dtype, 1e-5)
    torch.testing.assert_close(layer.weight_sqgradnorm.double(), expected, rtol=rtol, atol=0)
    assert layer.weight_sqgradnorm.dtype == torch.float32 and layer.example_count.item() == 8


@pytest.mark.slow
def test_rmsnorm_compiles_in_one_graph_like_eager():
    """torch.compile (fullgraph: no graph break) keeps the tap's buffer updates: the same
    gradients and buffers as eager over two micro-steps."""
    torch._dynamo.reset()
    torch.manual_seed(30)
    layer, _ = twins(PEGradNormSeparatedRMSNorm, 6)
    twin = deepcopy(layer)
    batches = float_batches(2, (3, 4, 6), 6)
    run(layer, batches)
    run(torch.compile(twin, backend="aot_eager", fullgraph=True), batches)
    assert torch.equal(twin.weight.grad, layer.weight.grad) and twin.example_count.item() == 6
    torch.testing.assert_close(twin.weight_sqgradnorm, layer.weight_sqgradnorm, rtol=1e-6, atol=0)
    assert layer.weight_sqgradnorm.item() > 0
    torch._dynamo.reset()


def test_rmsnorm_frozen_without_affine_or_without_grad_measures_nothing():
    frozen, plain = PEGradNormSeparatedRMSNorm(4), PEGradNormSeparatedRMSNorm(4, elementwise_affine=False)
    frozen.weight.requires_grad_(False)
    x = torch.randn(2, 3, 4, requires_grad=True)
    for layer in (frozen, plain):
        y = layer(x)
        assert torch.equal(y, F.rms_norm(x, (4,), layer.weight))
        (y * torch.randn_like(y)).sum().backward()
        assert find_sqgradnorm_buffers(layer) == [] and layer.example_count.item() == 0
    measured_layer = PEGradNormSeparatedRMSNorm(4)
    with torch.no_grad():
        assert torch.equal(measured_layer(x), F.rms_norm(x, (4,), measured_layer.weight))
    assert measured_layer.example_count.item() == 0


# torch's nn.RMSNorm arguments, by position and keyword: (args, kwargs, eps, elementwise_affine)
RMSNORM_CALLS = [((8,), {}, None, True), ((8, 1e-6), {}, 1e-6, True), ((8, None, False), {}, None, False),
                 ((), dict(normalized_shape=8, eps=1e-3, elementwise_affine=True), 1e-3, True)]


@pytest.mark.parametrize("args,kwargs,eps,affine", RMSNORM_CALLS)
def test_rmsnorm_takes_torchs_arguments(args, kwargs, eps, affine):
    layer, plain = PEGradNormSeparatedRMSNorm(*args, **kwargs), nn.RMSNorm(*args, **kwargs)
    assert isinstance(layer, nn.RMSNorm) and layer.eps == plain.eps == eps and layer.normalized_shape == (8,)
    assert repr(layer) == repr(plain).replace("RMSNorm", "PEGradNormSeparatedRMSNorm")
    assert list(layer.state_dict()) == list(plain.state_dict()) == (["weight"] if affine else [])
    assert ("weight_sqgradnorm" in layer._buffers) == affine
    other = PEGradNormSeparatedRMSNorm((2, 4), 1e-6, True, None, torch.float64)
    assert other.weight.dtype == torch.float64 and other.normalized_shape == (2, 4)


# --------------------------------------------------------------------------------------------
# Drop-in properties

ALL = [(PEGradNormLinear, (5, 3)), (PEGradNormShimLinear, (5, 3)), (PEGradNormEmbedding, (5, 3)),
       (PEGradNormShimEmbedding, (5, 3)), (PEGradNormSeparatedLayerNorm, (5,)), (PEGradNormSeparatedRMSNorm, (5,))]


@pytest.mark.parametrize("cls,args", ALL)
@pytest.mark.parametrize("bias", [True, False])
def test_state_dict_round_trips_with_torch_layers(cls, args, bias):
    kwargs = bias_kwargs(cls, bias)
    layer, plain = cls(*args, **kwargs), PLAIN[cls](*args, **kwargs)
    assert layer.state_dict().keys() == plain.state_dict().keys()
    assert isinstance(layer, PLAIN[cls])
    layer.load_state_dict(plain.state_dict())
    plain.load_state_dict(layer.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(layer.state_dict().values(), plain.state_dict().values()))


@pytest.mark.parametrize("cls,args", ALL)
def test_buffers_stay_float32_through_casts(cls, args):
    layer = cls(*args)
    layer.example_count.fill_(3.0)
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        layer.to(dtype)
        assert all(b.dtype == torch.float32 for b in layer.buffers())
        assert layer.weight.dtype == dtype
    layer.half()
    assert all(b.dtype == torch.float32 for b in layer.buffers()) and layer.example_count.item() == 3.0


@pytest.mark.parametrize("cls,args", ALL)
def test_half_parameters_with_a_large_loss_scale(cls, args):
    """model.half() and a float16 loss scale of 65536: the buffers are float32, finite, and
    hold s^2 times the brute-force value (computed in float32 from the same half values)."""
    torch.manual_seed(10)
    scale = 65536.0
    layer = cls(*args).half()
    plain = PLAIN[cls](*args)
    plain.load_state_dict({k: v.float() for k, v in layer.state_dict().items()})
    if PLAIN[cls] is nn.Embedding:
        batches = id_batches(2, (4, 3), args[0], args[1])
    else:
        batches = [(x.half().float(), r) for x, r in float_batches(2, (4, 3, args[0]), args[-1], r_scale=0.05)]
    expected = brute_force(plain, batches)
    half_batches = [(x.half() if x.is_floating_point() else x, r) for x, r in batches]
    run(layer, half_batches, scale=scale)
    for n, p, buf, _ in find_sqgradnorm_buffers(layer):
        assert buf.dtype == torch.float32 and torch.isfinite(buf) and torch.isfinite(p.grad).all()
        torch.testing.assert_close(buf.item() / scale ** 2, expected[n].item(), rtol=2e-2, atol=0)


# Under autocast the per-example gradients are computed in the low-precision dtype, so the
# norms match the float32 brute force only to that dtype's precision: bfloat16 (8-bit
# mantissa) within 3%, float16 (11-bit) within 0.5%.
AUTOCAST_RTOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3}


@pytest.mark.parametrize("cls,args", ALL)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [1.0, 65536.0])
def test_autocast(cls, args, dtype, scale):
    torch.manual_seed(11)
    layer, plain = twins(cls, *args)
    if PLAIN[cls] is nn.Embedding:
        batches = id_batches(2, (4, 3), args[0], args[1])
    else:
        batches = float_batches(2, (4, 3, args[0]), args[-1], r_scale=0.05)
    expected = brute_force(plain, batches)
    run(layer, batches, scale=scale, autocast=dtype)
    run(plain, batches, scale=scale, autocast=dtype)
    for n, p, buf, _ in find_sqgradnorm_buffers(layer):
        assert buf.dtype == torch.float32 and torch.isfinite(buf)
        torch.testing.assert_close(buf.item() / scale ** 2, expected[n].item(), rtol=AUTOCAST_RTOL[dtype], atol=0)
    for p, q in zip(layer.parameters(), plain.parameters()):
        if isinstance(layer, SHIMS):
            assert torch.equal(p.grad, q.grad)
        else:
            torch.testing.assert_close(p.grad, q.grad, rtol=AUTOCAST_RTOL[dtype], atol=1e-2 * q.grad.abs().max().item())
    with torch.autocast("cpu", dtype=dtype), torch.no_grad():
        x = batches[0][0]
        assert layer(x).dtype == plain(x).dtype


@pytest.mark.parametrize("cls,args", ALL)
def test_zero_and_accumulate(cls, args):
    torch.manual_seed(12)
    layer = cls(*args)
    x = torch.randint(0, 5, (3, 2)) if PLAIN[cls] is nn.Embedding else torch.randn(3, 2, 5)
    layer(x).square().sum().backward()
    first = [b.item() for *_, b, _ in find_sqgradnorm_buffers(layer)]
    layer(x).square().sum().backward()
    assert [b.item() for *_, b, _ in find_sqgradnorm_buffers(layer)] == pytest.approx([2 * f for f in first])
    assert layer.example_count.item() == 6
    zero_sqgradnorm_buffers(layer)
    assert all(b.item() == 0 for b in layer.buffers())


# --------------------------------------------------------------------------------------------
# Tied embedding / output head

class TiedLM(nn.Module):
    """ids -> embedding -> tanh(Linear) -> head tied to the embedding (a GPT in miniature).
    head_only: the embedding's output is detached, so the tied weight learns through the head
    alone; head_first: the head is declared (and found by modules()) before the embedding."""

    def __init__(self, Embedding, Head, V=11, D=4, last_only=False, flat=False, padding_idx=None,
                 head_only=False, head_first=False):
        super().__init__()
        if head_first:
            self.head = Head(D, V, bias=False)
        self.wte = Embedding(V, D, padding_idx=padding_idx)
        self.mix = nn.Linear(D, D)
        if not head_first:
            self.head = Head(D, V, bias=False)
        tie_weights(self.wte, self.head)
        self.last_only, self.flat, self.head_only = last_only, flat, head_only

    def forward(self, ids):
        e = self.wte(ids)
        h = torch.tanh(self.mix(e.detach() if self.head_only else e))
        if self.last_only:
            h = h[:, [-1], :]
        return self.head(h)


@pytest.mark.parametrize("Embedding", EMBEDDINGS)
@pytest.mark.parametrize("Head", LINEARS)
@pytest.mark.parametrize("mode", ["ghost", "materialise"])
@pytest.mark.parametrize("variant", ["full", "last_only", "flat", "chunked"])
def test_tied_weight_norm_includes_the_cross_term(Embedding, Head, mode, variant):
    torch.manual_seed(13)
    model = TiedLM(Embedding, Head, last_only=variant == "last_only")
    plain = TiedLM(nn.Embedding, nn.Linear, last_only=variant == "last_only")
    plain.load_state_dict(model.state_dict())
    model.head.per_example_mode = mode
    if variant == "chunked":  # one example at a time: the head's cross-term factor comes in pieces
        model.head.max_chunk_numel = 1
    shape = (6,) if variant == "flat" else (3, 5)
    out_shape = (3, 1, 11) if variant == "last_only" else (*shape, 11)
    batches = [(torch.randint(0, 11, shape), torch.randn(out_shape)) for _ in range(2)]
    expected = brute_force(plain, batches)
    run(model, batches)
    got = measured(model)
    assert set(got) == {"wte.weight"}  # the tied weight once, under its first name; mix is plain
    torch.testing.assert_close(got["wte.weight"], expected["wte.weight"].item(), rtol=1e-5, atol=0)
    assert model.wte.example_count.item() == 2 * shape[0]
    assert not model.head._tie  # nothing left behind for the next forward


@pytest.mark.parametrize("Embedding", EMBEDDINGS)
@pytest.mark.parametrize("Head", LINEARS)
@pytest.mark.parametrize("mode", ["ghost", "materialise"])
@pytest.mark.parametrize("variant", ["padding", "head_only", "head_first"])
def test_tied_weight_other_arrangements(Embedding, Head, mode, variant):
    # padding: the padding row gets no gradient from the embedding, only from the head, which
    # changes the cross term; head_only: the embedding's backward runs with no output gradient
    # of its own; head_first: the tied weight is met first in the head
    torch.manual_seed(15)
    options = dict(padding_idx=1 if variant == "padding" else None, head_only=variant == "head_only",
                   head_first=variant == "head_first")
    model, plain = TiedLM(Embedding, Head, **options), TiedLM(nn.Embedding, nn.Linear, **options)
    plain.load_state_dict(model.state_dict())
    model.head.per_example_mode = mode
    batches = []
    for _ in range(2):
        ids = torch.randint(0, 11, (3, 5))
        ids.view(-1)[::4] = 1  # in the "padding" variant, the padding id
        batches.append((ids, torch.randn(3, 5, 11)))
    expected = brute_force(plain, batches)
    run(model, batches)
    got = measured(model)
    name = "head.weight" if variant == "head_first" else "wte.weight"
    assert set(got) == {name} and "weight_sqgradnorm" not in model.head._buffers
    torch.testing.assert_close(got[name], expected[name].item(), rtol=1e-5, atol=0)
    assert model.wte.example_count.item() == 6


def test_tied_embedding_forward_under_no_grad_drops_its_link():
    model = TiedLM(PEGradNormEmbedding, PEGradNormLinear)
    ids = torch.randint(0, 11, (3, 5))
    model.wte(ids)
    with torch.no_grad():
        model.wte(ids)
    assert "link" not in model.wte._tie


@pytest.mark.parametrize("Embedding,Head", [(PEGradNormEmbedding, nn.Linear), (nn.Embedding, PEGradNormShimLinear)])
def test_tied_weight_with_a_plain_side_is_not_reported(Embedding, Head):
    buffers_module._warned.clear()
    with pytest.warns(UserWarning, match="tied weight"):
        model = TiedLM(Embedding, Head)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TiedLM(Embedding, Head)  # once only
    model(torch.randint(0, 11, (2, 3))).sum().backward()
    assert find_sqgradnorm_buffers(model) == []


def test_tied_forward_without_backward_leaves_nothing_behind():
    torch.manual_seed(14)
    model = TiedLM(PEGradNormEmbedding, PEGradNormLinear)
    plain = TiedLM(nn.Embedding, nn.Linear)
    plain.load_state_dict(model.state_dict())
    ids = torch.randint(0, 11, (3, 5))
    model(ids)  # grad enabled, output dropped, no backward
    with torch.no_grad():
        model(ids)
    model.wte(ids)  # embedding alone: its link is dropped by the next embedding forward
    assert all(b.item() == 0 for b in model.buffers())
    batches = [(ids, torch.randn(3, 5, 11))]
    expected = brute_force(plain, batches)
    run(model, batches)
    torch.testing.assert_close(measured(model)["wte.weight"], expected["wte.weight"].item(), rtol=1e-5, atol=0)


def test_tied_head_with_mismatched_examples_is_an_error():
    model = TiedLM(PEGradNormEmbedding, PEGradNormLinear)
    h = model.wte(torch.randint(0, 11, (3, 5)))
    with pytest.raises(ValueError, match="tied output head"):
        model.head(h.reshape(15, 4))


# --------------------------------------------------------------------------------------------
# Property test over random shapes, dtypes, bias and accumulation steps

@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(["gns", "shim", "ln", "rms"]), B=st.integers(1, 4), T=st.integers(1, 5),
       K=st.integers(1, 6), L=st.integers(1, 6), bias=st.booleans(), steps=st.integers(1, 3),
       dtype=st.sampled_from([torch.float32, torch.float64]), mode=st.sampled_from(buffered.PER_EXAMPLE_MODES))
def test_property_linear_and_layernorm(kind, B, T, K, L, bias, steps, dtype, mode):
    torch.manual_seed(B * 1000 + T * 100 + K * 10 + L)
    if kind == "ln":
        K = L = max(K, 2)  # one feature normalises to rounding noise times 1/sqrt(eps)
        layer, plain = twins(PEGradNormSeparatedLayerNorm, K, bias=bias, dtype=dtype)
    elif kind == "rms":
        L = K
        layer, plain = twins(PEGradNormSeparatedRMSNorm, K, dtype=dtype)
    else:
        layer, plain = twins(PEGradNormLinear if kind == "gns" else PEGradNormShimLinear, K, L, bias=bias,
                             dtype=dtype)
        layer.per_example_mode = mode
    check(layer, plain, float_batches(steps, (B, T, K), L, dtype=dtype), grad_exact=kind in ("shim", "rms"))


@settings(max_examples=25, deadline=None)
@given(cls=st.sampled_from(EMBEDDINGS), B=st.integers(1, 4), T=st.integers(1, 6), V=st.integers(1, 12),
       D=st.integers(1, 5), steps=st.integers(1, 3), padding=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.float64]))
def test_property_embedding(cls, B, T, V, D, steps, padding, dtype):
    torch.manual_seed(B * 1000 + T * 100 + V * 10 + D)
    padding_idx = V - 1 if padding else None
    layer, plain = twins(cls, V, D, padding_idx=padding_idx, dtype=dtype)
    check(layer, plain, id_batches(steps, (B, T), V, D, padding_idx))


@settings(max_examples=15, deadline=None)
@given(Embedding=st.sampled_from(EMBEDDINGS), Head=st.sampled_from(LINEARS), B=st.integers(1, 3),
       T=st.integers(1, 5), V=st.integers(1, 9), D=st.integers(1, 4), steps=st.integers(1, 2),
       mode=st.sampled_from(buffered.PER_EXAMPLE_MODES))
def test_property_tied(Embedding, Head, B, T, V, D, steps, mode):
    """The tied weight's exact per-example norm, any shapes and methods, computed in float64 (the
    sums kept in float32 buffers: 1e-6): the ghost norm's sum over token pairs can cancel to far
    below its terms, which float32 arithmetic rounds (by 1.7e-5 of the result at B=1, T=4, V=1,
    D=2), so a float32 model would test that rounding, not the formula."""
    torch.manual_seed(B * 1000 + T * 100 + V * 10 + D)
    model, plain = TiedLM(Embedding, Head, V, D).double(), TiedLM(nn.Embedding, nn.Linear, V, D).double()
    plain.load_state_dict(model.state_dict())
    model.head.per_example_mode = mode
    batches = [(torch.randint(0, V, (B, T)), torch.randn(B, T, V, dtype=torch.float64)) for _ in range(steps)]
    expected = brute_force(plain, batches)
    run(model, batches)
    torch.testing.assert_close(measured(model)["wte.weight"], expected["wte.weight"].item(), rtol=1e-6, atol=1e-15)


# --------------------------------------------------------------------------------------------
# The reference implementation's names

def pegsqnorms(layer):
    """{parameter name: layer.{name}_pegsqnorm()} for the parameters it has."""
    return {n: getattr(layer, f"{n}_pegsqnorm")() for n, _ in layer.named_parameters()}


@pytest.mark.parametrize("cls,args", ALL)
@pytest.mark.parametrize("bias", [True, False])
def test_pegsqnorm_accessors_match_brute_force(cls, args, bias):
    # two micro-steps of a mean loss over N = 6 examples: sum * count = N sum_b ||g_b / N||^2
    # = (1/N) sum_b ||g_b||^2, the reference's weight_pegsqnorm()
    torch.manual_seed(20)
    kwargs = bias_kwargs(cls, bias)
    layer, plain = twins(cls, *args, **kwargs)
    if PLAIN[cls] is nn.Embedding:
        batches = id_batches(2, (3, 4), args[0], args[1])
    else:
        batches = float_batches(2, (3, 4, args[0]), args[-1])
    expected = brute_force(plain, batches)
    run(layer, batches)
    got = pegsqnorms(layer)
    assert set(got) == set(expected)
    for n, value in got.items():
        assert value.dtype == torch.float32 and value.dim() == 0
        torch.testing.assert_close(value.double(), 6 * expected[n], rtol=1e-5, atol=0)
    if cls is PEGradNormSeparatedLayerNorm:  # the reference kept them on a submodule .affine
        assert layer.affine is layer and layer.affine.weight is layer.weight
        assert pegsqnorms(layer.affine) == got


@pytest.mark.parametrize("bias", [True, False])
def test_reference_self_test_as_written_for_it(bias):
    """The reference's own check of its shim Linear, as its users write it: positional bias, new
    Parameters assigned, a summed loss, and weight_pegsqnorm() against B times the sum of the
    squared gradients of single-example backward passes."""
    torch.manual_seed(25)
    linear = nn.Linear(3, 4, bias=bias)
    shim = PEGradNormShimLinear(3, 4, bias)
    with torch.no_grad():
        shim.weight = nn.Parameter(linear.weight.clone())
        if bias:
            shim.bias = nn.Parameter(linear.bias.clone())
    x = torch.randn(2, 2, 3)
    g = torch.randn(2, 2, 4)
    shim(x).backward(g)
    # the reference's own oracle, kept as it wrote it: single-example backward passes of torch's Linear
    want = dict(weight=0.0, bias=0.0)
    for i in range(2):
        linear.zero_grad()
        linear(x[[i]]).backward(g[[i]])
        for n, p in linear.named_parameters():
            want[n] += 2 * p.grad.square().sum()
    torch.testing.assert_close(shim.weight_pegsqnorm(), want["weight"], rtol=1e-5, atol=0)
    if bias:
        torch.testing.assert_close(shim.bias_pegsqnorm(), want["bias"], rtol=1e-5, atol=0)


@pytest.mark.parametrize("Embedding", EMBEDDINGS)
@pytest.mark.parametrize("Head", LINEARS)
def test_pegsqnorm_of_a_tied_weight_is_the_embeddings(Embedding, Head):
    torch.manual_seed(21)
    model, plain = TiedLM(Embedding, Head), TiedLM(nn.Embedding, nn.Linear)
    plain.load_state_dict(model.state_dict())
    batches = [(torch.randint(0, 11, (3, 5)), torch.randn(3, 5, 11)) for _ in range(2)]
    expected = brute_force(plain, batches)
    run(model, batches)
    torch.testing.assert_close(model.wte.weight_pegsqnorm().double(), 6 * expected["wte.weight"], rtol=1e-5, atol=0)
    with pytest.raises(RuntimeError, match="use the embedding's weight_pegsqnorm"):
        model.head.weight_pegsqnorm()


@pytest.mark.parametrize("make,call,reason", [
    (lambda: PEGradNormLinear(4, 3, bias=False), "bias_pegsqnorm", "has no bias"),
    (lambda: PEGradNormShimLinear(4, 3, False), "bias_pegsqnorm", "has no bias"),
    (lambda: PEGradNormShimEmbedding(5, 3), "bias_pegsqnorm", "has no bias"),
    (lambda: PEGradNormSeparatedLayerNorm(4, False), "bias_pegsqnorm", "has no bias"),
    (lambda: PEGradNormSeparatedLayerNorm(4, elementwise_affine=False), "weight_pegsqnorm", "has no weight"),
    (lambda: PEGradNormSeparatedRMSNorm(4), "bias_pegsqnorm", "has no bias"),
    (lambda: PEGradNormSeparatedRMSNorm(4, elementwise_affine=False), "weight_pegsqnorm", "has no weight"),
    (lambda: PEGradNormLinear(4, 3).requires_grad_(False), "weight_pegsqnorm", "does not require grad"),
    (lambda: PEGradNormEmbedding(5, 3).requires_grad_(False), "weight_pegsqnorm", "does not require grad"),
    (lambda: torch.nn.utils.parametrizations.spectral_norm(PEGradNormShimLinear(4, 3)), "weight_pegsqnorm",
     "parametrized"),
    (lambda: TiedLM(PEGradNormEmbedding, nn.Linear).wte, "weight_pegsqnorm", "does not measure"),
    (lambda: TiedLM(nn.Embedding, PEGradNormLinear).head, "weight_pegsqnorm", "does not measure"),
])
def test_pegsqnorm_of_an_unmeasured_parameter_is_an_error(make, call, reason):
    # the reference has no accessor for a missing bias, and its bias-less shim Linear measured
    # one anyway: no number here is better than a wrong one
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a one-sided tie warns
        layer = make()
    x = torch.randint(0, 5, (2, 3)) if isinstance(layer, nn.Embedding) else torch.randn(2, 3, 4)
    y = layer(x)
    if y.requires_grad:
        y.square().sum().backward()
    with pytest.raises(RuntimeError, match=reason) as error:
        getattr(layer, call)()
    assert "\n" not in str(error.value)


REFUSED_MODULE_NAMES = [
    "exists", "safe_sum", "safe_sqnorm", "stack_with_ones", "ModuleWithBuffers", "pe_linear_grad_norm",
    "PEGLinearGradNormNoop", "wgrad_plus_pe_grad_norm_highmem", "at_index", "PEGradNormLinearFunction",
    "embedding_dense_backward", "embedding_pe_grad_norm", "PEGEmbeddingGradNormNoop", "embedding_peg_plus_grads",
    "PEGEmbeddingGradNorm", "ElementWiseAffine", "PEGradNormEANoop", "PEGradNormShimElementWiseAffine",
    "ShimLinearTest", "ShimEmbeddingTest", "LNShimTest"]
REFUSED_LAYER_NAMES = ["weight_upegsqnorm", "bias_upegsqnorm", "marked_buffers", "named_buffers_with_marker",
                       "register_marked_buffer", "register_upegsqnorm_buffer"]


@pytest.mark.parametrize("name", REFUSED_MODULE_NAMES)
def test_reference_module_names_not_kept_say_what_to_use(name):
    with pytest.raises(ReferenceNameError, match=rf"buffered\.{name} is the reference .*: (use|write) ") as error:
        exec(f"from buffered import {name}", {})
    assert "\n" not in str(error.value)
    with pytest.raises(ReferenceNameError):
        getattr(buffered, name)
    assert getattr(buffered, "no_such_name", None) is None  # other names: the usual AttributeError


def test_reference_names_kept():
    from nanogns.layers import LayerNorm, zero_sqgradnorm_buffers as zero  # noqa: F401
    assert zero is zero_sqgradnorm_buffers


@pytest.mark.parametrize("cls,args", ALL)
@pytest.mark.parametrize("name", REFUSED_LAYER_NAMES)
def test_reference_layer_attributes_not_kept_say_what_to_use(cls, args, name):
    layer = cls(*args)
    with pytest.raises(ReferenceNameError, match=rf"{name} is the reference .*: use "):
        getattr(layer, name)


@pytest.mark.parametrize("cls,args", ALL)
def test_reference_layer_names_stay_out_of_dir(cls, args):
    """Refused when asked for, but not offered: dir() (tab completion, help()) lists our names only."""
    layer = cls(*args)
    assert not set(REFUSED_LAYER_NAMES) & set(dir(layer)) and not set(REFUSED_LAYER_NAMES) & set(dir(cls))
    assert layer.weight is layer._parameters["weight"]  # nn.Module's own attributes still resolve
    with pytest.raises(AttributeError, match="no_such_attribute"):
        layer.no_such_attribute


def test_separated_layernorm_has_no_layernorm_submodule():
    layer = PEGradNormSeparatedLayerNorm(4, True)
    with pytest.raises(ReferenceNameError, match="F.layer_norm"):
        layer.layernorm
    assert [n for n, _ in layer.named_modules()] == [""] and list(layer.state_dict()) == ["weight", "bias"]


class AllLayers(nn.Module):
    """One of each measured layer, tied head included, in a small language model."""

    def __init__(self, V=11, D=6):
        super().__init__()
        self.wte = PEGradNormEmbedding(V, D)
        self.wpe = PEGradNormShimEmbedding(5, D)
        self.ln = PEGradNormSeparatedLayerNorm(D, True)
        self.fc = PEGradNormShimLinear(D, D)
        self.head = PEGradNormLinear(D, V, bias=False)
        tie_weights(self.wte, self.head)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1]).expand(ids.shape)
        return self.head(torch.tanh(self.fc(self.ln(self.wte(ids) + self.wpe(pos)))))


def all_layers_step(model, ids, r):
    (torch.sin(model(ids)) * r).sum().div(ids.shape[0]).backward()
    return {n: buf.clone() for n, buf in model.named_buffers()}


def test_refused_names_leave_copies_casts_and_state_dicts_alone():
    torch.manual_seed(22)
    model = AllLayers()
    ids, r = torch.randint(0, 11, (3, 5)), torch.randn(3, 5, 11)
    copy = deepcopy(model)
    assert list(copy.state_dict()) == list(model.state_dict())
    torch.testing.assert_close(all_layers_step(copy, ids, r), all_layers_step(model, ids, r))
    for name in ("wte", "wpe", "ln", "fc"):  # the copy's tie link too: wte's includes the cross term
        torch.testing.assert_close(pegsqnorms(getattr(copy, name)), pegsqnorms(getattr(model, name)))
    copy.half()
    assert all(b.dtype == torch.float32 for b in copy.buffers())
    torch.testing.assert_close(copy.fc.weight_pegsqnorm(), model.fc.weight_pegsqnorm())


def test_refused_names_leave_ddp_alone(tmp_path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    torch.manual_seed(23)
    model, twin = AllLayers(), AllLayers()
    twin.load_state_dict(model.state_dict())
    ids, r = torch.randint(0, 11, (3, 5)), torch.randn(3, 5, 11)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(model)
        got = all_layers_step(ddp, ids, r)
        state = ddp.state_dict()
        # DDP's reducer released before its process group is destroyed: released after (when the
        # test returned), gloo's destructor waited for its threads, for ever now and then
        del ddp
        gc.collect()
    finally:
        dist.destroy_process_group()
    assert list(state) == [f"module.{k}" for k in twin.state_dict()]
    want = all_layers_step(twin, ids, r)
    torch.testing.assert_close({k.removeprefix("module."): v for k, v in got.items()}, want)


@pytest.mark.slow
def test_refused_names_leave_torch_compile_alone():
    torch._dynamo.reset()
    torch.manual_seed(24)
    model, twin = AllLayers(), AllLayers()
    twin.load_state_dict(model.state_dict())
    ids, r = torch.randint(0, 11, (3, 5)), torch.randn(3, 5, 11)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    got = all_layers_step(compiled, ids, r)
    want = all_layers_step(twin, ids, r)
    torch.testing.assert_close({k.removeprefix("_orig_mod."): v for k, v in got.items()}, want)
    assert all(v.item() > 0 for k, v in want.items() if k.endswith("example_count"))
    torch._dynamo.reset()


def test_the_package_names_every_class_measure_builds_and_exports_no_private_name():
    import nanogns
    built = {cls.__name__ for classes in buffered.MEASURED_CLASSES.values() for cls in classes.values()}
    assert built <= set(nanogns.__all__), built - set(nanogns.__all__)
    assert all(getattr(nanogns, name) is getattr(buffered, name) for name in built)
    private = [name for name in vars(buffered) if name.startswith("_") and not name.startswith("__")]
    assert private == [], private
