"""
The measured normalisations under torch.compile (and the other measured layers, which hand their
sums out the same way): one route on every device, whatever backend a layer names. The PyTorch path is traced with the model, so that the compiler fuses its
per-example sums with the model's own kernels: no opaque op in the graph, and nothing written
inside the backward (the sums leave it as the gradient of the layer's sink, and reach the buffers
after it). No environment variable chooses anything.
"""
import copy
import os
import sys
import types

import pytest
import torch
import torch.nn as nn
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import nanogns.normgnorm as normgnorm  # noqa: E402
from nanogns.layers import (PEGradNormEmbedding, PEGradNormFusedLayerNorm, PEGradNormFusedRMSNorm,  # noqa: E402
                            PEGradNormLinear, PEGradNormSeparatedLayerNorm, PEGradNormSeparatedRMSNorm,
                            PEGradNormShimEmbedding, PEGradNormShimLinear, find_sqgradnorm_buffers, measure,
                            register_coordinate_buffers, zero_sqgradnorm_buffers)
from gns_fixtures import gpt_loss, one_thread, sqgradnorm_sums  # noqa: E402,F401  (one_thread: autouse)
from nanogns.layers.config import classes_for_flags, set_contextual_config  # noqa: E402
from nanogns.layers.linear import measured_linears as buffered_linears  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

LAYERS = {
    "fused LayerNorm": lambda **kw: PEGradNormFusedLayerNorm(16, **kw),
    "fused LayerNorm, no bias": lambda **kw: PEGradNormFusedLayerNorm(16, bias=False, **kw),
    "fused RMSNorm": lambda **kw: PEGradNormFusedRMSNorm(16, **kw),
    "shim LayerNorm": lambda: PEGradNormSeparatedLayerNorm(16),
    "shim RMSNorm": lambda: PEGradNormSeparatedRMSNorm(16),
}


def randomised(layer):
    torch.manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return layer


def graph_recorder(graphs):
    """A torch.compile backend that keeps AOTAutograd's forward and backward graphs and runs them as they are."""
    def keep(kind):
        def compiler(gm, example_inputs):
            graphs.append((kind, gm))
            return make_boxed_func(gm.forward)
        return compiler
    return aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))


def assert_plain_aten(graphs):
    """A forward and a backward graph, each of aten ops only (no normgnorm op the compiler cannot see
    into), none of which writes to its inputs (as a buffer written inside the backward would be)."""
    assert sorted(kind for kind, _ in graphs) == ["backward", "forward"]
    for kind, gm in graphs:
        ops = [n.target for n in gm.graph.nodes
               if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)]
        assert ops, kind
        assert not [op for op in ops if op.namespace != "aten"], (kind, gm.graph)
        assert not [op for op in ops if op._schema.is_mutable], (kind, gm.graph)


def run_twice(layer, step):
    """Two micro-steps of one layer, different data: what its buffers and gradients then hold."""
    for call in range(2):
        x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(call), requires_grad=True)
        step(layer, x).backward()
    return ({name: buf.clone() for name, buf in layer.named_buffers()},
            {name: p.grad.clone() for name, p in layer.named_parameters()})


def assert_like_eager(got, eager):
    """run_twice's buffers and gradients, compiled (got) as eager, and something measured."""
    for eager_values, got_values in zip(eager, got):
        assert list(got_values) == list(eager_values)
        for name in eager_values:
            torch.testing.assert_close(got_values[name], eager_values[name], rtol=1e-5, atol=1e-7, msg=name)
    assert got[0]["example_count"].item() == 6 and got[0]["weight_sqgradnorm"].item() > 0


def loss_of(layer, x):
    return layer(x).sin().sum()


@pytest.mark.parametrize("layer,backend", [(layer, backend) for layer in LAYERS
                                           for backend in (["", "cpu", "triton", "cuda", "torch"]
                                                           if layer.startswith("fused") else [""])])
def test_compiled_graphs_hold_no_opaque_op_and_write_no_buffer(layer, backend):
    """Whatever backend a layer names (on a GPU the kernels' names), its compiled forward and backward
    are plain aten ops: no normgnorm op the compiler cannot see into, and no op that writes to an input
    (a buffer written inside the backward). Its buffers and gradients are eager's, over two micro-steps."""
    kwargs = dict(backend=backend) if backend else {}
    eager = run_twice(randomised(LAYERS[layer](**kwargs)), loss_of)
    graphs = []
    torch._dynamo.reset()
    compiled = torch.compile(loss_of, backend=graph_recorder(graphs), fullgraph=True)
    got = run_twice(randomised(LAYERS[layer](**kwargs)), compiled)
    torch._dynamo.reset()
    assert_plain_aten(graphs)
    assert_like_eager(got, eager)


def shapes_rule(linear):
    """A Linear that takes its method from the shapes, eager as compiled, so both compute alike."""
    linear.per_example_mode = "shapes"
    return linear


OTHER_LAYERS = {
    "fused Linear": lambda: shapes_rule(PEGradNormLinear(16, 8)),
    "shim Linear, no bias": lambda: shapes_rule(PEGradNormShimLinear(16, 8, bias=False)),
    "fused Embedding": lambda: PEGradNormEmbedding(30, 16),
    "shim Embedding": lambda: PEGradNormShimEmbedding(30, 16),
}


def input_loss_of(layer, x):
    """loss_of for any layer: an Embedding looks up ids made from x."""
    if isinstance(layer, nn.Embedding):
        x = (x.detach()[..., 0].abs() * 10).long() % layer.num_embeddings
    return layer(x).sin().sum()


@pytest.mark.parametrize("layer", OTHER_LAYERS)
def test_every_measured_layer_compiled_writes_no_buffer(layer):
    """The Linears and Embeddings hand their sums out of the compiled backward as the norms do, as
    the gradient of their sink: no op of their compiled graphs writes to an input (which would rule
    out CUDA graphs), and their buffers and gradients are eager's, over two micro-steps."""
    torch.manual_seed(1)
    eager = run_twice(OTHER_LAYERS[layer](), input_loss_of)
    graphs = []
    torch._dynamo.reset()
    compiled = torch.compile(input_loss_of, backend=graph_recorder(graphs), fullgraph=True)
    torch.manual_seed(1)
    got = run_twice(OTHER_LAYERS[layer](), compiled)
    torch._dynamo.reset()
    assert_plain_aten(graphs)
    assert_like_eager(got, eager)


@pytest.mark.parametrize("backend", ["", "triton", "cuda", "cpu"])
def test_the_compiled_route_is_the_same_on_every_device(monkeypatch, backend):
    """While compiling, the implementation is the PyTorch path whatever the device and the backend asked
    for: what compiling on the CPU shows is what compiling on a GPU does."""
    on_gpu = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda"))
    assert normgnorm.resolve_backend(backend, on_gpu) in ("triton", "cuda", "torch")  # eager: a GPU's kernels
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    for x in (on_gpu, torch.zeros(2, 3)):
        assert normgnorm.resolve_backend(backend, x) == "torch"


def test_no_environment_variable_chooses_the_route(monkeypatch):
    """backend= on the layers and functions is the one choice: NORMGNORM_BACKEND and NORMGNORM_TRITON_OP
    decide nothing."""
    x = torch.zeros(2, 3)
    for name in ("torch", "triton", "cuda", "nonsense"):
        monkeypatch.setenv("NORMGNORM_BACKEND", name)
        assert normgnorm.resolve_backend("", x) == "cpu"  # eager on CPU: the native backward
        assert normgnorm.resolve_backend("torch", x) == "torch"
    assert not hasattr(normgnorm, "TRITON_OP")
    for op in ("norm_fwd", "norm_bwd"):  # the compiled route's former opaque ops
        with pytest.raises((AttributeError, RuntimeError)):
            getattr(torch.ops.normgnorm, op)


# ---------------------------------------------------------------- the sink: where the sums go after the backward

@pytest.mark.parametrize("layer", list(LAYERS))
def test_the_sink_follows_casts_copies_and_new_buffers(layer):
    """A layer cast to another dtype, deep-copied, or given per-coordinate buffers (AdamGNS) still
    measures, compiled, into its own buffers, as eager does."""
    torch._dynamo.reset()
    original = randomised(LAYERS[layer]())
    original.to(torch.float64).to(torch.float32)
    if layer.startswith("shim"):
        register_coordinate_buffers(original, {id(original.weight)})
    twin = copy.deepcopy(original)
    eager = run_twice(copy.deepcopy(original), loss_of)
    graphs = []
    compiled = torch.compile(loss_of, backend=graph_recorder(graphs), fullgraph=True)
    got = run_twice(twin, compiled)
    torch._dynamo.reset()
    assert_plain_aten(graphs)  # through the sink: the buffers are not written inside the backward
    assert all(buf.item() == 0 for name, buf in original.named_buffers() if buf.dim() == 0)  # the copy's own
    got_original = run_twice(original, compiled)
    torch._dynamo.reset()
    for name in eager[0]:
        torch.testing.assert_close(got[0][name], eager[0][name], rtol=1e-5, atol=1e-7, msg=name)
        torch.testing.assert_close(got_original[0][name], eager[0][name], rtol=1e-5, atol=1e-7, msg=name)
    if layer.startswith("shim"):
        assert got[0]["weight_sqgrad_coords"].sum() > 0


@pytest.mark.filterwarnings("ignore:measure. 2 trainable parameters are not measured")  # the Linear, left out
def test_a_model_measure_converted_on_another_device_measures_compiled():
    """measure() builds its layers on the meta device and hands them the model's Parameters: the
    sink is where the weight is, and a compiled backward measures."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.RMSNorm(16))
    measure(model, linear=None, embedding=None, norm="fused")
    assert isinstance(model[1], PEGradNormFusedLayerNorm) and isinstance(model[2], PEGradNormFusedRMSNorm)
    graphs = []
    compiled = torch.compile(model, backend=graph_recorder(graphs), fullgraph=True)
    compiled(torch.randn(3, 16)).pow(2).sum().backward()
    torch._dynamo.reset()
    assert_plain_aten(graphs)
    assert [count.item() for *_, count in find_sqgradnorm_buffers(model)] == [3] * 3
    assert all(buf.item() > 0 for _, _, buf, _ in find_sqgradnorm_buffers(model))


# ---------------------------------------------------------------- the measured GPT, compiled by inductor on the CPU

CPU_GPT = dict(n_layer=2, n_head=2, n_embd=64, block_size=32, vocab_size=65, dropout=0.0, bias=False)


def gpt(lnclass):
    torch.manual_seed(0)
    with set_contextual_config(**(classes_for_flags(lnclass=lnclass) if lnclass else {})):
        return GPT(GPTConfig(**CPU_GPT))


def train(model, batches):
    for ids, targets in batches:
        (model(ids, targets)[1] / len(batches)).backward()
    return {n: b.clone() for n, b in model.named_buffers()}, {n: p.grad.clone() for n, p in model.named_parameters()}


def compiled_kernel_count(model, batches):
    """Inductor's kernel count for the forward and backward of `model`, compiled and trained on `batches`."""
    from torch._inductor import metrics
    torch._dynamo.reset()
    metrics.reset()
    # a fresh compile, not one loaded from inductor's caches, whose kernels would not be counted
    with torch._inductor.config.patch(fx_graph_cache=False, fx_graph_remote_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        train(torch.compile(model, fullgraph=True), batches)
    torch._dynamo.reset()
    return metrics.generated_kernel_count


@pytest.mark.slow
def test_compiled_gpt_adds_at_most_two_kernels_per_normalisation():
    """Inductor on the CPU, forward and backward of a 2-layer GPT with 5 normalisations: ln-fused and
    ln-shim each generate at most torch's LayerNorm's kernel count plus two per normalisation, and
    their buffers and gradients are eager's (two micro-steps) and the brute-force per-example norms."""
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randint(0, 65, (4, 32), generator=g), torch.randint(0, 65, (4, 32), generator=g))
               for _ in range(2)]
    plain_kernels = compiled_kernel_count(gpt(None), batches)
    assert plain_kernels >= 20  # the count is read at all: a GPT's forward and backward are tens of kernels
    want = sqgradnorm_sums(gpt(None), gpt_loss, batches)
    for lnclass in ("fused", "shim"):
        eager_buffers, eager_grads = train(gpt(lnclass), batches)
        model = gpt(lnclass)
        kernels = compiled_kernel_count(model, batches)
        found = find_sqgradnorm_buffers(model)
        assert len(found) == 5
        assert kernels <= plain_kernels + 2 * len(found), (lnclass, kernels, plain_kernels)
        for name, p, buf, count in found:
            assert count.item() == 8
            torch.testing.assert_close(buf.double(), want[name], rtol=1e-4, atol=1e-10, msg=name)
        for name, buf in model.named_buffers():
            torch.testing.assert_close(buf, eager_buffers[name], rtol=1e-5, atol=1e-10, msg=name)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, eager_grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("precision", ["bfloat16 autocast", "float16 autocast, GradScaler"])
@pytest.mark.parametrize("lnclass", ["fused", "shim"])
def test_compiled_gpt_under_autocast_and_a_grad_scaler_measures_as_eager(lnclass, precision):
    """Two micro-steps of a GPT under autocast (float16: the loss scaled by a GradScaler, the buffers
    holding scale² times the sums), eager and compiled: the same buffers and gradients."""
    dtype = torch.bfloat16 if precision.startswith("bfloat16") else torch.float16
    g = torch.Generator().manual_seed(4)
    batches = [(torch.randint(0, 65, (4, 16), generator=g), torch.randint(0, 65, (4, 16), generator=g))
               for _ in range(2)]
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        model = gpt(lnclass)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, enabled=dtype == torch.float16)
        step = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
        for ids, targets in batches:
            with torch.autocast("cpu", dtype=dtype):
                loss = step(ids, targets)[1] / len(batches)
            scaler.scale(loss).backward()
        results.append(({n: b.clone() for n, b in model.named_buffers()},
                        {n: p.grad.clone() for n, p in model.named_parameters()}))
    torch._dynamo.reset()
    (eager_buffers, eager_grads), (buffers, grads) = results
    assert [buf.item() for name, buf in buffers.items() if name.endswith("example_count")] == [8] * 5
    for name in eager_buffers:
        torch.testing.assert_close(buffers[name], eager_buffers[name], rtol=1e-3, atol=1e-9, msg=name)
    for name in eager_grads:  # within a half-precision rounding of dx, which the two routes may round apart
        scale = eager_grads[name].abs().max().item()
        torch.testing.assert_close(grads[name], eager_grads[name], rtol=1e-3, atol=1e-3 * scale, msg=name)


@pytest.mark.parametrize("layer", list(LAYERS))
def test_a_frozen_layer_compiled_measures_nothing_and_writes_nothing(layer):
    """A layer whose parameters are all frozen, its input still differentiated: compiled, nothing is
    written inside the backward, and no buffer of a parameter is touched."""
    torch._dynamo.reset()
    frozen = randomised(LAYERS[layer]()).requires_grad_(False)
    graphs = []
    compiled = torch.compile(loss_of, backend=graph_recorder(graphs), fullgraph=True)
    x = torch.randn(3, 5, 16, requires_grad=True)
    compiled(frozen, x).backward()
    torch._dynamo.reset()
    assert_plain_aten(graphs)
    assert x.grad is not None and all(buf.item() == 0 for name, buf in frozen.named_buffers()
                                      if name.endswith("_sqgradnorm"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphs_of_a_measured_gpt_step_measure_as_eager():
    """Every measured layer class in one GPT (fused Linears and Embeddings, fused normalisations),
    compiled with mode="reduce-overhead" (its forward and backward replayed as CUDA graphs, which a
    buffer written inside the backward would rule out): over three steps of two micro-steps each its
    buffers and gradients are eager's."""
    def measured_gpt():
        torch.manual_seed(0)
        with set_contextual_config(**classes_for_flags(linearclass="gns", embeddingclass="gns", lnclass="fused")):
            model = GPT(GPTConfig(**CPU_GPT)).cuda()
        for _, layer in buffered_linears(model):
            layer.per_example_mode = "shapes"  # the same method eager and compiled
        return model

    g = torch.Generator().manual_seed(5)
    steps = [[tuple(torch.randint(0, 65, (4, 32), generator=g).cuda() for _ in range(2)) for _ in range(2)]
             for _ in range(3)]
    eager, graphed = measured_gpt(), measured_gpt()
    compiled = torch.compile(graphed, mode="reduce-overhead")
    for batches in steps:
        for model, forward in ((eager, eager), (graphed, compiled)):
            model.zero_grad(set_to_none=True)
            zero_sqgradnorm_buffers(model)
            for ids, targets in batches:
                (forward(ids, targets)[1] / len(batches)).backward()
        want = {n: b.clone() for n, b in eager.named_buffers()}
        got = {n: b.clone() for n, b in graphed.named_buffers()}
        assert list(got) == list(want) and any("sqgradnorm" in n for n in got)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
        for (name, p), (_, q) in zip(eager.named_parameters(), graphed.named_parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
    torch._dynamo.reset()
