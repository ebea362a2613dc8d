"""
Hugging Face's mixture-of-experts blocks measured exactly (the families of registry.MOE_BLOCKS:
Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3), per example and, for the routed experts, per
expert. A block flattens its [B, T, H] input to [B*T, H] rows in example order (row i is token i % T
of example i // T), and
- its routed experts (the child `experts`: fused weights gate_up_proj [E, 2I, H] and down_proj
  [E, H, I]) run the rows each expert was sent through _ExpertLinearFn (nanogns/layers/experts.py),
  whose backward adds sum_b ||g_b^e / B||^2 per expert to [E] buffers: PEGradNormHFExperts. It
  computes what transformers' eager experts compute (gate_up, the class's own _apply_gate, down,
  scaled by the routing weight, summed per token), whichever experts implementation the config names
  (eager, grouped_mm, batched_mm: the same function of the weights);
- its router (the child `gate`, a weight [E, H] that its forward hands to F.linear with the rows) is
  measured as a Linear on the rows viewed [B, T, H]: PEGradNormHFRouter. Its forward runs the class's
  own under a torch function mode that replaces that one F.linear by the measured one; a router that
  reaches its weight any other way (or twice) raises, so its number is never a silent zero;
- its other Linears (Qwen2-MoE's shared_expert and shared_expert_gate) are measured Linears with
  flat_examples set (nanogns/layers/linear.py): a [B*T, K] input is viewed [B, T, K].

Both classes are made on demand from the Hugging Face class (type(module) with the mixin first), and a
module is converted in place (its class swapped, its buffers added), so that everything attached to
it stays (hooks; accelerate's forward wrapper, rebound to call the measured forward); a module whose
forward is otherwise replaced on the instance is left out. Pickling and copy.deepcopy rebuild the
class from the same two.

Load-balancing auxiliary loss (output_router_logits=True): the loss is sum_e f_e P_e over the batch,
f_e the fraction of the batch's tokens routed to e (no gradient: from the top-k choice) and P_e the
mean router probability of e over the batch's tokens. Its gradient reaches only the router's logits
and, with the batch statistics held fixed, is a sum over tokens of a per-token term: each token's
row of the logits' gradient is its own. So the router's measured per-example norm stays well
defined: it is that of the gradient split by the tokens it came through, f_e and the 1/(B*T) of the
means held at the batch's values (as model.py's own MoE measures its auxiliary loss). The routed and
shared experts get no gradient from it.
"""
import functools
import types

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from nanogns.layers.buffers import MeasuredLayer, _autocast_dtype, register_sqgradnorm_buffers
from nanogns.layers.experts import Experts, PEGradNormExperts
from nanogns.layers.linear import _LinearFn, _use_ghost

HF_EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")

_MADE = {}


def measured_class(mixin, base):
    """The class `mixin` + Hugging Face's `base` (made once per pair)."""
    key = (mixin, base)
    if key not in _MADE:
        _MADE[key] = type(f"PEGradNorm{base.__name__}", (mixin, base),
                          {"__module__": __name__, "_hf_base": base, "_hf_mixin": mixin})
    return _MADE[key]


def _rebuild(mixin, base):
    cls = measured_class(mixin, base)
    return cls.__new__(cls)


def _accelerate_wrapped(module):
    """Whether `module`'s instance forward is accelerate's wrapper (a partial taking the module first,
    calling the class's forward kept bound in `_old_forward`)."""
    own = vars(module)
    forward, inner = own.get("forward"), own.get("_old_forward")
    return (isinstance(forward, functools.partial) and forward.args[:1] == (module,)
            and getattr(inner, "__self__", None) is module and getattr(inner, "__func__", None) is type(module).forward)


def _swap_refusal(module):
    """Why `module` cannot have its class swapped (its forward replaced on the instance other than by
    accelerate's wrapper, or compiled on its own), or None."""
    if "forward" in vars(module) and not _accelerate_wrapped(module):
        return "its forward is replaced on the instance, which would bypass the measured class"
    if vars(module).get("_compiled_call_impl") is not None:
        return "compiled on its own (module.compile()), which would call the old class: measure before compiling"
    return None


def _swap(module, cls):
    """Give `module` the class `cls` in place; accelerate's wrapper then calls the measured forward."""
    wrapped = _accelerate_wrapped(module)
    module.__class__ = cls
    if wrapped:
        module._old_forward = types.MethodType(cls.forward, module)


class _Made:
    """What the made classes share: pickled (and deep-copied) as their two classes and their state."""

    def __reduce_ex__(self, protocol):
        return _rebuild, (self._hf_mixin, self._hf_base), self.__dict__.copy()

    # the sink is for layers compiled into the graph; these never are (their forwards run outside it)
    def _new_sink(self):
        self.__dict__["_sink"] = None


class PEGradNormHFExperts(_Made, PEGradNormExperts):
    """
    A Hugging Face fused experts module (gate_up_proj [E, 2I, H], down_proj [E, H, I], act_fn, the
    gate its class applies, no biases) whose backward measures each expert's per-example squared
    norms ([E] buffers gate_up_proj_sqgradnorm, down_proj_sqgradnorm; example_count; expert_examples),
    by the rules of PEGradNormExperts. forward(hidden_states [N, H] rows in example order, top_k_index
    [N, k], top_k_weights [N, k]) as Hugging Face's eager experts.
    """
    _gns_kind = "experts"
    expert_parameters = HF_EXPERT_PARAMETERS

    @staticmethod
    def refusal(module):
        """Why a module of a MOE_BLOCKS experts class cannot be measured as it is, or None."""
        for flag, wanted in (("has_gate", True), ("has_bias", False), ("is_transposed", False),
                             ("has_post_expert_norm", False), ("_is_expert_parallel", False)):
            if getattr(module, flag, wanted) != wanted:
                return f"experts with {flag}={not wanted} are not measured"
        weights = [module._parameters.get(n) for n in HF_EXPERT_PARAMETERS]
        if any(w is None or w.dim() != 3 for w in weights):
            return "no fused [E, out, in] gate_up_proj and down_proj of its own"
        return _swap_refusal(module)

    @classmethod
    def convert(cls, module):
        """Make `module` measured in place; the reason it cannot be, or None."""
        why = cls.refusal(module)
        if why:
            return why
        device = module.gate_up_proj.device
        _swap(module, measured_class(cls, type(module)))
        module.n_expert = module.gate_up_proj.shape[0]
        for name in HF_EXPERT_PARAMETERS:
            module.register_buffer(f"{name}_sqgradnorm", torch.zeros(module.n_expert, device=device), persistent=False)
        module.register_buffer("example_count", torch.zeros((), device=device), persistent=False)
        module.register_buffer("expert_examples", torch.zeros(module.n_expert, device=device), persistent=False)
        return None

    def extra_repr(self):
        E, two_i, H = self.gate_up_proj.shape
        return f"n_expert={E}, hidden_dim={H}, intermediate_dim={two_i // 2}"

    @torch.compiler.disable
    def forward(self, hidden_states, top_k_index, top_k_weights):
        self._check_call(self._examples(hidden_states))  # rows, not examples: only a second use is refused
        return Experts.forward(self, hidden_states, top_k_index, top_k_weights)

    def _activate(self, h):
        """Between gate_up and down: the class's own gate (act_fn of one half times the other)."""
        return self._apply_gate(h)

    def _combine(self, y, weights, routing, x2):
        """Each routed row's output scaled by its routing weight, summed per token, in x2's dtype."""
        return torch.zeros_like(x2).index_add_(0, routing["token"], (y * weights[:, None]).to(x2.dtype))


class _RouterTap(TorchFunctionMode):
    """While a router's forward runs: its F.linear of the rows and its weight (or a cast of the weight)
    goes to the layer's measured linear; every other call runs as it is."""

    CASTS = {torch.Tensor.type, torch.Tensor.to, torch.Tensor.float, torch.Tensor.bfloat16, torch.Tensor.half}

    def __init__(self, layer):
        super().__init__()
        self.layer, self.weights, self.calls = layer, [layer._parameters["weight"]], 0

    def _is_weight(self, t):
        return any(t is w for w in self.weights)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x = args[0] if args else kwargs["input"]
            w = args[1] if len(args) > 1 else kwargs.get("weight")
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if bias is None and self._is_weight(w):
                self.calls += 1
                return self.layer._measured_linear(x, w)
        out = func(*args, **kwargs)
        if func in self.CASTS and args and self._is_weight(args[0]) and isinstance(out, torch.Tensor):
            self.weights.append(out)
        return out


class PEGradNormHFRouter(_Made, MeasuredLayer):
    """
    A Hugging Face top-k router (weight [E, H], no bias; its forward computes F.linear(rows, weight) on
    the [B*T, H] rows in example order, or on [B, T, H]) whose weight is measured as a Linear's on the
    rows viewed [B, T, H] (weight_sqgradnorm, example_count), ghost or materialised by the shapes rule
    (per_example_mode "shapes"; "ghost" / "materialise" force one). What the router does with its logits
    (softmax, top-k, DeepSeek-V3's group choice and correction bias) is its class's own code.
    """
    _gns_kind = "router"
    per_example_mode = "shapes"
    max_chunk_numel = 1 << 24

    @classmethod
    def convert(cls, module):
        """Make `module` measured in place; the reason it cannot be, or None."""
        weight = module._parameters.get("weight")
        if weight is None or weight.dim() != 2 or module._parameters.get("bias") is not None:
            return "no [E, H] weight of its own without a bias"
        why = _swap_refusal(module)
        if why:
            return why
        _swap(module, measured_class(cls, type(module)))
        register_sqgradnorm_buffers(module)
        for name, buf in module._buffers.items():
            if name.endswith("_sqgradnorm") or name == "example_count":
                module._buffers[name] = buf.to(weight.device)
        return None

    @torch.compiler.disable
    def forward(self, *args, **kwargs):
        weight = self._parameters["weight"]
        if not (torch.is_grad_enabled() and weight.requires_grad):
            return super().forward(*args, **kwargs)
        tap = _RouterTap(self)
        with tap:
            out = super().forward(*args, **kwargs)
        if tap.calls != 1:
            raise RuntimeError(f"{self._measured_name}.weight: the router {type(self).__name__} passed its weight to "
                               f"F.linear {tap.calls} times, not once: its per-example norm is not measured; leave its "
                               "block out with measure(model, kinds={Block: None})")
        return out

    def _measured_linear(self, x, weight):
        """F.linear(x, weight) measured: x's rows, [..., H] in example order, viewed [B, rows / B, H]."""
        H = x.shape[-1]
        rows = x.numel() // H
        state = self._forward_state or {}
        B = state.get("B") or (x.shape[0] if x.dim() > 2 else 1)
        if rows % B:
            raise RuntimeError(f"{self._measured_name}: {rows} rows are not the batch's {B} examples of equal length: "
                               "per-token input, not measured; leave its block out with measure(model, kinds={Block: None})")
        self._check_call(B)
        x3 = x.reshape(B, rows // B, H)
        dtype = _autocast_dtype(x)
        if dtype is not None and x.is_floating_point():  # as autocast casts F.linear's operands
            x3, weight = x3.to(dtype), weight.to(dtype)
        E = weight.shape[0]
        mode = "shapes" if self.per_example_mode in ("auto", None) else self.per_example_mode
        ghost = _use_ghost(rows // B, H, E, True, mode)
        y = _LinearFn.apply(x3, weight, None, self._buffers["weight_sqgradnorm"], None, self._buffers["example_count"],
                            None, None, None, ghost, self.max_chunk_numel)
        return y.reshape(*x.shape[:-1], E)

