"""
Which Linear / Embedding / LayerNorm classes model.py builds.

The model reads the configuration when it is *constructed*, not when it is imported, so a
script can build a plain GPT and a per-example-norm GPT side by side:

    with set_contextual_config(Linear=PEGradNormLinear, LayerNorm=PEGradNormSeparatedLayerNorm):
        model = GPT(config)

Every class must be a drop-in for the torch one: the same constructor arguments and the same
parameter names. LayerNorm is called as LayerNorm(ndim, bias=bool), which torch's own
nn.LayerNorm accepts.

The classes in force are the namedtuple `config` (fields Embedding, Linear, LayerNorm), which
set_contextual_config rebinds and restores: a model written for the reference implementation
(`import layer_config as lc` ... `lc.config.Linear(...)` in its __init__) reads it the same way.
"""
from collections import namedtuple
from contextlib import contextmanager

import torch.nn as nn

LayerClasses = namedtuple("LayerClasses", ["Embedding", "Linear", "LayerNorm"])


def init_contextual_config():
    """Back to torch's classes."""
    global config
    config = LayerClasses(Embedding=nn.Embedding, Linear=nn.Linear, LayerNorm=nn.LayerNorm)


init_contextual_config()


def get_contextual_config():
    """The classes in force now, as a dict with keys Embedding, Linear, LayerNorm."""
    return config._asdict()


@contextmanager
def set_contextual_config(**classes):
    """
    Override some of the layer classes inside a `with` block (the others stay as they are; None
    keeps one as it is); yields the namedtuple now in force and restores the previous one on exit.
    """
    global config
    unknown = set(classes) - set(LayerClasses._fields)
    if unknown:
        raise ValueError(f"unknown layer kind(s) {sorted(unknown)}; choose from {sorted(LayerClasses._fields)}")
    saved = config
    config = config._replace(**{k: v for k, v in classes.items() if v is not None})
    try:
        yield config
    finally:
        config = saved
