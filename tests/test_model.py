"""model.py: shapes, loss at initialisation, weight tying, the layer config, options."""
import math
import re

import pytest
import torch
import torch.nn as nn

from layer_config import get_contextual_config, set_contextual_config
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


def test_bias_off_and_options_run_forward_and_backward():
    cfg = GPTConfig(**CFG, bias=False, cos_attn=[1], spectral_c_attn=[0], fp32_attention_layers=[1])
    model = GPT(cfg)
    assert model.transformer.h[0].ln_1.bias is None
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


def test_load_weights_maps_the_references_and_nanogpts_keys_and_refuses_what_does_not_fit():
    from model import CheckpointError, load_weights
    torch.manual_seed(0)
    source = GPT(GPTConfig(**CFG, bias=False, spectral_c_attn=[1]))
    sd = source.state_dict()
    reference = {}
    for k, v in sd.items():
        k = k.replace(".attn.c_attn.weight", ".attn.c_attn.qkv.weight").replace(".ln_1.", ".ln_1.affine.")
        reference[k] = v
    reference["transformer.h.0.ln_1.affine.bias"] = torch.zeros(32)  # its bias=False separated LayerNorm
    reference["transformer.h.0.ln_1.affine.weight_upegsqnorm"] = torch.tensor([2.0, 8.0])
    reference["transformer.h.1.attn.c_attn.scale"] = torch.tensor(1.1)  # its spectral Q/K/V scale
    reference["transformer.h.0.attn.bias"] = torch.ones(1, 1, 16, 16)  # nanoGPT's causal mask (torch < 2)
    target = GPT(GPTConfig(**CFG, bias=False, spectral_c_attn=[1]))
    notes = load_weights(target, {"_orig_mod." + k: v for k, v in reference.items()})
    assert all(torch.equal(v, target.state_dict()[k]) for k, v in sd.items())
    assert any("renamed" in n for n in notes)
    # nanoGPT's checkpoints count no tokens: the caller's count is used, and said so
    notes = load_weights(target, {k: v for k, v in sd.items() if k != "tokens_processed"}, tokens_processed=640)
    assert target.tokens_processed.item() == 640 and any("no tokens_processed" in n for n in notes)
    # a non-zero bias has no place in a bias=False model, a weight of another shape or a key of another model neither
    for bad, words in [({**sd, "transformer.h.0.ln_1.bias": torch.ones(32)}, "transformer.h.0.ln_1.bias"),
                       ({**sd, "transformer.wpe.weight": torch.zeros(8, 32)}, "has shape (8, 32)"),
                       ({k: v for k, v in sd.items() if k != "lm_head.weight"}, "lacks lm_head.weight"),
                       ({**sd, "transformer.h.0.mlp.gate.weight": torch.zeros(3)}, "mlp.gate.weight")]:
        with pytest.raises(CheckpointError, match=re.escape(words)):
            load_weights(GPT(GPTConfig(**CFG, bias=False, spectral_c_attn=[1])), bad)
