"""layer_config.py: the classes in force, as the namedtuple the reference's model reads and as our dict."""
import pytest
import torch.nn as nn

import layer_config as lc
from buffered import PEGradNormEmbedding, PEGradNormLinear, PEGradNormSeparatedLayerNorm
from fused_gns import PEGradNormFusedLayerNorm

TORCH = dict(Embedding=nn.Embedding, Linear=nn.Linear, LayerNorm=nn.LayerNorm)


class ReferenceStyleModel(nn.Module):
    """Written as the reference's model.py is: `lc.config.X(...)` read in __init__."""

    def __init__(self):
        super().__init__()
        self.wte = lc.config.Embedding(10, 8)
        self.ln = lc.config.LayerNorm(8, bias=False)
        self.fc = lc.config.Linear(8, 4)


def test_a_reference_style_model_gets_the_classes_in_force_then_torchs():
    with lc.set_contextual_config(Embedding=PEGradNormEmbedding, Linear=PEGradNormLinear,
                                  LayerNorm=PEGradNormSeparatedLayerNorm) as config:
        assert config is lc.config
        model = ReferenceStyleModel()
    assert type(model.wte) is PEGradNormEmbedding and type(model.fc) is PEGradNormLinear
    assert type(model.ln) is PEGradNormSeparatedLayerNorm and model.ln.bias is None
    plain = ReferenceStyleModel()
    assert (type(plain.wte), type(plain.ln), type(plain.fc)) == (nn.Embedding, nn.LayerNorm, nn.Linear)


def test_the_config_is_a_namedtuple_and_get_contextual_config_a_dict():
    assert lc.config._fields == ("Embedding", "Linear", "LayerNorm")  # the reference's order
    assert lc.config._asdict() == TORCH and lc.get_contextual_config() == TORCH
    assert type(lc.get_contextual_config()) is dict


def test_unspecified_classes_stay_as_they_were_and_each_level_is_restored():
    # the reference's set_contextual_config dropped the classes not named: its inner config
    # would have no Linear
    with lc.set_contextual_config(Linear=PEGradNormLinear):
        with lc.set_contextual_config(LayerNorm=PEGradNormFusedLayerNorm, Embedding=None) as inner:
            assert inner == (nn.Embedding, PEGradNormLinear, PEGradNormFusedLayerNorm)
            assert lc.get_contextual_config() == dict(TORCH, Linear=PEGradNormLinear, LayerNorm=PEGradNormFusedLayerNorm)
        assert lc.config == (nn.Embedding, PEGradNormLinear, nn.LayerNorm)
    assert lc.config._asdict() == TORCH


def test_restored_after_an_error_and_unknown_kinds_refused():
    with pytest.raises(KeyError):
        with lc.set_contextual_config(Linear=PEGradNormLinear):
            raise KeyError("inside")
    assert lc.config.Linear is nn.Linear
    with pytest.raises(ValueError, match="unknown layer kind"):
        with lc.set_contextual_config(Conv=nn.Conv1d):
            pass


def test_init_contextual_config_goes_back_to_torchs_classes():
    with lc.set_contextual_config(Linear=PEGradNormLinear):
        lc.init_contextual_config()
        assert lc.config._asdict() == TORCH
        with lc.set_contextual_config(Embedding=PEGradNormEmbedding):
            assert lc.config.Embedding is PEGradNormEmbedding
    assert lc.config._asdict() == TORCH
