"""
Which Linear / Embedding / LayerNorm / RMSNorm classes model.py builds.

The model reads the configuration when it is *constructed*, not when it is imported, so a
script can build a plain GPT and a per-example-norm GPT side by side:

    with set_contextual_config(Linear=PEGradNormLinear, LayerNorm=PEGradNormSeparatedLayerNorm):
        model = GPT(config)

Every class must be a drop-in for the torch one: the same constructor arguments and the same
parameter names. LayerNorm is called as LayerNorm(ndim, bias=bool), which torch's own
nn.LayerNorm accepts; RMSNorm as torch's nn.RMSNorm(normalized_shape, eps=None, ...).

The classes in force are the namedtuple `config` (fields Embedding, Linear, LayerNorm, RMSNorm:
the reference's three in its order, then RMSNorm), which set_contextual_config rebinds and
restores: a model written for the reference implementation (`import layer_config as lc` ...
`lc.config.Linear(...)` in its __init__) reads it the same way.

FLAG_CLASSES maps train.py's --linearclass / --embeddingclass / --lnclass values to classes; it
is derived from nanogns.layers.MEASURED_CLASSES (the registry measure() uses too), so a new layer class
is its code plus one entry there. train.py, configurator.py, bench/ and the tests read it.
--lnclass chooses the class of whichever normalisation the model uses, so each of its values
gives one class per normalisation kind (FLAG_KINDS), LayerNorm and RMSNorm:

    with set_contextual_config(**classes_for_flags(linearclass='gns', lnclass='fused')):
        model = GPT(config)   # its LayerNorms PEGradNormFusedLayerNorm, its RMSNorms PEGradNormFusedRMSNorm
"""
from collections import namedtuple
from contextlib import contextmanager

import torch.nn as nn

# model.py ties wte to lm_head through here, so that only the measured layers know how they link
from nanogns.layers.embedding import tie_weights  # noqa: F401
from nanogns.layers.experts import Experts
from nanogns.layers.registry import KIND_NAMES, MEASURED_CLASSES

# RMSNorm and Experts last and with defaults, so that the reference's three-class LayerClasses(...) still builds
LayerClasses = namedtuple("LayerClasses", ["Embedding", "Linear", "LayerNorm", "RMSNorm", "Experts"],
                          defaults=(nn.RMSNorm, Experts))


def init_contextual_config():
    """Back to torch's classes (and the unmeasured mixture-of-experts Experts)."""
    global config
    config = LayerClasses(Embedding=nn.Embedding, Linear=nn.Linear, LayerNorm=nn.LayerNorm, RMSNorm=nn.RMSNorm,
                          Experts=Experts)


init_contextual_config()


def get_contextual_config():
    """The classes in force now, as a dict with keys Embedding, Linear, LayerNorm, RMSNorm."""
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


# train.py's flag for each kind of layer (a tuple where one flag chooses for several kinds), and
# what each of its values builds: a class, or for a flag of several kinds a dict with a class per
# kind. nn is torch's (not measured); the others are MEASURED_CLASSES' values, derived
# here and never written twice: gns computes gradient and norms in one backward, shim keeps
# torch's backward and adds the norms beside it (the separated normalisations), fused is the
# normgnorm kernel (nanogns.layers.norms' fused normalisations)
FLAG_KINDS = {'linearclass': 'Linear', 'embeddingclass': 'Embedding', 'lnclass': ('LayerNorm', 'RMSNorm')}
KIND_OF = {name: kind for kind, name in KIND_NAMES.items()}  # 'Linear' -> 'linear', ...
TORCH_CLASSES = dict(Linear=nn.Linear, Embedding=nn.Embedding, LayerNorm=nn.LayerNorm, RMSNorm=nn.RMSNorm)


def _flag_table(names):
    """{value: class} for a flag of one kind, {value: {kind name: class}} for a flag of several."""
    values = ['nn'] + list(dict.fromkeys(v for n in names for v in MEASURED_CLASSES[KIND_OF[n]]))
    table = {}
    for value in values:
        classes = {n: TORCH_CLASSES[n] if value == 'nn' else MEASURED_CLASSES[KIND_OF[n]][value] for n in names}
        table[value] = classes if len(names) > 1 else classes[names[0]]
    return table


FLAG_CLASSES = {flag: _flag_table((kinds,) if isinstance(kinds, str) else kinds) for flag, kinds in FLAG_KINDS.items()}


def flag_kinds(flag):
    """The layer kinds `flag` chooses the classes of, as a tuple."""
    kinds = FLAG_KINDS[flag]
    return (kinds,) if isinstance(kinds, str) else tuple(kinds)


def _entry_classes(flag, value):
    """{kind: class} of one table entry; an entry that leaves out a kind of its flag is an error."""
    entry, kinds = FLAG_CLASSES[flag][value], flag_kinds(flag)
    classes = dict(entry) if isinstance(entry, dict) else {kinds[0]: entry} if len(kinds) == 1 else {}
    if set(classes) != set(kinds):
        raise ValueError(f"FLAG_CLASSES[{flag!r}][{value!r}] must give a class for each of {', '.join(kinds)}, "
                         f"as {{{', '.join(f'{k!r}: ...' for k in kinds)}}}")
    return classes


def classes_for_flags(**flags):
    """
    set_contextual_config's keyword arguments (Linear=..., Embedding=..., LayerNorm=...,
    RMSNorm=...) for train.py's flag values, e.g. classes_for_flags(lnclass='shim'); a flag not
    given is 'nn'.
    """
    unknown = set(flags) - set(FLAG_CLASSES)
    if unknown:
        raise ValueError(f"unknown layer flag(s) {sorted(unknown)}; choose from {', '.join(FLAG_CLASSES)}")
    classes = {}
    for flag, values in FLAG_CLASSES.items():
        value = flags.get(flag, 'nn')
        if value not in values:
            raise ValueError(f"--{flag}={value!r} is not one of {', '.join(values)}")
        classes.update(_entry_classes(flag, value))
    # routed experts (model.py's MoE MLP) are measured whenever the Linears are, by their one class
    classes['Experts'] = Experts if flags.get('linearclass', 'nn') == 'nn' else MEASURED_CLASSES['experts']['gns']
    return classes
