"""
Mixture-of-experts blocks of a user's own, built from torch layers: experts written as a list of
Linears (an `experts` ModuleList of MLPs), each called on the rows its router picked from the block's
flattened input, as in

    x = hidden.view(-1, H)                          # [B*T, H], the tokens in example order
    for e, expert in enumerate(self.experts):
        rows, slot = torch.where(index == e)        # the tokens sent to e
        out.index_add_(0, rows, expert(x[rows]) * weight[rows, slot, None])

A Linear there sees some tokens of some examples; its per-example gradient is the sum over each
example's rows (nanogns/layers/experts.py's docstring). To know which example each row came from, the block's forward
runs under RowTags, a torch function mode that follows the rows of the block's input: a row picked
by index (x[rows], x[None, rows], x[mask], index_select on dim 0) is tagged with its token, and the
tag goes on through what keeps rows in place (reshapes that keep them first, F.linear, elementwise
functions). A measured Linear of an expert lays its tagged rows out per example, [B, longest, K]
zero-padded (padding adds nothing to either sum), and measures them as a Linear of B examples;
untagged rows (an op the mode does not follow) are refused with a RuntimeError, never guessed. An
expert no token reached in a forward still counts its B examples (with a zero gradient), so that
every expert's count is the step's batch.
"""
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

# ops whose output's row i comes from row i of their tagged inputs (elementwise, broadcasting; the
# softmax over the last dimension of a 2-D input), and those whose first operand's rows go on
ROW_WISE = {
    F.gelu, F.silu, F.relu, F.dropout, torch.tanh, torch.sigmoid, torch.relu,
    torch.Tensor.to, torch.Tensor.float, torch.Tensor.type, torch.Tensor.contiguous, torch.Tensor.clone,
    torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__, torch.add, torch.Tensor.add,
    torch.Tensor.__add__, torch.Tensor.__radd__, torch.Tensor.__sub__, torch.Tensor.__truediv__,
    torch.Tensor.sigmoid, torch.Tensor.tanh, torch.Tensor.relu,
}
MATMULS = {F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__}
RESHAPES = {torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.Tensor.flatten, torch.flatten,
            torch.Tensor.squeeze, torch.squeeze}
PICKS = {torch.Tensor.__getitem__, torch.index_select, torch.Tensor.index_select}


class RowTags(TorchFunctionMode):
    """While a block's forward runs: which token of the block's input each row of a tensor is (tags:
    {id: (weak reference, tokens [n], the dimension the rows are along: 0, or 1 after x[None, rows])});
    the block's input [B, T, H] flattened, or [B*T, H] itself."""

    def __init__(self, root, B, T):
        super().__init__()
        self.tags, self.B, self.T, self.paused = {}, B, T, False
        self.grid = weakref.ref(root) if root.dim() > 2 else None  # [B, T, H]: its flat view is the tokens
        if root.dim() == 2:
            self.tag(root, torch.arange(root.shape[0], device=root.device))

    def tag(self, t, tokens, dim=0):
        self.tags[id(t)] = (weakref.ref(t), tokens, dim)

    def _entry(self, t):
        entry = self.tags.get(id(t)) if isinstance(t, torch.Tensor) else None
        return entry if entry is not None and entry[0]() is t else None

    def tokens(self, t):
        """The tokens of t's rows (its first dimension), or None where not known."""
        entry = self._entry(t)
        return entry[1] if entry is not None and entry[2] == 0 else None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.paused or not isinstance(out, torch.Tensor) or not args:
            return out
        first = args[0]
        if self.grid is not None and first is self.grid():
            if func in RESHAPES and out.dim() == 2 and out.shape[0] == self.B * self.T:
                self.tag(out, torch.arange(out.shape[0], device=out.device))
            return out
        entry = self._entry(first)
        if entry is not None and entry[2] == 1:  # x[None, rows]: only a reshape bringing the rows first
            if func in RESHAPES and out.dim() >= 1 and out.shape[0] == entry[1].shape[0] and first.shape[0] == 1:
                self.tag(out, entry[1])
            return out
        tokens = self.tokens(first)
        if func in PICKS:
            picked = None if tokens is None else self._picked(func, args, kwargs, tokens)
            if picked is not None and out.dim() >= 1 and out.shape[0] == picked.shape[0]:
                self.tag(out, picked)
            elif picked is not None and out.dim() >= 2 and out.shape[0] == 1 and out.shape[1] == picked.shape[0]:
                self.tag(out, picked, dim=1)
            return out
        if func in RESHAPES:
            if tokens is not None and out.dim() >= 1 and out.shape[0] == tokens.shape[0]:
                self.tag(out, tokens)
            return out
        if func in MATMULS:  # the rows of the first operand go on; the second's first dimension is summed
            if tokens is not None and out.dim() >= 1 and out.shape[0] == tokens.shape[0]:
                self.tag(out, tokens)
            return out
        if func in ROW_WISE:
            tagged = [self.tokens(a) for a in args if self.tokens(a) is not None]
            if tagged and all(t is tagged[0] for t in tagged) and out.dim() >= 1 and out.shape[0] == tagged[0].shape[0]:
                n = tagged[0].shape[0]
                others = [a for a in args if isinstance(a, torch.Tensor) and self.tokens(a) is None]
                # an untagged operand whose rows broadcast against the tagged ones' is per row too (a
                # routing weight [n, 1]) or one row for all; any other first dimension is refused
                if all(a.dim() < out.dim() or a.shape[0] in (1, n) for a in others):
                    self.tag(out, tagged[0])
        return out

    def _picked(self, func, args, kwargs, tokens):
        """The tokens of the rows an index picks, or None for an index that is not one of rows."""
        if func is torch.Tensor.__getitem__:
            index = args[1]
            if isinstance(index, tuple) and len(index) == 2 and index[0] is None:
                index = index[1]
            elif isinstance(index, tuple) and len(index) == 2 and index[1] == slice(None):
                index = index[0]
        else:
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            index = args[2] if len(args) > 2 else kwargs.get("index")
            if dim != 0:
                return None
        if not isinstance(index, torch.Tensor) or index.dim() != 1:
            return None
        if index.dtype == torch.bool:
            return tokens[index] if index.shape[0] == tokens.shape[0] else None
        if index.dtype in (torch.int64, torch.int32):
            return tokens[index.long()]
        return None


def enter_rows(block, args, kwargs):
    """The block's forward pre-hook: RowTags over its input, entered for the forward."""
    state = block._gns_rows_state
    x = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if x is None:
        x = next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
    B, T = state.get("B"), state.get("T")
    block._gns_rows = None
    if x is None or not torch.is_grad_enabled() or not B:
        return None
    T = T or x.shape[0] // B
    if torch.compiler.is_compiling():
        raise RuntimeError(f"{block._gns_rows_name}: a mixture of experts written as Linears is measured by "
                           "following its rows in eager mode; under torch.compile build its experts with "
                           "nanogns.Experts, or leave the block out (measure(model, kinds={Block: None}))")
    mode = RowTags(x, B, T)
    mode.__enter__()
    block._gns_rows = mode
    for layer in block._gns_routed:
        layer._gns_called = False
    return None


def leave_rows(block, args, kwargs, output):
    """The block's forward hook: leave RowTags; the experts no row reached count their B examples
    when the backward reaches the block's output (their gradient there is zero)."""
    mode, block._gns_rows = block._gns_rows, None
    if mode is None:
        return None
    mode.__exit__(None, None, None)
    idle = [layer for layer in block._gns_routed if not layer._gns_called and "example_count" in layer._buffers
            and any(p.requires_grad for p in layer._parameters.values() if p is not None)]
    out = output[0] if isinstance(output, tuple) else output
    if idle and isinstance(out, torch.Tensor) and out.requires_grad:
        B = mode.B

        def count(grad):
            with torch.no_grad():
                for layer in idle:
                    layer._buffers["example_count"].add_(B)
        out.register_hook(count)
    return None


def routed_forward(layer, x, measured):
    """A routed Linear's forward: x's rows (tagged by its block's RowTags) laid out per example
    [B, longest, K], through `measured` (the layer's own measured call), and back to x's rows."""
    mode = getattr(layer._gns_block, "_gns_rows", None)
    if mode is None:
        return measured(x)  # not measuring now (no grad): the plain rows
    tokens = mode.tokens(x)
    if tokens is None and x.dim() > 2 and x.shape[0] == mode.B:  # the examples whole (a dense expert): as any Linear
        layer._gns_called = True
        return measured(x)
    if tokens is None or x.dim() != 2:
        raise RuntimeError(f"{layer._measured_name}: the example of each of its {x.shape[0]} rows is not known (the "
                           "rows of the block's input are followed through indexing, reshapes, Linears and "
                           "elementwise ops only): build the experts with nanogns.Experts, or leave the block out "
                           "(measure(model, kinds={Block: None}))")
    layer._gns_called = True
    mode.paused = True
    try:
        B, T = mode.B, mode.T
        example = tokens // T
        order = torch.sort(example, stable=True).indices
        counts = torch.bincount(example, minlength=B)
        starts = torch.cumsum(counts, 0) - counts
        sorted_example = example[order]
        position = torch.empty_like(order)
        position[order] = torch.arange(order.shape[0], device=order.device) - starts[sorted_example]
        longest = int(counts.max()) if counts.numel() else 0
        x3 = x.new_zeros(B, max(longest, 1), x.shape[1])
        x3 = x3.index_put((example, position), x)
        y = measured(x3)[example, position]
    finally:
        mode.paused = False
    mode.tag(y, tokens)
    return y


def routed_blocks(model, moe_block_paths):
    """(name, block, experts list) of each module of `model` that holds a ModuleList named with "expert"
    (not "shared") of modules with Linears in them: a mixture of experts of a user's own, if its class is
    not one of moe_block_paths (Hugging Face's, measured by their own classes)."""
    found = []
    for name, block in model.named_modules():
        if f"{type(block).__module__}.{type(block).__qualname__}" in moe_block_paths:
            continue
        for child_name, child in block.named_children():
            low = child_name.lower()
            if (isinstance(child, nn.ModuleList) and "expert" in low and "shared" not in low
                    and any(isinstance(m, nn.Linear) for m in child.modules())):
                found.append((name, block, child))
    return found


def watch(block, name, state, routed):
    """Give `block` the hooks that follow its rows, for its measured routed Linears `routed`."""
    block.__dict__.update(_gns_rows_state=state, _gns_rows_name=name, _gns_rows=None)
    block._gns_routed = list(routed)
    for layer in routed:
        layer.__dict__["_gns_block"] = block  # not a submodule: the block holds the layer already
        layer._gns_called = False
    if not getattr(block, "_gns_rows_hooked", False):
        block._gns_rows_hooked = True
        block.register_forward_pre_hook(enter_rows, with_kwargs=True)
        block.register_forward_hook(leave_rows, with_kwargs=True, always_call=True)
