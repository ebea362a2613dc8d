"""
PEGradNormFusedLayerNorm: a drop-in nn.LayerNorm whose backward accumulates Σ_b ||g_b / B||²
of its gain and bias (nanogns/layers' buffer convention), checked against brute force (the shared
oracle through nn.LayerNorm at the same weights), alone and inside a GPT, with gradient accumulation.
PEGradNormFusedRMSNorm: the same for nn.RMSNorm's gain.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nanogns.layers as buffered
import fused_gns
import nanogns.normgnorm as normgnorm
from nanogns.layers import PEGradNormSeparatedRMSNorm, find_sqgradnorm_buffers, zero_sqgradnorm_buffers
from fused_gns import PEGradNormFusedLayerNorm, PEGradNormFusedRMSNorm
from gns_fixtures import gpt_loss, sqgradnorm_sums, with_rmsnorms
from nanogns.layers.config import set_contextual_config
from model import GPT, GPTConfig
from nanogns.refusals import ReferenceNameError
from test_layers import AUTOCAST_RTOL, BAD_LAYERNORM_CALLS, LAYERNORM_CALLS, REFUSED_LAYER_NAMES, RMSNORM_CALLS


def randomised(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5 + 1)
    return module


@pytest.mark.parametrize("bias", [True, False])
def test_drop_in_for_nn_layernorm(bias):
    ours, theirs = PEGradNormFusedLayerNorm(24, bias=bias), randomised(nn.LayerNorm(24, bias=bias))
    assert [(n, p.shape) for n, p in ours.named_parameters()] == [(n, p.shape) for n, p in theirs.named_parameters()]
    assert list(ours.state_dict()) == list(theirs.state_dict())  # the buffers stay out of checkpoints
    assert ours.eps == theirs.eps == 1e-5
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(3, 5, 24)
    torch.testing.assert_close(ours(x), theirs(x))
    theirs.load_state_dict(randomised(ours, seed=1).state_dict())
    torch.testing.assert_close(ours(x), theirs(x))


@pytest.mark.parametrize("args,kwargs,eps,bias", LAYERNORM_CALLS)
def test_takes_torchs_and_the_references_arguments(args, kwargs, eps, bias):
    # the reference's PEGradNormFusedLayerNorm(ndim, bias) and torch's nn.LayerNorm(ndim, eps, ...)
    m = PEGradNormFusedLayerNorm(*args, **kwargs, backend="torch")
    assert m.eps == eps and m.normalized_shape == (8,) and m.backend == "torch"
    assert isinstance(m, buffered.LayerNorm) and isinstance(m, nn.LayerNorm)
    params = dict(m.named_parameters())
    assert list(params) == (["weight", "bias"] if bias else ["weight"])
    assert torch.equal(params["weight"], torch.ones(8)) and (not bias or torch.equal(params["bias"], torch.zeros(8)))
    assert ("bias_sqgradnorm" in m._buffers) == bias
    x = torch.randn(2, 3, 8)
    torch.testing.assert_close(m(x), F.layer_norm(x, (8,), m.weight, m.bias, eps))


@pytest.mark.parametrize("args,kwargs", BAD_LAYERNORM_CALLS)
def test_contradictory_or_unknown_arguments_are_one_line_errors(args, kwargs):
    with pytest.raises(TypeError, match="PEGradNormFusedLayerNorm") as error:
        PEGradNormFusedLayerNorm(*args, **kwargs)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("cls,norm", [(PEGradNormFusedLayerNorm, lambda x: F.layer_norm(x, (8,), eps=1e-5)),
                                      (PEGradNormFusedRMSNorm, lambda x: F.rms_norm(x, (8,)))],
                         ids=["LayerNorm", "RMSNorm"])
def test_what_the_kernel_cannot_do(cls, norm):
    with pytest.raises(ValueError, match=rf"last dimension only.*nanogns\.layers\.PEGradNormSeparated"):
        cls((3, 8))
    plain = cls(8, elementwise_affine=False)  # nothing to measure: torch's own normalisation
    x = torch.randn(2, 3, 8, requires_grad=True)
    assert torch.equal(plain(x), norm(x)) and plain.weight is None
    assert find_sqgradnorm_buffers(plain) == []


@pytest.mark.parametrize("eps", [None, 1e-6])
def test_drop_in_for_nn_rmsnorm(eps):
    ours, theirs = PEGradNormFusedRMSNorm(24, eps=eps), randomised(nn.RMSNorm(24, eps=eps))
    assert [(n, p.shape) for n, p in ours.named_parameters()] == [(n, p.shape) for n, p in theirs.named_parameters()]
    assert list(ours.state_dict()) == list(theirs.state_dict()) == ["weight"]  # the buffers stay out
    assert ours.eps == theirs.eps == eps and isinstance(ours, nn.RMSNorm)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(3, 5, 24)
    torch.testing.assert_close(ours(x), theirs(x))
    theirs.load_state_dict(randomised(ours, seed=1).state_dict())
    torch.testing.assert_close(ours(x), theirs(x))
    assert sorted(ours._buffers) == ["example_count", "weight_sqgradnorm"]


@pytest.mark.parametrize("args,kwargs,eps,affine", RMSNORM_CALLS)
def test_rmsnorm_takes_torchs_arguments(args, kwargs, eps, affine):
    m, plain = PEGradNormFusedRMSNorm(*args, **kwargs, backend="torch"), nn.RMSNorm(*args, **kwargs)
    assert m.eps == eps and m.normalized_shape == (8,) and m.backend == "torch"
    assert list(m.state_dict()) == list(plain.state_dict()) and ("weight_sqgradnorm" in m._buffers) == affine
    x = torch.randn(2, 3, 8)
    torch.testing.assert_close(m(x), F.rms_norm(x, (8,), m.weight, eps))


def test_buffer_convention():
    with_bias, without = PEGradNormFusedLayerNorm(8), PEGradNormFusedLayerNorm(8, bias=False)
    assert sorted(with_bias._buffers) == ["bias_sqgradnorm", "example_count", "weight_sqgradnorm"]
    assert sorted(without._buffers) == ["example_count", "weight_sqgradnorm"]
    for buf in with_bias.buffers():
        assert buf.dtype == torch.float32 and buf.dim() == 0
    model = nn.Sequential(with_bias, without)
    # a weighted sum: the gradient of a plain sum through a LayerNorm is zero
    (model(torch.randn(2, 3, 8)) * torch.randn(2, 3, 8)).sum().backward()
    found = find_sqgradnorm_buffers(model)
    assert [name for name, *_ in found] == ["0.weight", "0.bias", "1.weight"]
    assert all(buf.item() > 0 and count.item() == 2 for _, _, buf, count in found)
    zero_sqgradnorm_buffers(model)
    assert all(buf.item() == 0 and count.item() == 0 for _, _, buf, count in found)


@pytest.mark.parametrize("cls", [PEGradNormFusedLayerNorm, PEGradNormFusedRMSNorm])
def test_buffers_stay_float32_through_casts(cls):
    m = cls(8)
    m(torch.randn(3, 4, 8)).pow(2).sum().backward()
    before = {name: buf.clone() for name, buf in m.named_buffers()}
    for cast in (torch.float16, torch.bfloat16, torch.float64, torch.float32):
        m.to(cast)
        assert m.weight.dtype == cast
        for name, buf in m.named_buffers():
            assert buf.dtype == torch.float32 and torch.equal(buf, before[name]), (cast, name)
    m.half()
    assert m.weight_sqgradnorm.dtype == torch.float32
    m.float()
    # and they keep accumulating in float32 from a half-precision layer
    m.half()
    m(torch.randn(2, 4, 8, dtype=torch.float16)).float().pow(2).sum().backward()
    assert m.example_count.item() == 5 and m.weight_sqgradnorm.item() > before["weight_sqgradnorm"].item()


def per_example_loss(y, head):
    """A nonlinear per-example loss of the layer's output y [B, T, D] (or [B, D]): l_b = mean_t (y_bt · head)²."""
    return (y @ head).square().reshape(y.shape[0], -1).mean(dim=-1)


def torch_twin(m):
    """torch's own LayerNorm or RMSNorm with m's arguments and weights."""
    if isinstance(m, nn.RMSNorm):
        plain = nn.RMSNorm(m.normalized_shape, m.eps)
    else:
        plain = nn.LayerNorm(m.normalized_shape, m.eps, bias=m.bias is not None)
    plain.load_state_dict(m.state_dict())
    return plain


def brute_force_sqgradnorms(m, xs, head):
    """{name: Σ_b ||∇ l_b / B||²} of torch's LayerNorm (RMSNorm) at m's weights, over the micro-batches xs."""
    plain = torch_twin(m)
    return sqgradnorm_sums(plain, lambda forward, x: per_example_loss(forward(x), head).sum(), [(x,) for x in xs])


def test_gradient_accumulation_matches_brute_force():
    D = 20
    m = randomised(PEGradNormFusedLayerNorm(D))
    head = torch.randn(D)
    xs = [torch.randn(3, 5, D) * 3 + 1, torch.randn(3, 5, D)]  # two micro-steps of 3 examples: B = 6
    for x in xs:  # nanoGPT: each micro-step's loss is a mean, divided by the number of micro-steps
        (per_example_loss(m(x), head).mean() / len(xs)).backward()
    want = brute_force_sqgradnorms(m, xs, head)
    want_w, want_b = want["weight"], want["bias"]
    assert m.example_count.item() == 6
    torch.testing.assert_close(m.weight_sqgradnorm.double(), want_w, rtol=1e-5, atol=0)
    torch.testing.assert_close(m.bias_sqgradnorm.double(), want_b, rtol=1e-5, atol=0)
    # the reference's accessors: sum * count = B sum_b ||g_b / B||^2
    torch.testing.assert_close(m.weight_pegsqnorm().double(), 6 * want_w, rtol=1e-5, atol=0)
    torch.testing.assert_close(m.bias_pegsqnorm().double(), 6 * want_b, rtol=1e-5, atol=0)


@pytest.mark.parametrize("shape", [(3, 5), (4,)], ids=["3-D", "2-D"])
@pytest.mark.parametrize("eps,x_scale", [(None, 1.0), (1e-6, 1.0), (None, 1e-4), (1e-6, 3e-4)],
                         ids=["eps None", "eps 1e-6", "eps None, tiny rows", "eps 1e-6, tiny rows"])
def test_rmsnorm_gradient_accumulation_matches_brute_force(eps, x_scale, shape):
    """Two micro-steps; tiny rows have a mean square (~1e-8, ~1e-7) below eps (None: float32's
    machine epsilon, 1.2e-7), so eps sets most of rstd and another eps would fail."""
    D = 20
    m = randomised(PEGradNormFusedRMSNorm(D, eps=eps))
    head = torch.randn(D)
    xs = [x_scale * (torch.randn(*shape, D) * 3 + 1), x_scale * torch.randn(*shape, D)]
    for x in xs:
        (per_example_loss(m(x), head).mean() / len(xs)).backward()
    want = brute_force_sqgradnorms(m, xs, head)["weight"]
    assert m.example_count.item() == 2 * shape[0] and m.weight_sqgradnorm.dtype == torch.float32
    torch.testing.assert_close(m.weight_sqgradnorm.double(), want, rtol=1e-5, atol=0)
    torch.testing.assert_close(m.weight_pegsqnorm().double(), 2 * shape[0] * want, rtol=1e-5, atol=0)


@pytest.mark.parametrize("half_layer", [False, True], ids=["float32 layer", "half layer"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_rmsnorm_half_precision_input_matches_brute_force(dtype, half_layer):
    """A half-precision input, as a Linear under autocast gives it (and a layer cast to it, as
    model.half() does): the norms within the LayerNorm tests' autocast tolerance of float32 brute
    force on the same values, in a float32 buffer."""
    D = 16
    m = randomised(PEGradNormFusedRMSNorm(D))
    reference = torch_twin(m)
    if half_layer:
        m.to(dtype)
        reference.load_state_dict({k: v.float() for k, v in m.state_dict().items()})
    head = torch.randn(D)
    xs = [(torch.randn(3, 4, D) * 2).to(dtype) for _ in range(2)]
    for x in xs:
        y = m(x)
        assert y.dtype == dtype
        (per_example_loss(y.float(), head).mean() / len(xs)).backward()
    loss = lambda forward, x: per_example_loss(forward(x), head).sum()  # noqa: E731
    want = sqgradnorm_sums(reference, loss, [(x.float(),) for x in xs])["weight"]
    assert m.weight_sqgradnorm.dtype == torch.float32 and m.example_count.item() == 6
    torch.testing.assert_close(m.weight_sqgradnorm.double(), want, rtol=AUTOCAST_RTOL[dtype], atol=0)


def test_pegsqnorm_without_bias_or_frozen_is_an_error():
    m = PEGradNormFusedLayerNorm(8, False)
    (m(torch.randn(2, 3, 8)) * torch.randn(2, 3, 8)).sum().backward()
    assert m.weight_pegsqnorm() > 0
    with pytest.raises(RuntimeError, match="has no bias"):
        m.bias_pegsqnorm()
    m.weight.requires_grad_(False)
    with pytest.raises(RuntimeError, match="does not require grad"):
        m.weight_pegsqnorm()


def test_refusals():
    from fused_gns import LayerNorm
    assert LayerNorm is buffered.LayerNorm  # the reference imported it from buffered.py
    for name in ("ModuleWithBuffers", "LNShimTest"):
        with pytest.raises(ReferenceNameError, match=rf"fused_gns\.{name} is the reference .*: use "):
            getattr(fused_gns, name)
    m = PEGradNormFusedLayerNorm(8, True)
    for name in REFUSED_LAYER_NAMES:
        with pytest.raises(ReferenceNameError, match=rf"{name} is the reference .*: use "):
            getattr(m, name)


def test_frozen_parameter_is_not_measured():
    m = randomised(PEGradNormFusedLayerNorm(12))
    m.weight.requires_grad_(False)
    head = torch.randn(12)
    x = torch.randn(4, 3, 12)
    per_example_loss(m(x), head).mean().backward()
    want_b = brute_force_sqgradnorms(m, [x], head)["bias"]
    assert m.weight.grad is None and m.weight_sqgradnorm.item() == 0
    torch.testing.assert_close(m.bias_sqgradnorm.double(), want_b, rtol=1e-5, atol=0)
    assert m.example_count.item() == 4


def tiny_gpt_pair(rms_cls=None):
    """A GPT with fused LayerNorms and a plain one with the same weights; given rms_cls (an RMSNorm
    class), a GPT without biases whose normalisations are rms_cls, and the plain one nn.RMSNorm."""
    config = GPTConfig(block_size=8, vocab_size=16, n_layer=2, n_head=2, n_embd=24, bias=rms_cls is None, dropout=0.0)
    torch.manual_seed(0)
    if rms_cls is None:
        with set_contextual_config(LayerNorm=PEGradNormFusedLayerNorm):
            measured = GPT(config)
        plain = GPT(config)
    else:
        measured, plain = with_rmsnorms(GPT(config), rms_cls), with_rmsnorms(GPT(config), nn.RMSNorm)
    with torch.no_grad():  # normalisations away from their identity initialisation
        for name, p in measured.named_parameters():
            if ".ln_" in name or "ln_f" in name:
                p.add_(0.3 * torch.randn_like(p))
    plain.load_state_dict(measured.state_dict())
    return measured, plain


def gpt_micro_batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 16, (2, 8), generator=g), torch.randint(0, 16, (2, 8), generator=g)) for _ in range(2)]


def test_gpt_layernorms_match_brute_force():
    fused, plain = tiny_gpt_pair()
    micro_batches = gpt_micro_batches()
    B = 4
    for idx, targets in micro_batches:
        _, loss = fused(idx, targets)
        (loss / len(micro_batches)).backward()
    want = sqgradnorm_sums(plain, gpt_loss, micro_batches)
    layernorms = [(n, m) for n, m in fused.named_modules() if isinstance(m, PEGradNormFusedLayerNorm)]
    assert len(layernorms) == 5
    for name, m in layernorms:
        assert m.example_count.item() == B
        for pname in ("weight", "bias"):
            torch.testing.assert_close(getattr(m, f"{pname}_sqgradnorm").double(), want[f"{name}.{pname}"],
                                       rtol=1e-4, atol=1e-12, msg=f"{name}.{pname}")
    # and the ordinary gradients are nanoGPT's
    plain.zero_grad()
    for idx, targets in micro_batches:
        (plain(idx, targets)[1] / len(micro_batches)).backward()
    for (name, p), q in zip(fused.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("cls", [PEGradNormFusedRMSNorm, PEGradNormSeparatedRMSNorm])
def test_gpt_rmsnorms_match_brute_force(cls):
    measured, plain = tiny_gpt_pair(cls)
    micro_batches = gpt_micro_batches()
    for idx, targets in micro_batches:
        (measured(idx, targets)[1] / len(micro_batches)).backward()
    want = sqgradnorm_sums(plain, gpt_loss, micro_batches)
    found = find_sqgradnorm_buffers(measured)
    assert [n for n, *_ in found] == [n for n in want if ".ln_" in n or "ln_f" in n] and len(found) == 5
    for name, _, buf, count in found:
        assert count.item() == 4
        torch.testing.assert_close(buf.double(), want[name], rtol=1e-4, atol=1e-12, msg=name)
    for idx, targets in micro_batches:
        (plain(idx, targets)[1] / len(micro_batches)).backward()
    for (name, p), q in zip(measured.named_parameters(), plain.parameters()):
        if cls is PEGradNormSeparatedRMSNorm:  # torch's own backward throughout
            assert torch.equal(p.grad, q.grad), name
        else:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("norm", ["LayerNorm", "RMSNorm"])
def test_gpt_compiles_without_graph_breaks(norm):
    torch._dynamo.reset()
    fused, _ = tiny_gpt_pair(None if norm == "LayerNorm" else PEGradNormFusedRMSNorm)
    idx = torch.randint(0, 16, (2, 8))
    explanation = torch._dynamo.explain(fused)(idx, idx)
    assert explanation.graph_break_count == 0
    torch._dynamo.reset()


@pytest.mark.filterwarnings("ignore:Mismatch dtype")  # torch's rms_norm, for a bfloat16 input and float32 weights
@pytest.mark.parametrize("cls,plain_cls", [(PEGradNormFusedLayerNorm, nn.LayerNorm),
                                           (PEGradNormFusedRMSNorm, nn.RMSNorm)], ids=["LayerNorm", "RMSNorm"])
def test_autocast_and_inference_behave_like_torchs(cls, plain_cls):
    ours, theirs = randomised(cls(16)), randomised(plain_cls(16))
    x = torch.randn(2, 3, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = nn.functional.linear(x, torch.eye(16))  # bfloat16 under autocast
        y_ours, y_theirs = ours(h), theirs(h)
    assert h.dtype == torch.bfloat16 and y_ours.dtype == y_theirs.dtype
    torch.testing.assert_close(y_ours, y_theirs)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x))
    assert ours.example_count.item() == 0  # nothing measured without a backward pass


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("cls,plain_cls", [(PEGradNormFusedLayerNorm, nn.LayerNorm),
                                           (PEGradNormFusedRMSNorm, nn.RMSNorm)], ids=["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("backend", ["triton", "cuda", "torch"])
def test_cuda_autocast_like_torchs(backend, cls, plain_cls):
    if backend == "triton":
        pytest.importorskip("triton")
    ours = randomised(cls(64, backend=backend)).cuda()
    theirs = randomised(plain_cls(64)).cuda()
    x = torch.randn(4, 8, 64, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        h = nn.functional.linear(x, torch.eye(64, device="cuda"))
        y_ours, y_theirs = ours(h), theirs(h)
    # float32 where torch's CUDA autocast runs the op in float32: layer_norm, and rms_norm since torch 2.12
    upcast = normgnorm.autocast_runs_in_float32("cuda", rms=cls is PEGradNormFusedRMSNorm)
    assert y_ours.dtype == y_theirs.dtype == (torch.float32 if upcast else torch.bfloat16)
    torch.testing.assert_close(y_ours, y_theirs)
    y_ours.sum().backward()
    assert ours.weight_sqgradnorm.dtype == torch.float32 and ours.example_count.item() == 4
