"""
Which Linear / Embedding / LayerNorm classes model.py builds.

The model reads the configuration when it is *constructed*, not when it is imported, so a
script can build a plain GPT and a per-example-norm GPT side by side:

    with set_contextual_config(Linear=PEGradNormLinear, LayerNorm=PEGradNormSeparatedLayerNorm):
        model = GPT(config)

Every class must be a drop-in for the torch one: the same constructor arguments and the same
parameter names. LayerNorm is called as LayerNorm(ndim, bias=bool), which torch's own
nn.LayerNorm accepts.
"""
from contextlib import contextmanager

import torch.nn as nn

_DEFAULTS = dict(Linear=nn.Linear, Embedding=nn.Embedding, LayerNorm=nn.LayerNorm)
_config = dict(_DEFAULTS)


def get_contextual_config():
    """The classes in force now, as a dict with keys Linear, Embedding, LayerNorm."""
    return dict(_config)


@contextmanager
def set_contextual_config(**classes):
    """Override some of the layer classes inside a `with` block; restored on exit."""
    unknown = set(classes) - set(_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown layer kind(s) {sorted(unknown)}; choose from {sorted(_DEFAULTS)}")
    saved = dict(_config)
    _config.update({k: v for k, v in classes.items() if v is not None})
    try:
        yield get_contextual_config()
    finally:
        _config.clear()
        _config.update(saved)
