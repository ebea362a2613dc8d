"""
nanogns.olmo.GNSCallback and the measured layers in OLMo-core's models. In one process: OLMo-core's
llama-like transformer measured by nanogns.measure (its RMSNorm a known class; one with a bias, or
gains of another shape, left out with the reason) against per-example gradients from torch.func; the
callback's settings refused in one line.
"""
import warnings

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("olmo_core", reason="OLMo-core (ai2-olmo-core, the 'olmo' extra) is not installed")

from olmo_core.nn.layer_norm import RMSNorm as OlmoRMSNorm  # noqa: E402
from olmo_core.nn.transformer import TransformerConfig  # noqa: E402

import nanogns  # noqa: E402
from gns_fixtures import sqgradnorm_sums  # noqa: E402
from nanogns.olmo import GNSCallback, GNSCallbackError  # noqa: E402

VOCAB = 64


def tiny_olmo(seed=0, **kwargs):
    torch.manual_seed(seed)
    model = TransformerConfig.llama_like(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=2,
                                         **kwargs).build(init_device="cpu")
    with torch.no_grad():  # gains away from their init of ones, so that each norm is a real test
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def lm_loss(forward, ids):
    """The mean over the batch of each example's mean next-token loss (OLMo-core's, with equal lengths)."""
    logits = forward(ids[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


@pytest.mark.parametrize("linear", ["gns", "shim"])
def test_an_olmo_core_transformer_is_measured_exactly(linear):
    model = tiny_olmo()
    batches = [torch.randint(0, VOCAB, (3, 9), generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    want = sqgradnorm_sums(model, lm_loss, [(b,) for b in batches])  # the plain model's, per example
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every parameter measured: no coverage warning
        nanogns.measure(model, linear=linear)
    kinds = nanogns.layers.layer_kinds(model)
    assert kinds["blocks.0.attention_norm.weight"] == "rmsnorm" and kinds["lm_head.w_out.weight"] == "linear"
    assert len(kinds) == len(list(model.parameters()))
    for ids in batches:
        (lm_loss(model, ids) / len(batches)).backward()
    got = {name: sq.item() for name, _, sq, _ in nanogns.find_sqgradnorm_buffers(model)}
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert got[name] == pytest.approx(value.item(), rel=1e-5), name


def test_an_olmo_rmsnorm_with_a_bias_is_left_out_with_the_reason():
    model = torch.nn.Sequential(OlmoRMSNorm(size=8, bias=True), torch.nn.Linear(8, 8))
    with pytest.warns(UserWarning, match=r"0.weight \(RMSNorm: an RMSNorm with a bias") as caught:
        nanogns.measure(model)
    assert "\n" not in str(caught[0].message)
    assert "0.weight_sqgradnorm" not in dict(model.named_buffers())


@pytest.mark.parametrize("settings, words", [
    (dict(bs_controller="yes"), "bs_controller='yes' is not one of 'none', 'gns'"),
    (dict(bs_controller="gns"), "bs_max_tokens=None is not valid"),
    (dict(bs_controller="gns", bs_max_tokens=64, bs_gns_fraction=0), "bs_gns_fraction=0 is not valid"),
    (dict(bs_controller="gns", bs_max_tokens=64, bs_gns_group="adam"), "bs_gns_group='adam' is not valid"),
    (dict(bs_controller="gns", bs_max_tokens=64, bs_warmup_steps=0), "bs_warmup_steps=0 is not valid"),
])
def test_the_callbacks_settings_are_checked_in_one_line(settings, words):
    with pytest.raises(GNSCallbackError, match=words.replace("(", r"\(")) as caught:
        GNSCallback(**settings)
    assert "\n" not in str(caught.value)
