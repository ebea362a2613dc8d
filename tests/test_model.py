"""model.py: shapes, loss at initialisation, weight tying, the layer config, options."""
import math
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gns_fixtures import ARCHITECTURES, LLAMA, arch_id, one_thread  # noqa: F401  (one_thread: autouse)
from nanogns.layers.config import get_contextual_config, set_contextual_config
from model import GPT, GPTConfig

CFG = dict(block_size=16, vocab_size=65, n_layer=2, n_head=2, n_embd=32)


def test_shapes_and_loss_at_init_is_log_vocab():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    idx = torch.randint(0, 65, (8, 16))
    targets = torch.randint(0, 65, (8, 16))
    logits, loss = model(idx, targets)
    assert logits.shape == (8, 16, 65)
    # near-uniform predictions at init: cross-entropy close to ln(vocab)
    assert abs(loss.item() - math.log(65)) < 0.1
    logits, loss = model(idx)
    assert logits.shape == (8, 1, 65) and loss is None


def test_weights_are_tied_and_counted_once():
    model = GPT(GPTConfig(**CFG))
    assert model.transformer.wte.weight is model.lm_head.weight
    names = [n for n, _ in model.named_parameters()]
    assert 'transformer.wte.weight' in names and 'lm_head.weight' not in names
    # the shared matrix gets the gradient of both uses
    idx = torch.randint(0, 65, (2, 16))
    _, loss = model(idx, idx)
    loss.backward()
    assert model.lm_head.weight.grad is not None


def test_layer_config_is_read_at_construction_and_restored():
    class MyLinear(nn.Linear):
        pass

    assert get_contextual_config()['Linear'] is nn.Linear
    with set_contextual_config(Linear=MyLinear):
        model = GPT(GPTConfig(**CFG))
    assert get_contextual_config()['Linear'] is nn.Linear
    assert isinstance(model.lm_head, MyLinear)
    assert isinstance(model.transformer.h[0].mlp.c_fc, MyLinear)
    assert type(GPT(GPTConfig(**CFG)).lm_head) is nn.Linear
    with pytest.raises(ValueError):
        with set_contextual_config(Conv=nn.Conv1d):
            pass


def test_tokens_processed_is_an_int64_buffer_in_the_state_dict():
    model = GPT(GPTConfig(**CFG))
    assert model.tokens_processed.dtype == torch.int64
    model.tokens_processed += 123
    sd = model.state_dict()
    assert sd['tokens_processed'].item() == 123
    other = GPT(GPTConfig(**CFG))
    other.load_state_dict(sd)
    assert other.tokens_processed.item() == 123


@pytest.mark.parametrize('arch', [{}, LLAMA], ids=['gpt2', 'llama'])
def test_bias_off_and_options_run_forward_and_backward(arch):
    """cos_attn, spectral_c_attn and fp32_attention_layers under autocast, with rope too."""
    cfg = GPTConfig(**CFG, bias=False, cos_attn=[1], spectral_c_attn=[0], fp32_attention_layers=[1], **arch)
    model = GPT(cfg)
    assert getattr(model.transformer.h[0].ln_1, 'bias', None) is None
    assert model.transformer.h[1].attn.c_attn.bias is None
    idx = torch.randint(0, 65, (2, 16))
    with torch.autocast('cpu', dtype=torch.bfloat16):
        _, loss = model(idx, idx)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_cos_attn_changes_the_output():
    torch.manual_seed(0)
    a = GPT(GPTConfig(**CFG))
    b = GPT(GPTConfig(**CFG, cos_attn=[0]))
    b.load_state_dict(a.state_dict())
    idx = torch.randint(0, 65, (2, 16))
    assert not torch.allclose(a(idx, idx)[0], b(idx, idx)[0])


def test_generate_and_crop_block_size():
    model = GPT(GPTConfig(**CFG))
    model.eval()
    out = model.generate(torch.zeros((1, 3), dtype=torch.long), max_new_tokens=20, top_k=5)
    assert out.shape == (1, 23)
    model.crop_block_size(8)
    assert model.transformer.wpe.weight.shape[0] == 8
    with pytest.raises(ValueError):
        model(torch.zeros((1, 9), dtype=torch.long))


def test_mfu_uses_the_device_table():
    a = GPT(GPTConfig(**CFG, device_name='A100'))
    h = GPT(GPTConfig(**CFG, device_name='H100'))
    assert a.estimate_mfu(4, 0.1) > h.estimate_mfu(4, 0.1) > 0
    with pytest.raises(ValueError):
        GPT(GPTConfig(**CFG, device_name='TPU9000'))


def test_configure_optimizers_decays_only_matrices():
    model = GPT(GPTConfig(**CFG))
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), 'cpu')
    decay, nodecay = opt.param_groups
    assert all(p.dim() >= 2 for p in decay['params']) and decay['weight_decay'] == 0.1
    assert all(p.dim() < 2 for p in nodecay['params']) and nodecay['weight_decay'] == 0.0



def test_the_defaults_build_gpt2s_modules_and_state_dict_keys():
    """Older configs and checkpoints are unaffected: GPTConfig() is nanoGPT's GPT-2 layout."""
    model = GPT(GPTConfig(**dict(CFG, n_layer=1)))
    block = ['ln_1.weight', 'ln_1.bias', 'attn.c_attn.weight', 'attn.c_attn.bias', 'attn.c_proj.weight',
             'attn.c_proj.bias', 'ln_2.weight', 'ln_2.bias', 'mlp.c_fc.weight', 'mlp.c_fc.bias',
             'mlp.c_proj.weight', 'mlp.c_proj.bias']
    assert list(model.state_dict()) == (['tokens_processed', 'transformer.wte.weight', 'transformer.wpe.weight']
                                        + [f'transformer.h.0.{k}' for k in block]
                                        + ['transformer.ln_f.weight', 'transformer.ln_f.bias', 'lm_head.weight'])
    assert [n for n, _ in model.transformer.named_children()] == ['wte', 'wpe', 'drop', 'h', 'ln_f']
    assert all(type(m) is nn.LayerNorm for n, m in model.named_modules() if '.ln_' in n or n.endswith('ln_f'))
    assert type(model.transformer.h[0].mlp.gelu) is nn.GELU


def test_a_llama_style_model_has_its_own_modules_and_keys():
    model = GPT(GPTConfig(**CFG, bias=False, **LLAMA))
    sd = model.state_dict()
    assert 'transformer.wpe.weight' not in sd and not hasattr(model.transformer, 'wpe')
    # untied: two matrices, each a parameter of its own, both in the state_dict
    assert model.transformer.wte.weight is not model.lm_head.weight
    names = [n for n, _ in model.named_parameters()]
    assert 'transformer.wte.weight' in names and 'lm_head.weight' in names
    assert 'transformer.wte.weight' in sd and 'lm_head.weight' in sd
    for name in ('transformer.h.0.ln_1', 'transformer.h.1.ln_2', 'transformer.ln_f'):
        norm = model.get_submodule(name)
        assert type(norm) is nn.RMSNorm and norm.eps == 1e-5 and norm.weight.shape == (32,)
        assert name + '.bias' not in sd
    mlp = model.transformer.h[0].mlp
    assert (mlp.c_fc.out_features, mlp.c_gate.out_features, mlp.c_proj.in_features) == (128,) * 3


def test_rmsnorm_ignores_bias_and_swiglu_takes_it():
    """RMSNorm has a gain only (Zhang & Sennrich 2019); the SwiGLU Linears follow config.bias."""
    model = GPT(GPTConfig(**CFG, bias=True, norm='rmsnorm', mlp='swiglu'))
    assert [n for n, _ in model.transformer.h[0].ln_1.named_parameters()] == ['weight']
    assert 'transformer.h.0.ln_1.bias' not in model.state_dict()
    assert all(getattr(model.transformer.h[0].mlp, n).bias is not None for n in ('c_fc', 'c_gate', 'c_proj'))


def test_swiglu_hidden_width_rule():
    """2/3 of 4 * n_embd, rounded up to a multiple of 64: the three matrices hold about GELU's 8 * n_embd^2."""
    from model import swiglu_hidden
    for n_embd in range(8, 2049, 8):
        h = swiglu_hidden(n_embd)
        assert h % 64 == 0 and 8 * n_embd / 3 <= h < 8 * n_embd / 3 + 64, n_embd
    assert swiglu_hidden(768) == 2048


def test_swiglu_gates_through_silu():
    torch.manual_seed(0)
    mlp = GPT(GPTConfig(**CFG, mlp='swiglu')).transformer.h[0].mlp
    x = torch.randn(2, 5, 32)
    by_hand = mlp.c_proj(F.silu(mlp.c_gate(x)) * mlp.c_fc(x))
    torch.testing.assert_close(mlp(x), by_hand)
    assert not torch.allclose(mlp(x), mlp.c_proj(F.silu(mlp.c_fc(x)) * mlp.c_gate(x)))


def test_rope_rotates_by_position_so_attention_sees_relative_positions():
    """RoFormer's property (Su et al. 2021, §3.2): <R_m q, R_n k> depends on m - n only; rotations keep
    norms; position 0 is the identity."""
    from model import apply_rope, rope_angles
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 8, dtype=torch.float64), torch.randn(1, 1, 1, 8, dtype=torch.float64)
    cos, sin = rope_angles(40, 8, 'cpu')

    def at(x, t):
        return apply_rope(x, cos[t:t + 1], sin[t:t + 1])
    for m, n, shift in [(3, 1, 7), (10, 25, 4), (0, 0, 30)]:
        torch.testing.assert_close((at(q, m) * at(k, n)).sum(), (at(q, m + shift) * at(k, n + shift)).sum(),
                                   rtol=1e-6, atol=1e-6)
    assert not torch.allclose((at(q, 3) * at(k, 1)).sum(), (at(q, 3) * at(k, 2)).sum())
    torch.testing.assert_close(at(q, 17).norm(), q.norm(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(at(q, 0), q)
    assert at(q.to(torch.bfloat16), 5).dtype == torch.bfloat16


@pytest.mark.parametrize('arch', ARCHITECTURES, ids=arch_id)
def test_every_option_combination_trains_generates_and_crops(arch):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG, **arch))
    idx, targets = torch.randint(0, 65, (4, 16)), torch.randint(0, 65, (4, 16))
    logits, loss = model(idx, targets)
    assert logits.shape == (4, 16, 65) and abs(loss.item() - math.log(65)) < 0.1
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    assert ('wpe' in model.transformer) == (arch['pos_emb'] == 'learned')
    assert (model.transformer.wte.weight is model.lm_head.weight) == arch['tie_embeddings']
    model.eval()
    assert model.generate(idx[:1, :3], max_new_tokens=20, top_k=5).shape == (1, 23)
    model.crop_block_size(8)
    assert model(idx[:, :8])[0].shape == (4, 1, 65)
    with pytest.raises(ValueError):
        model(idx[:, :9])


def test_rope_sees_the_order_of_the_tokens():
    """Without wpe, positions reach the model through rope alone: the same tokens in another order
    give the last position other logits."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG, pos_emb='rope')).eval()
    idx = torch.randint(0, 65, (1, 16))
    swapped = torch.cat([idx[:, :-1].flip(1), idx[:, -1:]], dim=1)
    assert not torch.allclose(model(idx)[0], model(swapped)[0])


def test_the_layer_config_builds_rmsnorm_where_the_model_normalises_with_it():
    class MyRMSNorm(nn.RMSNorm):
        pass

    class MyLayerNorm(nn.LayerNorm):
        pass

    with set_contextual_config(RMSNorm=MyRMSNorm, LayerNorm=MyLayerNorm):
        rms = GPT(GPTConfig(**CFG, norm='rmsnorm'))
        ln = GPT(GPTConfig(**CFG))
    norms = lambda m: [type(x) for n, x in m.named_modules() if n.split('.')[-1].startswith('ln_')]  # noqa: E731
    assert norms(rms) == [MyRMSNorm] * 5 and norms(ln) == [MyLayerNorm] * 5


@pytest.mark.parametrize('arch', ARCHITECTURES, ids=arch_id)
def test_parameter_counts_leave_out_lookup_tables(arch):
    model = GPT(GPTConfig(**CFG, **arch))
    total = sum(p.numel() for p in model.parameters())
    assert model.get_num_params(non_embedding=False) == total
    wpe = 16 * 32 if arch['pos_emb'] == 'learned' else 0
    wte = 0 if arch['tie_embeddings'] else 65 * 32  # tied, it is also the head's matmul
    assert model.get_num_params() == total - wpe - wte
    assert model.estimate_mfu(4, 0.1) > 0


def test_configure_optimizers_leaves_rmsnorm_gains_undecayed():
    model = GPT(GPTConfig(**CFG, bias=False, **LLAMA))
    decay, nodecay = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), 'cpu').param_groups
    gains = [p for n, p in model.named_parameters() if '.ln_' in n or 'ln_f' in n]
    assert len(nodecay['params']) == len(gains) == 5 and all(any(p is g for g in gains) for p in nodecay['params'])
    assert len(decay['params']) == len(list(model.parameters())) - 5


@pytest.mark.parametrize('change, words', [
    (dict(norm='batchnorm'), "norm='batchnorm' is not one of layernorm, rmsnorm"),
    (dict(mlp='relu'), "mlp='relu' is not one of gelu, swiglu"),
    (dict(pos_emb='alibi'), "pos_emb='alibi' is not one of learned, rope"),
    (dict(tie_embeddings='yes'), "tie_embeddings='yes' must be True or False"),
    (dict(pos_emb='rope', n_embd=30, n_head=2), "head size n_embd / n_head = 30 / 2 must be even"),
])
def test_an_architecture_that_cannot_be_built_is_one_line(change, words):
    with pytest.raises(ValueError) as error:
        GPT(GPTConfig(**{**CFG, **change}))
    assert words in str(error.value) and '\n' not in str(error.value)


def test_the_grad_scaler_scales_float16_alone_and_is_the_sharded_one_under_fsdp():
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    from model import grad_scaler
    assert grad_scaler('cpu', enabled=True).is_enabled() and not grad_scaler('cpu', enabled=False).is_enabled()
    assert not isinstance(grad_scaler('cpu', enabled=True), ShardedGradScaler)
    assert isinstance(grad_scaler('cpu', enabled=True, fsdp=True), ShardedGradScaler)


def adamw_pair(fused):
    """Two identical small models' AdamW (fused or not), the second for a reference step."""
    torch.manual_seed(0)
    params = [torch.randn(4, 3, requires_grad=True), torch.randn(3, requires_grad=True)]
    copies = [p.detach().clone().requires_grad_() for p in params]
    return (torch.optim.AdamW(params, lr=0.1, fused=fused), params), (torch.optim.AdamW(copies, lr=0.1, fused=fused), copies)


@pytest.mark.parametrize("fused", [True, False])
def test_a_step_from_non_finite_gradients_is_skipped_and_counted_on_the_device(fused, monkeypatch):
    """step_unless_nonfinite: a finite step is the optimizer's own step, a non-finite one leaves the
    weights, moments and step count as they were, and the count of such steps in a row goes on the
    device. A fused AdamW decides it there (no read of the norm); another optimizer reads it."""
    from model import step_unless_nonfinite
    scaler = torch.amp.GradScaler('cpu', enabled=False)
    (optimizer, params), (reference, copies) = adamw_pair(fused)
    reads = []  # model.py's reads of a tensor's value
    item = torch.Tensor.item
    def counted(self):
        reads.append(sys._getframe(1).f_code.co_filename.endswith("model.py"))
        return item(self)
    monkeypatch.setattr(torch.Tensor, "item", counted)
    count = 0
    for step, bad in enumerate([False, True, True, False, True]):
        grads = [torch.randn_like(p) for p in params]
        if bad:
            grads[1][0] = math.nan
        for p, q, g in zip(params, copies, grads):
            p.grad, q.grad = g.clone(), g.clone()
        norm = torch.nn.utils.clip_grad_norm_(params, float('inf'))
        count = step_unless_nonfinite(optimizer, scaler, norm, count)
        if not bad:
            reference.step()
        assert torch.is_tensor(count) and count.dtype == torch.float32
        assert float(count) == {0: 0, 1: 1, 2: 2, 3: 0, 4: 1}[step]
        assert all(torch.equal(p, q) for p, q in zip(params, copies)), step
        for p, q in zip(params, copies):
            assert torch.equal(optimizer.state[p]['exp_avg'], reference.state[q]['exp_avg'])
            assert float(optimizer.state[p]['step']) == float(reference.state[q]['step'])
    assert not hasattr(optimizer, 'found_inf')
    assert sum(reads) == (0 if fused else 5)


def test_a_float16_step_is_left_to_the_grad_scaler():
    from model import step_unless_nonfinite
    (optimizer, params), _ = adamw_pair(True)
    stepped = []
    class Scaler:
        def is_enabled(self):
            return True
        def step(self, opt):
            stepped.append(opt)
    for p in params:
        p.grad = torch.full_like(p, math.inf)
    count = step_unless_nonfinite(optimizer, Scaler(), torch.tensor(math.inf), torch.tensor(3.0))
    assert stepped == [optimizer] and float(count) == 0


def test_adamw_is_fused_on_the_cpu_too():
    optimizer = GPT(GPTConfig(**CFG)).configure_optimizers(0.1, 1e-3, (0.9, 0.95), 'cpu')
    assert optimizer.defaults['fused']
