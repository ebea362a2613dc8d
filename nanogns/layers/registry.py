"""
The registry of measured classes (MEASURED_CLASSES: kind and flag value -> class, whence
nanogns.layers.config's flags), the classes measure() converts (SOURCE_KINDS, with Hugging Face's by name),
Hugging Face's mixture-of-experts blocks it measures (MOE_BLOCKS) and the blocks whose layers see tokens
(TOKEN_BLOCKS), and measure(), which swaps the layers of any model for their measured classes in place.
"""
import functools
import types
import warnings
import weakref

import torch
import torch.nn as nn
from torch.nn.utils.parametrize import is_parametrized

from nanogns.layers.buffers import MeasuredLayer, find_sqgradnorm_buffers, keep_out_of_ddp_broadcast
from nanogns.layers.embedding import PEGradNormEmbedding, PEGradNormShimEmbedding, _MeasuredEmbedding, link_tied
from nanogns.layers.experts import EXPERT_PARAMETERS, Experts, PEGradNormExperts
from nanogns.layers import routed
from nanogns.layers.hf_moe import PEGradNormHFExperts, PEGradNormHFRouter
from nanogns.layers.linear import PEGradNormLinear, PEGradNormShimLinear, _MeasuredLinear
from nanogns.layers.norms import (LayerNorm, PEGradNormFusedLayerNorm, PEGradNormFusedRMSNorm,
                                  PEGradNormSeparatedLayerNorm, PEGradNormSeparatedRMSNorm)
from nanogns.layers.uses import LayerCalls, refuse_outside_uses
# the kinds' names (the analysis's groups, nanogns.layers.config's classes); norm= chooses for both NORM_KINDS
from nanogns.maths import KIND_NAMES, NORM_KINDS


# ---------------------------------------------------------------------------------------------
# The registry, and measure(): per-example norms put into any model

# For each kind of layer and each flag value, the measured class: the one table that
# nanogns.layers.config's flags (so train.py's --linearclass / --embeddingclass / --lnclass), measure()
# and the analysis's layer groups come from. A new measured layer type is its class plus one
# entry here.
MEASURED_CLASSES = {
    "linear": {"gns": PEGradNormLinear, "shim": PEGradNormShimLinear},
    "embedding": {"gns": PEGradNormEmbedding, "shim": PEGradNormShimEmbedding},
    "layernorm": {"shim": PEGradNormSeparatedLayerNorm, "fused": PEGradNormFusedLayerNorm},
    "rmsnorm": {"shim": PEGradNormSeparatedRMSNorm, "fused": PEGradNormFusedRMSNorm},
    # routed experts: one class, which measure() (and model.py) use whenever the Linears are measured
    "experts": {"gns": PEGradNormExperts},
}
# The classes measure() converts, each to the measured class of its kind: torch's, ours, and
# foreign ones named by their module path, so that their package is never imported here (a model
# holding one has imported it). Exact classes only: a subclass may compute something else, so it
# is named with kinds= or left unmeasured (the coverage warning lists it).
SOURCE_KINDS = {
    nn.Linear: "linear", nn.Embedding: "embedding", nn.LayerNorm: "layernorm", LayerNorm: "layernorm",
    nn.RMSNorm: "rmsnorm", Experts: "experts",
    # Hugging Face's GPT-2 layers: y = x W + b, a Linear whose weight is stored [in, out]
    "transformers.pytorch_utils.Conv1D": "linear",
    # Hugging Face's Llama-family RMSNorm (gain `weight`, eps `variance_epsilon`): the same maths as
    # nn.RMSNorm, the normalisation in float32 (Gemma's (1 + weight) is another class, not listed)
    **{f"transformers.models.{m}.modeling_{m}.{c}RMSNorm": "rmsnorm" for m, c in [
        ("llama", "Llama"), ("mistral", "Mistral"), ("mixtral", "Mixtral"), ("qwen2", "Qwen2"),
        ("qwen2_moe", "Qwen2Moe"), ("qwen3", "Qwen3"), ("qwen3_moe", "Qwen3Moe"), ("phi3", "Phi3"),
        ("granite", "Granite"), ("smollm3", "SmolLM3"), ("deepseek_v3", "DeepseekV3"), ("olmoe", "Olmoe")]},
    # OLMo-core's (olmo_core.nn.layer_norm; size, eps, optional bias, normalised in float32): torch's maths.
    # Its variants with another rounding order or a fused kernel are other classes, not listed.
    "olmo_core.nn.layer_norm.LayerNorm": "layernorm", "olmo_core.nn.layer_norm.RMSNorm": "rmsnorm",
}
TRANSPOSED_WEIGHT = {"transformers.pytorch_utils.Conv1D"}  # weight [in, out]
# Hugging Face's mixture-of-experts blocks measured exactly (nanogns/layers/hf_moe.py): {block class:
# (its router's class, the child `gate`; its routed experts' class, the child `experts`)}. Each flattens
# the batch to [B*T, H] rows in example order: the router and the experts are converted in place to
# their measured classes, and every Linear inside (Qwen2-MoE's shared_expert and shared_expert_gate,
# DeepSeek-V3's shared_experts) is measured with flat_examples (its rows viewed [B, T, K]).
MOE_BLOCKS = {
    f"transformers.models.{m}.modeling_{m}.{block}": (f"transformers.models.{m}.modeling_{m}.{router}",
                                                      f"transformers.models.{m}.modeling_{m}.{experts}")
    for m, block, router, experts in [
        ("mixtral", "MixtralSparseMoeBlock", "MixtralTopKRouter", "MixtralExperts"),
        ("qwen2_moe", "Qwen2MoeSparseMoeBlock", "Qwen2MoeTopKRouter", "Qwen2MoeExperts"),
        ("qwen3_moe", "Qwen3MoeSparseMoeBlock", "Qwen3MoeTopKRouter", "Qwen3MoeExperts"),
        ("olmoe", "OlmoeSparseMoeBlock", "OlmoeTopKRouter", "OlmoeExperts"),
        ("deepseek_v3", "DeepseekV3MoE", "DeepseekV3TopkRouter", "DeepseekV3Experts")]}
# Blocks whose layers work on tokens, not examples, that measure() does not know how to measure: every
# layer inside one is left out (a routed expert may get exactly B rows by chance). None at present: the
# known families' blocks are MOE_BLOCKS. By the same rule, a module whose name in its parent holds
# "expert" (an `experts` ModuleList, a `shared_expert`) outside a MOE_BLOCKS block is left out in any
# model, and kinds={Block: None} leaves out a block measure() does not know.
TOKEN_BLOCKS = set()


def _class_path(cls):
    return f"{cls.__module__}.{cls.__qualname__}"


def source_kind(cls, kinds=None):
    """The kind measure() converts a module of class `cls` as, or None: kinds= first, then SOURCE_KINDS."""
    if kinds and cls in kinds:
        return kinds[cls]
    return SOURCE_KINDS.get(cls) or SOURCE_KINDS.get(_class_path(cls))


def _token_rows(name, module, kinds, in_moe_block=False):
    """Why the layers in `module` (called `name` in the model) see tokens rather than examples, by
    what it is (kinds={Class: None}, TOKEN_BLOCKS, an expert's name outside a MOE_BLOCKS block), or None."""
    cls = type(module)
    if isinstance(module, Experts) and kinds.get(cls, "") is not None:
        return None  # routed experts that keep each row's example: measured per example
    if kinds and kinds.get(cls, "") is None:
        return f"in {name} ({cls.__name__}), left out by kinds={{{cls.__name__}: None}}"
    if in_moe_block:
        return None  # a known block's router, experts and shared experts: measured by their rows' examples
    if cls in TOKEN_BLOCKS or _class_path(cls) in TOKEN_BLOCKS:
        return f"in the mixture-of-experts block {name} ({cls.__name__}): its rows are tokens, not examples"
    if "expert" in name.rsplit(".", 1)[-1].lower():
        return f"in the expert {name}: its rows are tokens, not examples"
    return None


def kind_of_measured(cls):
    """The kind of a measured class (MEASURED_CLASSES), or None for any other class."""
    for kind, values in MEASURED_CLASSES.items():
        if cls in values.values():
            return kind
    return None


def layer_kinds(model):
    """{parameter name: kind} of every measured parameter (find_sqgradnorm_buffers' names): what
    the analysis groups them by (nanogns.maths.KINDS_NAME in out_dir)."""
    beside_experts = set()  # a Linear beside measured experts, in the block that holds them, is their router
    for parent in model.modules():
        children = list(parent.children())
        if any(isinstance(c, PEGradNormExperts) for c in children):
            beside_experts.update(id(c) for c in children)
    kinds = {}
    for module in model.modules():
        kind = getattr(module, "_gns_kind", None)  # set by measure() or the class (nanogns/layers/hf_moe.py)
        if kind is None:
            kind = kind_of_measured(type(module))
            kind = "router" if kind == "linear" and id(module) in beside_experts else kind
        for p in module.parameters(recurse=False):
            if kind is not None:
                kinds.setdefault(id(p), kind)
    found = {}
    for name, p, sq, _ in find_sqgradnorm_buffers(model):
        if id(p) in kinds:
            for each in entry_names(name, sq):
                found[each] = kinds[id(p)]
    return found


def entry_names(name, sq):
    """The names a parameter's measurements go by: its own, or for a buffer of one sum per expert
    ([E], nanogns/layers/experts.py) one per expert, name[0], name[1], ..."""
    return [name] if sq.dim() == 0 else [f"{name}[{e}]" for e in range(sq.shape[0])]



def _measured_class(kind, value):
    """MEASURED_CLASSES[kind][value], or None."""
    return MEASURED_CLASSES[kind].get(value)


def _build_like(module, kind, cls, weight, bias):
    """An empty `cls` (on the meta device) shaped and configured like `module`; None where it cannot be."""
    if kind == "experts":
        return cls(module.n_expert, module.n_embd, module.hidden, device="meta")
    if kind == "linear":
        transposed = _class_path(type(module)) in TRANSPOSED_WEIGHT
        out_features, in_features = weight.shape[::-1] if transposed else weight.shape
        new = cls(in_features, out_features, bias=bias is not None, device="meta")
        new.weight_transposed = transposed
        if transposed:  # Conv1D's attributes, for code that reads them
            new.nf, new.nx = out_features, in_features
        return new
    if kind == "embedding":
        if getattr(module, "sparse", False) or getattr(module, "scale_grad_by_freq", False):
            return None
        return cls(*weight.shape, padding_idx=getattr(module, "padding_idx", None),
                   max_norm=getattr(module, "max_norm", None), norm_type=getattr(module, "norm_type", 2.0),
                   device="meta")
    shape = tuple(getattr(module, "normalized_shape", weight.shape))
    if tuple(weight.shape) != shape:  # OLMo-core's weight_shape: gains broadcast over several windows
        raise ValueError(f"its weight {tuple(weight.shape)} is not of its normalised shape {shape}")
    if kind == "rmsnorm" and bias is not None:  # OLMo-core's RMSNorm(bias=True): torch's has none
        raise ValueError("an RMSNorm with a bias (torch's RMSNorm, the measured class, has none)")
    if kind == "layernorm":  # nanoGPT's LayerNorm(ndim, bias) has no eps attribute: its 1e-5
        return cls(shape, eps=getattr(module, "eps", 1e-5), bias=bias is not None, device="meta")
    # rmsnorm: torch's eps, or Hugging Face's variance_epsilon; None is torch's default
    return cls(shape, eps=getattr(module, "eps", getattr(module, "variance_epsilon", None)), device="meta")


def _convert(module, kind, cls):
    """A `cls` doing what `module` (of kind `kind`) does with the very same Parameter objects; None
    where the module cannot be measured as it is (said in the returned reason)."""
    names = EXPERT_PARAMETERS if kind == "experts" else ("weight", "bias")
    weight, bias = module._parameters.get(names[0]), module._parameters.get(names[1])
    if weight is None or is_parametrized(module):
        return None, "no weight of its own (none, or parametrized)"
    try:
        new = _build_like(module, kind, cls, weight, bias)
    except ValueError as e:  # e.g. the fused kernels normalise over the last dimension only
        return None, str(e)
    if new is None:
        return None, "sparse or scale_grad_by_freq gradients"
    for name in names:
        if name in new._parameters:
            setattr(new, name, module._parameters.get(name))
    for name, buf in new._buffers.items():  # made on the default device: to the weight's
        new._buffers[name] = buf.to(weight.device)
    new.train(module.training)
    why = _carry_over(module, new)
    return (None, why) if why else (new, None)


# nn.Module's hook dicts (forward, backward, state_dict, load_state_dict) and _is_full_backward_hook
_HOOK_ATTRS = tuple(key for key in vars(nn.Module()) if "hook" in key)


def _carry_over(module, new):
    """
    Give `new` what other code attached to `module`: its hooks (the very dicts, so that their
    handles still remove them), its other parameters, buffers and submodules, and its instance
    attributes (Hugging Face's variance_epsilon, accelerate's _hf_hook), those bound to `module`
    rebound to `new`. An instance `forward` is kept where it is accelerate's wrapper (a partial
    taking the module first, that calls the class's own forward kept in `_old_forward`): it then
    calls the measured forward. Any other would bypass the measured class: refused, the reason
    returned, and `module` left untouched.
    """
    own = vars(module)
    forward, inner = own.get("forward"), own.get("_old_forward")
    wrapper = (isinstance(forward, functools.partial) and forward.args[:1] and forward.args[0] is module
               and getattr(inner, "__self__", None) is module
               and getattr(inner, "__func__", None) is type(module).forward)
    if forward is not None and not wrapper:
        name = getattr(forward, "__qualname__", type(forward).__name__)
        return f"its forward is replaced on the instance ({name}), which would bypass the measured class"
    if own.get("_compiled_call_impl") is not None:  # module.compile() compiled the old module's call
        return "compiled on its own (module.compile()), which would call the old class: measure before compiling"
    for key, value in own.items():
        if key in _HOOK_ATTRS:
            if isinstance(value, dict):
                for k, hook in value.items():
                    value[k] = _rebound(hook, module, new)
            new.__dict__[key] = value
        elif key not in vars(new) and key not in ("forward", "_old_forward"):
            new.__dict__[key] = _rebound(value, module, new)
    for name, p in module._parameters.items():
        if name not in new._parameters:
            new._parameters[name] = p
    for name, buf in module._buffers.items():
        if name not in new._buffers:
            new._buffers[name] = buf
            if name in module._non_persistent_buffers_set:
                new._non_persistent_buffers_set.add(name)
    new._modules.update(module._modules)
    if wrapper:  # accelerate's: new_forward(new, ...) calls new._old_forward, the measured forward
        new._old_forward = types.MethodType(type(new).forward, new)
        new.forward = functools.update_wrapper(_rebound(forward, module, new), new._old_forward)
    return None


def _rebound(value, old, new):
    """`value` with `old` replaced by `new` where it is bound to it: a method of `old`, a
    functools.partial taking `old` first, or torch's wrapper of a load_state_dict pre-hook that
    takes the module (a weak reference to `old`: dead once `old` is gone); else `value`."""
    if isinstance(value, types.MethodType) and value.__self__ is old:
        return types.MethodType(value.__func__, new)
    ref = getattr(value, "module", None)
    if isinstance(ref, weakref.ref) and ref() is old and hasattr(value, "hook"):
        return type(value)(value.hook, new)
    if isinstance(value, functools.partial) and value.args[:1] and value.args[0] is old:
        bound = functools.partial(value.func, new, *value.args[1:], **value.keywords)
        bound.__dict__.update(value.__dict__)
        return bound
    return value


def _batch_of(args, kwargs, batch_dim=0):
    """(B, T) of a model's input: its first tensor argument (or input_ids, inputs_embeds), [B, T, ...],
    or with batch_dim=1 [T, B, ...]: B its size there, T the size of the first other dimension."""
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if first is None:
        first = next((kwargs[k] for k in ("input_ids", "inputs_embeds", "x", "idx") if isinstance(kwargs.get(k), torch.Tensor)),
                     next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None))
    if first is None or first.dim() == 0:
        return None, None
    if first.dim() <= batch_dim:
        raise ValueError(f"the model's input {tuple(first.shape)} has no dimension {batch_dim} to hold the examples "
                         f"(measured with batch_dim={batch_dim}): measure it with the batch_dim of its input")
    others = [size for dim, size in enumerate(first.shape) if dim != batch_dim]
    return first.shape[batch_dim], others[0] if others else None


# measure()'s hooks on the model: module-level, reaching the state through the module, so that a
# copy.deepcopy or a pickle of a measured model keeps its own state with its own layers
def _learn_batch(model, args, kwargs):
    state = model._gns_forward_state
    state["B"], state["T"] = _batch_of(args, kwargs, state.get("batch_dim", 0))
    state["count"] += 1
    state["forward"] = state["count"]
    if not state.get("uses_checked") and torch.is_grad_enabled() and not torch.compiler.is_compiling():
        # the first forward with grad records what each layer was handed and gave (nanogns.layers.uses)
        state["calls"] = LayerCalls([m for m in model.modules()
                                     if isinstance(m, MeasuredLayer) and m._forward_state is state])


def _forget_batch(model, args, kwargs, output):
    state = model._gns_forward_state
    state["B"] = state["T"] = state["forward"] = None
    calls = state.pop("calls", None)
    if calls is not None:
        calls.remove()
        if output is not None:
            refuse_outside_uses(output, calls.calls)  # raises, and the next forward checks again
            state["uses_checked"] = True


# a measured layer's hooks in a model whose examples are not its input's first dimension
# (measure(batch_dim=1)): the layer computes on the view with the examples first, so that its
# per-example sums are over examples, and its output goes back to the model's layout
def _moves_examples(layer):
    state = layer._forward_state
    return (state is not None and state.get("batch_dim", 0) != 0 and torch.is_grad_enabled()
            and any(p is not None and p.requires_grad for p in layer._parameters.values()))


def _examples_first(layer, args):
    layer._examples_moved = bool(args) and isinstance(args[0], torch.Tensor) and _moves_examples(layer)
    if not layer._examples_moved:
        return None
    dim, x = layer._forward_state["batch_dim"], args[0]
    if x.dim() <= dim:
        raise RuntimeError(f"{layer._measured_name}: its input {tuple(x.shape)} has no dimension {dim}, where the "
                           f"model's examples are (batch_dim={dim}): per-position input, not measured; give it the "
                           f"batch dimension (size 1 is expanded), or leave it out (measure(model, kinds=...))")
    return (x.movedim(dim, 0), *args[1:])


def _examples_back(layer, args, output):
    if not getattr(layer, "_examples_moved", False):
        return None
    layer._examples_moved = False
    return output.movedim(0, layer._forward_state["batch_dim"]).contiguous()  # the layout the layer gives itself


def measured_batch_dim(model):
    """The dimension of the model's input that holds the examples, as measure() was told: 0 by default."""
    return getattr(model, "_gns_forward_state", {}).get("batch_dim", 0)


def measure(model, linear="gns", embedding="gns", norm="shim", kinds=None, strict=False, batch_dim=0):
    """
    Convert `model` in place so that its backward also measures exact per-example gradient
    norms, and return it. Every nn.Linear, nn.Embedding, nn.LayerNorm, nn.RMSNorm (and
    SOURCE_KINDS' Hugging Face classes: Conv1D, the Llama-family RMSNorms) becomes the measured
    class MEASURED_CLASSES[kind][value] of the flag for its kind: linear and embedding 'gns' or
    'shim', norm 'shim' or 'fused' (LayerNorms and RMSNorms), None leaves the kind unmeasured.
    kinds={SomeClass: 'linear' | 'embedding' | 'layernorm' | 'rmsnorm'} names a model's own
    classes (they must hold `weight` and `bias` as torch's do; nanoGPT's LayerNorm(ndim, bias) is
    a 'layernorm' with eps 1e-5); kinds={SomeClass: None} leaves that class, and every layer
    inside it, unmeasured.

    Each new module holds the old one's Parameter objects (so optimizer state, ties, state_dict
    keys and checkpoints are unchanged) and gives the same outputs; 'shim' gives bit-identical
    .grad. Shared parameters are found by identity: an Embedding and a Linear sharing their
    weight (a tied token embedding and output head) are linked, so the shared weight is measured
    exactly; any other shared parameter is left out with a warning (never a partial number).
    Hooks, instance attributes and accelerate's forward wrapper go with the module to its new
    class; a module whose forward is otherwise replaced on the instance is left out.

    Hugging Face's mixture-of-experts blocks (MOE_BLOCKS: Mixtral's, Qwen2-MoE's, Qwen3-MoE's,
    OLMoE's, DeepSeek-V3's) are measured exactly, on their [B*T, H] rows in example order
    (nanogns/layers/hf_moe.py): the routed experts' fused weights per expert (name[e]; kind
    "experts"), the router's weight as a Linear's per example (kind "router"), and every Linear
    inside (Qwen2-MoE's shared_expert and shared_expert_gate, DeepSeek-V3's shared_experts; kind
    "shared_expert") with its rows viewed [B, T, K]; whichever experts implementation the config
    names, the measured experts compute the eager one's outputs. With output_router_logits=True the
    load-balancing loss's gradient is measured split by the tokens it came through, its batch
    statistics held fixed (hf_moe's docstring). Under batch_dim=1 such a block is left out.

    A block of a user's own whose experts are a ModuleList of Linears (a child named with "expert",
    not "shared") is measured by following each row's token through its forward
    (nanogns/layers/routed.py): each expert Linear per example (kind "experts"), its `gate` or
    `router` Linear and shared experts on the flattened rows in example order; rows that cannot be
    followed raise a RuntimeError naming the Linear.

    A layer must see examples, not tokens. Left out by what it is: every layer inside a block of
    TOKEN_BLOCKS (none at present), inside a module whose name holds "expert" (a `shared_expert`)
    outside those blocks, or inside a class named with
    kinds={Block: None}: their rows are routed or flattened tokens, and a routed expert may get
    exactly B rows. A pre-hook on `model` learns B and T from its input (its first
    tensor argument, or input_ids, is [B, T, ...]), so that an Embedding called with positions
    shared by the batch ([T] or [1, T]) is measured per example; in a forward with grad, a
    measured layer whose input's first dimension is not B (a Linear on x.view(-1, D)) raises a
    RuntimeError naming it (leave its block out with kinds={Block: None}), and so does a measured
    layer applied twice in one forward.

    batch_dim: the dimension of the model's input, and of every measured layer's input, that
    holds the examples: 0 ([B, T, ...]), or 1 for sequence-first input ([T, B, ...], the default
    of nn.Transformer and nn.MultiheadAttention, batch_first=False). With batch_dim=1 each measured
    layer computes on the view of its input with the examples first and hands its output back in
    the model's layout (a copy), so outputs and gradients are the same up to float rounding. A
    module whose batch_first says the other layout than batch_dim is named in one warning.

    Trainable parameters left unmeasured are listed with their module classes and the reasons in
    one warning; strict=True raises a ValueError with that list instead.
    """
    flags = dict(linear=linear, embedding=embedding, norm=norm)
    for flag, value in flags.items():
        allowed = [v for k in (NORM_KINDS if flag == "norm" else (flag,)) for v in MEASURED_CLASSES[k]]
        allowed = list(dict.fromkeys(allowed + (["fused"] if flag == "norm" else [])))
        if value is not None and value not in allowed:
            raise ValueError(f"measure: {flag}={value!r} is not one of {', '.join(map(repr, allowed))} or None")
    kinds = dict(kinds or {})
    for cls, kind in kinds.items():
        if not isinstance(cls, type) or (kind is not None and kind not in MEASURED_CLASSES):
            raise ValueError(f"measure: kinds maps classes to one of {', '.join(map(repr, MEASURED_CLASSES))} or None, "
                             f"not {cls!r}: {kind!r}")
    if isinstance(model, MeasuredLayer) or source_kind(type(model), kinds):
        raise ValueError("measure converts the layers inside a model, not a single layer: "
                         f"build the measured class (MEASURED_CLASSES) in place of {type(model).__name__}")
    if batch_dim not in (0, 1) or isinstance(batch_dim, bool):
        raise ValueError(f"measure: batch_dim={batch_dim!r}: the examples are dimension 0 ([B, T, ...]) or 1 "
                         f"([T, B, ...]) of the model's input")
    if hasattr(model, "_gns_forward_state") and measured_batch_dim(model) != batch_dim:
        raise ValueError(f"measure: the model was measured with batch_dim={measured_batch_dim(model)}, not "
                         f"{batch_dim}: build it afresh to measure it with another")
    other_layout = [f"{name} ({type(m).__name__})" for name, m in model.named_modules()
                    if isinstance(getattr(m, "batch_first", None), bool) and m.batch_first != (batch_dim == 0)]
    if other_layout:
        first = "batch_first=False" if batch_dim == 0 else "batch_first=True"
        more = f" and {len(other_layout) - 1} more take" if len(other_layout) > 1 else " takes"
        warnings.warn(f"measure: {other_layout[0]}{more} {first} input while the examples are taken to be "
                      f"dimension {batch_dim} of every layer's input: for a model whose input is {'[T, B, ...]' if batch_dim == 0 else '[B, T, ...]'} "
                      f"measure with batch_dim={1 - batch_dim}", stacklevel=2)
    # routed experts are measured whenever the Linears are, by their one class
    value_of = {"linear": linear, "embedding": embedding, "layernorm": norm, "rmsnorm": norm,
                "experts": None if linear is None else "gns"}

    # swap each module for its measured class; one held under two names is left as it is (it
    # would be applied twice, and its per-example norm needs the cross terms between the uses)
    held = {}
    for module in model.modules(remove_duplicate=False):
        held[id(module)] = held.get(id(module), 0) + 1
    # what sees tokens by what it is (an unknown MoE block's router and experts): left out, whatever its rows
    refused = {}
    blocks = [(name, m) for name, m in model.named_modules()
              if _class_path(type(m)) in MOE_BLOCKS and kinds.get(type(m), "") is not None]
    # a user's own MoE blocks, their experts a ModuleList of Linears (nanogns/layers/routed.py): measured by
    # following each row's token through the block's forward; batch_dim=1 leaves them to the name rule
    own_blocks = [] if batch_dim != 0 else [(name, block, experts) for name, block, experts in
                                             routed.routed_blocks(model, MOE_BLOCKS)
                                             if kinds.get(type(block), "") is not None]
    in_block = {id(inner) for _, block in blocks for inner in block.modules()}
    in_block |= {id(inner) for _, block, _ in own_blocks for inner in block.modules()}
    for name, module in model.named_modules():
        why = None if id(module) in refused else _token_rows(name, module, kinds, id(module) in in_block)
        if why:
            for inner in module.modules():
                refused.setdefault(id(inner), why)
    # the known MoE blocks' routers and routed experts: converted in place (nanogns/layers/hf_moe.py)
    for name, block in blocks:
        why = None
        if batch_dim != 0:
            why = f"in the mixture-of-experts block {name}: its rows are in example order only with batch_dim=0"
            for inner in block.modules():
                refused.setdefault(id(inner), why)
        elif linear is None:
            why = "routers and experts are measured with the Linears (linear=None)"
        router_class, experts_class = MOE_BLOCKS[_class_path(type(block))]
        for key, path, measured_cls in (("gate", router_class, PEGradNormHFRouter),
                                        ("experts", experts_class, PEGradNormHFExperts)):
            child = block._modules.get(key)
            if child is None or isinstance(child, MeasuredLayer) or _class_path(type(child)) != path:
                continue  # measured already, or another class (an nn.Linear gate is converted below)
            if id(child) in refused:  # left out already (inside a class named with kinds={Block: None})
                continue
            if why or held[id(child)] > 1:
                refused.setdefault(id(child), why or "held under more than one name")
                continue
            failed = measured_cls.convert(child)
            if failed:
                refused[id(child)] = failed
    for parent in list(model.modules()):
        for child_name, child in list(parent._modules.items()):
            kind = None if child is None or isinstance(child, MeasuredLayer) else source_kind(type(child), kinds)
            if kind is None or value_of[kind] is None or id(child) in refused:
                continue
            if held[id(child)] > 1:
                refused[id(child)] = "held under more than one name"
                continue
            new, refused[id(child)] = _convert(child, kind, _measured_class(kind, value_of[kind]))
            if new is not None:
                parent._modules[child_name] = new

    # the Linears inside the known MoE blocks see the flattened rows: viewed per example, kinds by place
    for _, block in blocks:
        gate = block._modules.get("gate")
        for inner in block.modules():
            if isinstance(inner, _MeasuredLinear) and id(inner) not in refused:
                inner.flat_examples = True
                inner._gns_kind = "router" if inner is gate else "shared_expert"

    # the forward state the measured layers read: B and T of the model's input, a forward count
    state = getattr(model, "_gns_forward_state", None)
    if state is None:
        state = model._gns_forward_state = {"B": None, "T": None, "forward": None, "count": 0, "batch_dim": batch_dim}
        model.register_forward_pre_hook(_learn_batch, with_kwargs=True)
        model.register_forward_hook(_forget_batch, with_kwargs=True, always_call=True)
    for name, block, experts in own_blocks:
        inside = {id(m) for m in experts.modules()}
        routed_layers = []
        for inner_name, inner in block.named_modules():
            if not isinstance(inner, _MeasuredLinear) or id(inner) in refused:
                continue
            if id(inner) in inside:
                routed_layers.append(inner)
                inner._gns_kind = "experts"
            else:  # the router and shared experts see the block's flattened rows in example order
                inner.flat_examples = True
                inner._gns_kind = ("router" if inner_name in ("gate", "router") else
                                   "shared_expert" if "shared" in inner_name.lower() else "linear")
        routed.watch(block, name, state, routed_layers)
    for name, module in model.named_modules():
        if isinstance(module, MeasuredLayer) and id(module) in refused:  # already measured, now left out
            for key in [k for k in module._buffers if k.endswith("_sqgradnorm")]:
                del module._buffers[key]
            module._forward_state = None
        elif isinstance(module, MeasuredLayer):
            module._forward_state, module._measured_name = state, name
            if batch_dim != 0 and not hasattr(module, "_examples_moved"):  # hooked once; after the user's own
                module._examples_moved = False
                module.register_forward_pre_hook(_examples_first)
                module.register_forward_hook(_examples_back, prepend=True)

    # shared parameters, by identity: an embedding and a head sharing their weight are linked;
    # any other sharing is left out (its Linear/Embedding buffers removed; find_sqgradnorm_buffers warns)
    holders = {}
    for module in model.modules(remove_duplicate=False):
        for pname, p in module.named_parameters(recurse=False):
            holders.setdefault(id(p), []).append((module, pname))
    for shared in holders.values():
        modules = [m for m, _ in shared]
        if len(modules) < 2:
            continue
        emb = next((m for m in modules if isinstance(m, nn.Embedding)), None)
        head = next((m for m in modules if isinstance(m, nn.Linear)), None)
        if len(modules) == 2 and emb is not None and head is not None and emb.weight is head.weight:
            link_tied(emb, head)
            continue
        for m, pname in shared:
            if isinstance(m, (_MeasuredLinear, _MeasuredEmbedding)):
                m._buffers.pop(f"{pname}_sqgradnorm", None)
    measured = {id(p) for _, p, _, _ in find_sqgradnorm_buffers(model)}

    # coverage: every trainable parameter left unmeasured, with its module's class, in one message
    owner = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owner.setdefault(id(p), module)
    left_out = []
    for name, p in model.named_parameters():
        if p.requires_grad and id(p) not in measured:
            m = owner[id(p)]
            why = refused.get(id(m)) or ("shared with another layer" if len(holders[id(p)]) > 1 else None)
            left_out.append(f"{name} ({type(m).__name__}{': ' + why if why else ''})")
    if left_out:
        message = (f"measure: {len(left_out)} trainable parameters are not measured: {'; '.join(left_out)}. "
                   "A class that computes a Linear, Embedding, LayerNorm or RMSNorm can be named with "
                   "kinds={Class: 'linear' | 'embedding' | 'layernorm' | 'rmsnorm'}")
        if strict:
            raise ValueError(message)
        warnings.warn(message, stacklevel=2)
    keep_out_of_ddp_broadcast(model)  # a DDP (or replicate) built on it later leaves each rank's sums its own
    return model
