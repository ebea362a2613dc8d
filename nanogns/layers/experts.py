"""
Mixture-of-experts layers: Experts (E expert MLPs, y = c_proj[e] gelu(c_fc[e] x), run on the tokens a
router sent each of them) and PEGradNormExperts, the same with exact per-example squared norms of every
expert's weights, kept per expert.

A routed expert e sees tokens from many examples. Its per-example gradient is
    g_b^e = sum over the tokens t of example b that went to e of dy_t x_t^T
(the routing weight is inside dy: the expert's output is scaled by it after c_proj), and zero for an
example that sent it no token. So the rows are grouped by (example, expert), and within each group the
two rules of a Linear hold (nanogns/layers/linear.py): materialise the group's gradient, or the ghost
norm sum_{t,s} <x_t, x_s> <dy_t, dy_s>. Each expert's rows are laid out as [groups, longest group, K],
zero-padded (padding adds nothing to either sum), and measured as a Linear of that many examples,
ghost or materialised by the same shapes rule, in chunks of bounded memory.

Buffers (nanogns/layers/buffers.py's convention, one entry per expert): `c_fc_sqgradnorm` and
`c_proj_sqgradnorm` [E], the running sums over examples of ||g_b^e / B||^2; `example_count` (0-dim, B
per forward, as every layer's: the GNS of an expert is over all B examples, those that sent it nothing
adding a zero gradient); `expert_examples` [E], how many examples reached each expert (an expert that
few examples reach has a noisy estimate). The tracker reports each expert as its own parameter,
`<name>[e]`.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from nanogns.layers.buffers import MeasuredLayer, _autocast_dtype, _cast
from nanogns.layers.linear import _use_ghost, _weight_sqnorm_ghost, _weight_sqnorm_materialised

EXPERT_PARAMETERS = ("c_fc", "c_proj")


def route(expert_index, n_expert, B):
    """
    How routed rows are laid out, from expert_index [N, k] (or [B, T, k]: N = B*T tokens in example
    order, each sent to k experts): (token, expert, slot) of each row, the rows sorted by expert and,
    within an expert, in token order (so an example's rows are contiguous), and on the host the rows
    per expert, the examples per expert (groups) and the longest group of each, three lists of E.
    One device-to-host read.
    """
    index = expert_index.reshape(-1, expert_index.shape[-1])
    N, k = index.shape
    if N % B:
        raise ValueError(f"{N} routed tokens are not {B} examples of equal length")
    flat = index.reshape(-1)
    outside = ((flat < 0) | (flat >= n_expert)).sum().view(1)  # read with the counts: no read of its own
    order = torch.sort(flat, stable=True).indices  # stable: token order kept within each expert
    token, slot, expert = order // k, order % k, flat[order].clamp(0, n_expert - 1)
    example = token // (N // B)
    key = expert * B + example  # non-decreasing: one run per (expert, example) group
    new_group = torch.ones_like(key, dtype=torch.bool)
    new_group[1:] = key[1:] != key[:-1]
    group = torch.cumsum(new_group, 0) - 1  # each row's group
    here = torch.arange(key.numel(), device=key.device)
    start = torch.cummax(torch.where(new_group, here, 0), 0).values  # each row's group's first row
    position = here - start  # the row's place in its group
    rows = torch.bincount(expert, minlength=n_expert)
    groups = torch.zeros(n_expert, dtype=rows.dtype, device=rows.device).index_add_(0, expert, new_group.to(rows.dtype))
    longest = torch.zeros(n_expert, dtype=rows.dtype, device=rows.device).scatter_reduce(
        0, expert, position + 1, "amax", include_self=True)
    counts = torch.cat([torch.stack([rows, groups, longest]).view(-1), outside.to(rows.dtype)]).tolist()
    if counts[-1]:
        raise ValueError(f"expert_index holds experts outside 0..{n_expert - 1}")
    reached = groups  # on the device: what the backward adds to the examples each expert reached
    rows, groups, longest = counts[:n_expert], counts[n_expert:2 * n_expert], counts[2 * n_expert:3 * n_expert]
    return dict(token=token, slot=slot, expert=expert, group=group, position=position,
                rows=rows, groups=groups, longest=longest, reached=reached)


def _per_expert_linear(rows, weight, counts):
    """Rows sorted by expert (counts[e] of them for expert e) through their expert's matrix of weight [E, out, in]."""
    return torch.cat([F.linear(part, weight[e]) for e, part in enumerate(rows.split(counts))])


def _padded(rows, routing, e, first_row, first_group):
    """Expert e's rows [n_e, K] laid out per example, [groups_e, longest_e, K], zero-padded."""
    n, G, T = routing["rows"][e], routing["groups"][e], routing["longest"][e]
    group = routing["group"][first_row:first_row + n] - first_group
    position = routing["position"][first_row:first_row + n]
    out = rows.new_zeros(G, T, rows.shape[-1])
    out[group, position] = rows
    return out


class _ExpertLinearFn(torch.autograd.Function):
    """y_r = W[e_r] x_r for rows sorted by expert (routing: route()'s); its backward computes dx, dW and,
    per expert, sum_b ||g_b^e||^2 into the [E] buffer `sq` (eagerly), and adds B to `count` and the
    examples that reached each expert to `reached` where they are given."""

    @staticmethod
    def forward(ctx, rows, weight, routing, sq, count, reached, B, mode, max_chunk_numel):
        ctx.save_for_backward(rows, weight)
        ctx.routing, ctx.bufs, ctx.B, ctx.mode, ctx.max_chunk_numel = routing, (sq, count, reached), B, mode, max_chunk_numel
        return _per_expert_linear(rows, weight, routing["rows"])

    @staticmethod
    def backward(ctx, dy):
        rows, weight = ctx.saved_tensors
        routing, (sq, count, reached) = ctx.routing, ctx.bufs
        E, L, K = weight.shape
        counts = routing["rows"]
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = torch.cat([part.matmul(weight[e]) for e, part in enumerate(dy.split(counts))])
        if ctx.needs_input_grad[1]:
            dw = torch.zeros_like(weight)
            sums = torch.zeros(E, dtype=torch.float32, device=weight.device)
            first_row = first_group = 0
            for e, (x_e, dy_e) in enumerate(zip(rows.split(counts), dy.split(counts))):
                if counts[e]:
                    if sq is None:
                        dw[e] = dy_e.mT.matmul(x_e)
                    else:
                        x3 = _padded(x_e, routing, e, first_row, first_group)
                        dy3 = _padded(dy_e, routing, e, first_row, first_group)
                        if _use_ghost(x3.shape[1], K, L, True, ctx.mode):
                            sums[e] = _weight_sqnorm_ghost(x3, dy3, ctx.max_chunk_numel)
                            dw[e] = dy_e.mT.matmul(x_e)
                        else:
                            total, grad, _ = _weight_sqnorm_materialised(x3, dy3, ctx.max_chunk_numel, True)
                            sums[e], dw[e] = total, _cast(grad, weight.dtype)
                first_row += counts[e]
                first_group += routing["groups"][e]
            if sq is not None:
                with torch.no_grad():
                    sq.add_(sums)
        if count is not None:
            count.add_(ctx.B)
        if reached is not None:
            reached.add_(routing["reached"])
        return dx, dw, None, None, None, None, None, None, None


class Experts(nn.Module):
    """
    n_expert GELU MLPs of width `hidden` over n_embd features, applied to the tokens a router chose:
    forward(x, expert_index, expert_weight) with x [B, T, n_embd] (or [N, n_embd], N tokens in example
    order), expert_index [..., k] the k experts of each token and expert_weight [..., k] their weights,
    gives sum_j expert_weight_j * c_proj[e_j] gelu(c_fc[e_j] x) per token, x's shape. The weights are
    two [E, out, in] parameters (Linear's layout, one matrix per expert), without biases.
    """
    expert_parameters = EXPERT_PARAMETERS  # the two [E, out, in] weights, in the order they are applied

    def __init__(self, n_expert, n_embd, hidden, device=None, dtype=None):
        super().__init__()
        self.n_expert, self.n_embd, self.hidden = n_expert, n_embd, hidden
        self.c_fc = nn.Parameter(torch.empty(n_expert, hidden, n_embd, device=device, dtype=dtype))
        self.c_proj = nn.Parameter(torch.empty(n_expert, n_embd, hidden, device=device, dtype=dtype))
        if self.c_fc.device.type != "meta":
            nn.init.normal_(self.c_fc, std=0.02)
            nn.init.normal_(self.c_proj, std=0.02)

    def extra_repr(self):
        return f"n_expert={self.n_expert}, n_embd={self.n_embd}, hidden={self.hidden}"

    def _examples(self, x):
        """B: x's first dimension when it is [B, T, C]; for [N, C], the model's B where measure() knows it."""
        if x.dim() > 2:
            return x.shape[0]
        state = getattr(self, "_forward_state", None) or {}
        return state.get("B") or 1

    def _expert_linear(self, rows, weight, routing, name, B, counted):
        """The rows through each expert's matrix `weight` ([E, out, in]): torch's ops here."""
        return _per_expert_linear(rows, weight, routing["rows"])

    def _activate(self, h):
        """Between the two weights: GELU."""
        return F.gelu(h)

    def _combine(self, y, weights, routing, x2):
        """Each routed row's output scaled by its routing weight, summed per token: [N, out], in y's dtype."""
        y = y * weights[:, None].to(y.dtype)
        return torch.zeros(x2.shape[0], y.shape[-1], dtype=y.dtype, device=y.device).index_add_(0, routing["token"], y)

    def forward(self, x, expert_index, expert_weight):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        B = self._examples(x)
        routing = route(expert_index, self.n_expert, B)
        weights = expert_weight.reshape(-1, expert_weight.shape[-1])[routing["token"], routing["slot"]]
        first, second = self.expert_parameters
        w1, w2, rows = self._parameters[first], self._parameters[second], x2[routing["token"]]
        dtype = _autocast_dtype(x)
        if dtype is not None and x.is_floating_point():  # as autocast casts a Linear's operands
            w1, w2, rows = w1.to(dtype), w2.to(dtype), rows.to(dtype)
        counted = self._counts_with(self.expert_parameters)
        h = self._activate(self._expert_linear(rows, w1, routing, first, B, counted == first))
        y = self._expert_linear(h, w2, routing, second, B, counted == second)
        return self._combine(y, weights, routing, x2).view(*shape[:-1], -1)

    def _counts_with(self, names):
        return None


class PEGradNormExperts(MeasuredLayer, Experts):
    """
    Experts whose backward also measures exact per-example squared norms of each expert's c_fc and
    c_proj (see the module docstring): per expert the ghost norm or materialised per-example gradients,
    by the shapes rule of a fused Linear (per_example_mode "shapes"; "ghost" / "materialise" force one),
    on the expert's rows laid out per example, in chunks of at most max_chunk_numel float32 elements.
    Eager only: under torch.compile its forward runs outside the graph (the rows per expert are data).
    """
    per_example_mode = "shapes"
    max_chunk_numel = 1 << 24

    def __init__(self, n_expert, n_embd, hidden, device=None, dtype=None):
        super().__init__(n_expert, n_embd, hidden, device=device, dtype=dtype)
        for name in EXPERT_PARAMETERS:
            self.register_buffer(f"{name}_sqgradnorm", torch.zeros(n_expert, dtype=torch.float32), persistent=False)
        self.register_buffer("example_count", torch.zeros((), dtype=torch.float32), persistent=False)
        self.register_buffer("expert_examples", torch.zeros(n_expert, dtype=torch.float32), persistent=False)

    @torch.compiler.disable
    def forward(self, x, expert_index, expert_weight):
        sharded = [n for n in EXPERT_PARAMETERS if hasattr(self._parameters[n], "device_mesh")]
        if sharded and torch.is_grad_enabled():  # FSDP2 hands the forward whole weights; a DTensor is another plan
            raise RuntimeError(f"{self._measured_name or type(self).__name__}.{sharded[0]} is a DTensor in the "
                               "forward (experts sharded over ranks: expert or tensor parallelism), whose "
                               "per-example norms are not measured: shard the experts with FSDP2, or leave them "
                               "unmeasured (measure(model, kinds={PEGradNormExperts: None}))")
        if x.dim() > 2:
            self._check_call(x.shape[0])
        return super().forward(x, expert_index, expert_weight)

    def _counts_with(self, names):
        """Which of the weights' backwards adds the example counts: the first that trains, None if none."""
        if not torch.is_grad_enabled():
            return None
        return next((n for n in names if self._parameters[n].requires_grad), None)

    def _expert_linear(self, rows, weight, routing, name, B, counted):
        param, sq = self._parameters[name], self._buffers.get(f"{name}_sqgradnorm")
        if not torch.is_grad_enabled() or not param.requires_grad or sq is None:  # None: left out by measure()
            return super()._expert_linear(rows, weight, routing, name, B, counted)
        count, reached = (self._buffers.get("example_count"), self._buffers.get("expert_examples")) if counted else (None, None)
        mode = "shapes" if self.per_example_mode in ("auto", None) else self.per_example_mode
        return _ExpertLinearFn.apply(rows, weight, routing, sq, count, reached, B, mode, self.max_chunk_numel)

    # MeasuredLayer's sink is for layers compiled into the graph; this one never is
    def _new_sink(self):
        self.__dict__["_sink"] = None
