"""
Hugging Face's mixture-of-experts models measured exactly (nanogns/layers/hf_moe.py): tiny Mixtral,
Qwen2-MoE, Qwen3-MoE, OLMoE and DeepSeek-V3 built from configs (random weights, offline), their routed
experts per expert, routers and shared experts against brute force (one backward per example; the
routing of an example alone is its routing in the batch, being per token), in float32 and under
bfloat16 autocast, with and without the load-balancing loss.
"""
import copy
import os
import pickle
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gns_fixtures import counting_hook  # noqa: E402
from gns_fixtures import one_thread  # noqa: E402,F401  (autouse: tiny tensors, one thread)
from nanogns.estimators.exact import ExactGNS  # noqa: E402
from nanogns.layers import PEGradNormHFExperts, PEGradNormHFRouter, find_sqgradnorm_buffers, layer_kinds, measure  # noqa: E402
from nanogns.maths import layer_groups  # noqa: E402

transformers = pytest.importorskip("transformers")

B, T, V = 3, 8, 64
RTOL = 1e-4  # float32
AUTOCAST_RTOL = 2e-2  # bfloat16 autocast, as tests/test_measure.py's


# each family's config class, model class and its own options (experts, routing, shared experts)
FAMILY = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2)),
    # a dense layer, then a sparse one with a shared expert and its gate
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        intermediate_size=32, moe_intermediate_size=8, shared_expert_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, decoder_sparse_step=2)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(  # top-1
        intermediate_size=32, moe_intermediate_size=8, num_experts=4, num_experts_per_tok=1, head_dim=16)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(intermediate_size=16, num_experts=8, num_experts_per_tok=2)),
    # a dense layer, then 8 routed experts in 2 groups (1 chosen a token) and the shared experts
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        intermediate_size=32, moe_intermediate_size=8, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
        topk_group=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=8, qk_rope_head_dim=4,
        qk_nope_head_dim=8, v_head_dim=8, num_key_value_heads=2)),
}


def tiny(family, **extra):
    """A tiny causal LM of `family` (2 layers, 32 wide, a 64-token vocabulary), random weights, no dropout."""
    torch.manual_seed(3)
    config_class, model_class, own = FAMILY[family]
    options = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, vocab_size=V,
                   max_position_embeddings=16, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    options.update(own)
    options.update(extra)
    return getattr(transformers, model_class)(getattr(transformers, config_class)(**options))


def batches(steps=2):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, V, (B, T), generator=g) for _ in range(steps)]


def lm_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def train(model, data, loss=lm_loss):
    for ids in data:
        (loss(model, ids) / len(data)).backward()


def per_entry(sq, grad):
    """A parameter's squared norm: one per expert where the buffer holds one per expert ([E])."""
    g = grad.double().square()
    return g.flatten(1).sum(1) if sq.dim() else g.sum()


def brute_force(plain, data, names):
    """{name: sum_b ||g_b / B_all||^2} over every example alone (float64), names the measured parameters'."""
    params = dict(plain.named_parameters())
    total = sum(ids.shape[0] for ids in data)
    sums = {}
    for ids in data:
        for b in range(ids.shape[0]):
            plain.zero_grad(set_to_none=True)
            lm_loss(plain, ids[b:b + 1]).backward()
            for name, sq in names.items():
                grad = params[name].grad
                part = per_entry(sq, grad) / total ** 2 if grad is not None else 0.0
                sums[name] = sums.get(name, 0.0) + part
    plain.zero_grad(set_to_none=True)
    return sums


def measured(model):
    """{name: the buffer (a copy)} of every measured parameter, and the example counts seen."""
    entries = find_sqgradnorm_buffers(model)
    return {n: sq.clone() for n, _, sq, _ in entries}, {count.item() for _, _, _, count in entries}


def assert_sums(got, expected, rtol):
    assert set(got) == set(expected)
    for name in got:
        torch.testing.assert_close(got[name].double(), torch.as_tensor(expected[name], dtype=torch.float64),
                                   rtol=rtol, atol=1e-12, msg=name)


def measured_strictly(plain):
    model = copy.deepcopy(plain)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        measure(model, strict=True)
    return model


FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3"]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_parameter_matches_brute_force_and_grad_is_unchanged(family):
    plain, data = tiny(family).train(), batches()
    model = measured_strictly(plain)
    blocks = [m for m in model.modules() if isinstance(m, PEGradNormHFExperts)]
    assert blocks and all(isinstance(m.gate, PEGradNormHFRouter) for m in model.modules() if hasattr(m, "experts")
                          and isinstance(m.experts, PEGradNormHFExperts))
    train(model, data)
    got, counts = measured(model)
    assert counts == {float(2 * B)} and len(got) == len(list(model.parameters()))
    assert_sums(got, brute_force(plain, data, got), RTOL)
    train(plain, data)
    for (name, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
    reached = blocks[0].expert_examples
    assert reached.shape == (blocks[0].n_expert,) and reached.sum() >= 2 * B  # every example reaches an expert
    kinds = layer_kinds(model)
    want = {"experts", "router", "linear", "embedding", "rmsnorm"}
    want |= {"shared_expert"} if family in ("qwen2_moe", "deepseek_v3") else set()
    assert set(kinds.values()) == want
    assert all(kinds[n] == "router" for n in kinds if n.endswith("mlp.gate.weight"))
    assert all(kinds[n] == "shared_expert" for n in kinds if ".shared_expert" in n)
    assert all(kinds[n] == "experts" and n.endswith("]") for n in kinds if ".experts." in n)
    if family == "qwen2_moe":
        assert "shared expert" in layer_groups(list(kinds), kinds)


@pytest.mark.parametrize("mode", ["ghost", "materialise"])
def test_routed_experts_and_routers_by_either_method(mode):
    plain, data = tiny("mixtral").train(), batches(1)
    model = measured_strictly(plain)
    for m in model.modules():
        if isinstance(m, (PEGradNormHFExperts, PEGradNormHFRouter)):
            m.per_example_mode = mode
    train(model, data)
    got, _ = measured(model)
    assert_sums(got, brute_force(plain, data, got), RTOL)


def silenced_expert_zero(model):
    """Router rows (0, v, -v, u): the logit of expert 0 is 0 while one of v's two is |x.v| > 0, so top-1
    never sends it a token."""
    torch.manual_seed(9)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, transformers.models.mixtral.modeling_mixtral.MixtralTopKRouter):
                v = torch.randn(m.weight.shape[1])
                m.weight[0], m.weight[1], m.weight[2] = 0.0, v, -v


def test_top1_with_an_expert_that_gets_no_token_and_the_tracker_columns():
    plain = tiny("mixtral", num_experts_per_tok=1).train()
    silenced_expert_zero(plain)
    data = batches()
    model = measured_strictly(plain)
    train(model, data)
    got, counts = measured(model)
    assert_sums(got, brute_force(plain, data, got), RTOL)
    experts = model.model.layers[0].mlp.experts
    assert experts.expert_examples[0].item() == 0 and experts.expert_examples.sum().item() >= 2 * B
    assert got["model.layers.0.mlp.experts.down_proj"][0].item() == 0.0
    assert experts.down_proj.grad[0].abs().max().item() == 0.0
    row = ExactGNS(model).measure(1, 2 * B, None)
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
        assert all(any(f"{name}[{e}]" in key for key in row) for e in range(4)), sorted(row)[:8]
    assert any("mlp.experts[0]" in key and row[key] == 0 for key in row)  # the examples that reached expert 0
    assert any("mlp.gate.weight" in key for key in row)


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # torch's rms_norm, bfloat16 input
@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_under_bfloat16_autocast(family):
    plain, data = tiny(family).train(), batches(1)
    model = measured_strictly(plain)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        train(model, data)
        got, _ = measured(model)
        expected = brute_force(plain, data, got)
    worst = max((abs(got[n].double() / torch.as_tensor(expected[n]).clamp_min(1e-30) - 1)
                 * (torch.as_tensor(expected[n]) > 0)).max().item() for n in got)
    assert worst < AUTOCAST_RTOL, worst
    total = sum(got[n].double().sum() for n in got) / sum(torch.as_tensor(expected[n]).sum() for n in got) - 1
    assert abs(total) < 1e-2, total


@pytest.mark.parametrize("implementation", ["batched_mm", "grouped_mm"])
def test_the_same_whichever_experts_implementation_the_model_ran(implementation):
    plain, data = tiny("olmoe").train(), batches(1)
    eager = measured_strictly(plain)
    other = copy.deepcopy(plain)
    other.set_experts_implementation(implementation)
    with torch.no_grad():
        before = lm_loss(other, data[0])
    other = measured_strictly(other)
    with torch.no_grad():
        torch.testing.assert_close(lm_loss(other, data[0]), before, rtol=1e-5, atol=0)
    train(eager, data)
    train(other, data)
    first, second = measured(eager)[0], measured(other)[0]
    assert_sums(second, {n: v.double() for n, v in first.items()}, 1e-5)


def split_loss(model, ids, b, coef):
    """Example b's part of the batch's loss with the load-balancing loss: its tokens' cross-entropy (the
    batch's mean over tokens) plus coef times the load-balancing loss through its rows of the router
    logits only (the other rows detached), its token fractions those of the whole batch."""
    out = model(input_ids=ids, output_router_logits=True)
    logits = out.logits[:, :-1].float()
    ce = F.cross_entropy(logits[b], ids[b, 1:], reduction="sum") / (ids.shape[0] * (ids.shape[1] - 1))
    rows = (torch.arange(ids.numel()) // ids.shape[1] == b)[:, None]
    mine = tuple(torch.where(rows, l, l.detach()) for l in out.router_logits)
    aux = transformers.models.mixtral.modeling_mixtral.load_balancing_loss_func(
        mine, model.config.num_local_experts, model.config.num_experts_per_tok)
    return ce + coef * aux


def test_load_balancing_loss_is_measured_split_by_tokens_with_batch_statistics_fixed():
    coef = 0.5
    plain, data = tiny("mixtral", output_router_logits=True, router_aux_loss_coef=coef).train(), batches(1)
    model = measured_strictly(plain)
    ids = data[0]
    loss = lm_loss(model, ids)
    loss.backward()
    got, _ = measured(model)
    params = dict(plain.named_parameters())
    expected, total = {}, {}
    for b in range(B):
        plain.zero_grad(set_to_none=True)
        split_loss(plain, ids, b, coef).backward()
        for name, sq in got.items():
            expected[name] = expected.get(name, 0.0) + per_entry(sq, params[name].grad)
            total[name] = total.get(name, 0.0) + params[name].grad.double()
    assert_sums(got, expected, RTOL)
    for name, p in model.named_parameters():  # the split adds up to the batch's gradient
        torch.testing.assert_close(p.grad.double(), total[name], rtol=1e-5, atol=1e-8, msg=name)
    # not each example's own load-balancing loss (its own token fractions), which is another number
    name = "model.layers.0.mlp.gate.weight"
    alone = brute_force(plain, data, {name: got[name]})[name]
    assert got[name].item() != pytest.approx(alone.item(), rel=1e-3)


def test_copies_and_pickles_keep_the_measured_classes():
    plain, data = tiny("qwen2_moe").train(), batches(1)
    model = measured_strictly(plain)
    copies = [copy.deepcopy(model), pickle.loads(pickle.dumps(model))]
    train(model, data)
    for other in copies:
        for name in ("experts", "gate"):
            assert type(getattr(other.model.layers[1].mlp, name)) is type(getattr(model.model.layers[1].mlp, name))
        train(other, data)
        assert_sums(measured(other)[0], {n: v.double() for n, v in measured(model)[0].items()}, 1e-6)


def test_router_that_does_not_pass_its_weight_to_f_linear_is_an_error(monkeypatch):
    def by_matmul(self, hidden_states):
        logits = hidden_states.reshape(-1, self.hidden_dim) @ self.weight.T
        top, index = logits.softmax(-1).topk(self.top_k, dim=-1)
        return logits, top / top.sum(-1, keepdim=True), index

    model = measured_strictly(tiny("mixtral").train())
    monkeypatch.setattr(transformers.models.mixtral.modeling_mixtral.MixtralTopKRouter, "forward", by_matmul)
    with pytest.raises(RuntimeError, match=r"model.layers.0.mlp.gate.weight: the router PEGradNormMixtralTopKRouter "
                                           r"passed its weight to F.linear 0 times, not once"):
        lm_loss(model, batches(1)[0])
    with torch.no_grad():  # nothing measured without grad: the router's own forward
        lm_loss(model, batches(1)[0])


def test_accelerate_wrapped_experts_and_router_call_the_measured_forwards():
    hooks = pytest.importorskip("accelerate.hooks")

    plain, data = tiny("mixtral").train(), batches(1)
    model = copy.deepcopy(plain)
    block = model.model.layers[0].mlp
    counting = [counting_hook(hooks), counting_hook(hooks)]
    hooks.add_hook_to_module(block.experts, counting[0])
    hooks.add_hook_to_module(block.gate, counting[1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        measure(model, strict=True)
    assert isinstance(block.experts, PEGradNormHFExperts) and isinstance(block.gate, PEGradNormHFRouter)
    train(model, data)
    got, _ = measured(model)
    assert [c.calls for c in counting] == [1, 1]
    assert_sums(got, brute_force(plain, data, got), RTOL)


def test_block_left_out_by_kinds_or_with_the_linears_says_why():
    model = tiny("mixtral")
    with pytest.warns(UserWarning, match=r"model.layers.0.mlp.gate.weight \(MixtralTopKRouter: in model.layers.0 "
                                         r"\(MixtralDecoderLayer\), left out by kinds="):
        measure(model, kinds={type(model.model.layers[0]): None})
    assert not any(isinstance(m, (PEGradNormHFExperts, PEGradNormHFRouter)) for m in model.modules())
    model = tiny("mixtral")
    with pytest.warns(UserWarning, match=r"model.layers.0.mlp.experts.gate_up_proj \(MixtralExperts: routers and "
                                         r"experts are measured with the Linears \(linear=None\)\)"):
        measure(model, linear=None)


def test_a_logged_qwen2_moe_run_is_analysed_by_kind_and_expert(tmp_path):
    """The README's own-loop recipe on Qwen2-MoE: log.csv holds every expert and the examples that reached
    it, layer_kinds.json the kinds, and gns-analysis groups experts, router and shared expert."""
    import subprocess

    from nanogns.estimators.exact import estimators_for, measure_all, reset_all
    from nanogns.runlog import LogWrapper
    model = measure(tiny("qwen2_moe"))
    estimators = estimators_for(model)
    logger = LogWrapper(out_dir=str(tmp_path))
    logger.record_kinds(layer_kinds(model))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    for step, ids in enumerate(batches(4)):
        lm_loss(model, ids).backward()
        row = measure_all(estimators, step, B, scaler=None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        reset_all(estimators)
        logger.log({"iter_num": step, **row})
        logger.step()
    logger.close()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, os.path.join(root, "gns-analysis.py"), str(tmp_path), "--no-plots",
                           "--experts"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    for group in ("experts", "router", "shared expert"):
        assert f"\n  {group:<13} " in done.stdout, done.stdout
    assert "model.layers.1.mlp.experts[3]" in done.stdout and "experts: 4 in 1 layer" in done.stdout
    # 3 examples a step: every expert reached by fewer than 8, so each named as noisy
    assert "4 experts were reached by fewer than 8 examples a step on average" in done.stdout


def test_a_compiled_mixtral_measures_as_eager():
    """torch.compile of a measured Mixtral: the experts and router run outside the graph, the rest in it;
    every sum as eager's."""
    eager = measure(tiny("mixtral"))
    compiled = copy.deepcopy(eager)
    data = batches()
    train(eager, data)
    train(torch.compile(compiled), data)
    (got, counts), (expected, _) = measured(compiled), measured(eager)
    assert set(got) == set(expected) and counts == {2 * B}
    for n, value in expected.items():
        torch.testing.assert_close(got[n], value, rtol=1e-5, atol=1e-12, msg=n)
