"""
The measured Embedding layers: PEGradNormEmbedding (its backward builds the weight gradient and the
per-example norms from the same rows) and PEGradNormShimEmbedding (torch's own backward, the norms
beside it), and the link between a tied token embedding and output head (tie_weights), through
which the shared weight's per-example norm is exact.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from nanogns.layers.buffers import (MeasuredLayer, _examples, _hand_out, _warn_once, register_sqgradnorm_buffers,
                                    sum_of_squares)
from nanogns.layers import sharded
from nanogns.layers.linear import PEGradNormLinear, PEGradNormShimLinear


def _rows_added(n, index, src):
    """[n, D] float32 zeros with src's rows added at `index`, in a fixed order on every device. On CUDA
    by index_put_ with accumulate, which sorts the indices and adds each row's sources in turn:
    index_add_ there adds with atomics in whatever order the threads arrive (another last bit from run
    to run). On the CPU index_add_ already adds in order, and faster."""
    if src.is_cuda:
        return src.new_zeros(n, src.shape[-1]).index_put_((index,), src, accumulate=True)
    return src.new_zeros(n, src.shape[-1]).index_add_(0, index, src)


def _embedding_rows(ids, dx, num_embeddings, padding_idx):
    """
    Per-example embedding gradients, compactly: one float32 row per distinct (example b,
    id v) pair, holding sum_{t: id_bt = v} dx_bt (padding positions zeroed, as nn.Embedding
    does), so that sum of squares over all rows = sum_b ||E_b||^2. Returns (rows [R, D],
    row_ids [R] the vocabulary row of each, dx as float32 [B*T, D] with padding zeroed);
    unused rows are zero. No loop over examples, no host sync, and the same sums bit for bit on
    every run (_rows_added).
    """
    B, T = ids.shape
    D = dx.shape[-1]
    dx = dx.reshape(B * T, D).float()
    flat_ids = ids.reshape(-1)
    if padding_idx is not None:
        dx = dx.masked_fill((flat_ids == padding_idx)[:, None], 0.0)
    key = (ids + num_embeddings * torch.arange(B, device=ids.device)[:, None]).reshape(-1)
    if num_embeddings <= T:
        # a dense [B, V, D] table is no bigger than dx itself (e.g. position embeddings)
        rows = _rows_added(B * num_embeddings, key, dx)
        row_ids = torch.arange(B * num_embeddings, device=ids.device) % num_embeddings
    else:
        # sort the (example, id) keys and give each distinct key one row
        sorted_key, order = torch.sort(key, stable=True)
        is_new = torch.ones_like(sorted_key, dtype=torch.bool)
        is_new[1:] = sorted_key[1:] != sorted_key[:-1]
        segment = torch.cumsum(is_new, 0) - 1
        row_of_position = torch.empty_like(segment).scatter_(0, order, segment)
        rows = _rows_added(B * T, row_of_position, dx)
        row_ids = torch.zeros_like(key).scatter_(0, segment, sorted_key % num_embeddings)
    return rows, row_ids, dx


# ---------------------------------------------------------------------------------------------
# The layers and their autograd Functions

def _embedding_backward_norms(ctx, dy, dq, ds, fused):
    """Shared by both embedding Functions: per-example norms (and the weight gradient if
    fused) from the saved ids and dy, with the tied head's contributions dq, ds if linked.
    Returns (the weight gradient or None, the sink's gradient or None): the sums go to the
    buffers (eager) or, given a sink (compiled), out as its gradient, nothing written."""
    ids, = ctx.saved_tensors
    B = _examples(ids, 0)
    if dy is None:  # the lookup's output was not used
        dy = torch.zeros((*ids.shape, ctx.embedding_dim), dtype=torch.float32, device=ids.device)
    ids2 = ids.reshape(B, -1)
    rows, row_ids, dx = _embedding_rows(ids2, dy, ctx.num_embeddings, ctx.padding_idx)
    sq = sum_of_squares(rows)
    if dq is not None:
        sq = sq + 2 * (dx * dq.reshape(dx.shape)).sum()
    if ds is not None:
        sq = sq + ds
    sink_grad = _hand_out(ctx, ids.device, sq, None, B)
    if not fused:
        return None, sink_grad
    D = rows.shape[1]
    if ctx.num_embeddings <= ids2.shape[1]:
        dw = rows.view(B, ctx.num_embeddings, D).sum(0)
    else:
        dw = _rows_added(ctx.num_embeddings, row_ids, rows)
    return dw.to(ctx.weight_dtype), sink_grad


class _EmbeddingFn(torch.autograd.Function):
    """Embedding lookup whose backward builds the weight gradient from per-example rows."""

    @staticmethod
    def forward(ctx, ids, weight, w_sq, count, padding_idx, linked, sink=None):
        ctx.save_for_backward(ids)
        ctx.bufs, ctx.sink = (w_sq, None, count), sink is not None
        ctx.num_embeddings, ctx.embedding_dim = weight.shape
        ctx.padding_idx, ctx.weight_dtype = padding_idx, weight.dtype
        ctx.set_materialize_grads(False)
        y = F.embedding(ids, weight, padding_idx)
        if not linked:
            return y
        return (y, *_link_tensors(ids, weight))

    @staticmethod
    def backward(ctx, dy, dq=None, ds=None):
        dw, sink_grad = _embedding_backward_norms(ctx, dy, dq, ds, fused=True)
        return None, dw, None, None, None, None, sink_grad


class _EmbeddingNormTap(torch.autograd.Function):
    """Identity on a torch embedding's output; its backward measures the per-example norms."""

    @staticmethod
    def forward(ctx, y, ids, w_sq, count, num_embeddings, padding_idx, linked, sink=None):
        ctx.save_for_backward(ids)
        ctx.bufs, ctx.sink = (w_sq, None, count), sink is not None
        # a DTensor y (tensor parallelism: _MeasuredEmbedding._sharded): ids are local, dy measured on its local tensor
        ctx.dy_placements = sharded.grad_placements(y) if sharded.is_dtensor(y) else None
        ctx.num_embeddings, ctx.padding_idx = num_embeddings, padding_idx
        ctx.embedding_dim = y.to_local().shape[-1] if ctx.dy_placements is not None else y.shape[-1]
        ctx.set_materialize_grads(False)
        if not linked:
            return y.view_as(y)
        return (y.view_as(y), *_link_tensors(ids, y))

    @staticmethod
    def backward(ctx, dy, dq=None, ds=None):
        local = dy if ctx.dy_placements is None or dy is None else sharded.local_grad(dy, ctx.dy_placements)
        _, sink_grad = _embedding_backward_norms(ctx, local, dq, ds, fused=False)
        return dy, None, None, None, None, None, None, sink_grad


def _link_tensors(ids, like):
    """The two tensors through whose gradients a tied head reports to the embedding: [B,T,D]
    for Q and a scalar for sum_b ||H_b||^2. Zero-stride views: they cost no memory."""
    B = _examples(ids, 0)
    zero = torch.zeros((), dtype=torch.float32, device=like.device)
    return zero.expand(B, ids.numel() // B, like.shape[-1]), zero.clone()


class _MeasuredEmbedding(MeasuredLayer, nn.Embedding):
    """What the two Embedding classes share."""

    def __init__(self, num_embeddings, embedding_dim, padding_idx=None, max_norm=None, norm_type=2.0,
                 scale_grad_by_freq=False, sparse=False, _weight=None, _freeze=False, device=None, dtype=None):
        if scale_grad_by_freq or sparse:
            raise ValueError(f"{type(self).__name__} does not support scale_grad_by_freq or sparse gradients")
        super().__init__(num_embeddings, embedding_dim, padding_idx, max_norm, norm_type, scale_grad_by_freq,
                         sparse, _weight, _freeze, device, dtype)
        register_sqgradnorm_buffers(self)
        self._tie = None  # set by tie_weights when this is a tied token embedding

    def _batch_ids(self, ids):
        """
        Positions shared by the whole batch (a [T] index while the model's input is [B, T, ...],
        or [1, T] while B > 1) expanded to [B, T]: the lookup's output then carries the batch
        dimension into the broadcast add, and each example's share of the gradient is its own.
        Only inside a forward of a model measure() converted, whose pre-hook knows B and T.
        """
        state = self._forward_state
        if state is None or state["B"] is None or not torch.is_grad_enabled():
            return ids
        B, T = state["B"], state["T"]
        if (ids.dim() == 1 and ids.shape[0] == T) or (ids.dim() == 2 and ids.shape[0] == 1 and B > 1):
            return ids.reshape(1, -1).expand(B, -1)
        return ids

    def _prepare(self, ids):
        """Renormalise rows for max_norm (as F.embedding does) and say whether to measure and link."""
        self._check_call(_examples(ids, 0))
        if self._tie is not None:
            self._tie.pop("link", None)  # never leave a previous forward's link behind
        if self.max_norm is not None and sharded.is_dtensor(self.weight):
            raise RuntimeError(f"{self._measured_name or type(self).__name__}.weight: an Embedding with max_norm under "
                               "tensor parallelism is not measured (torch renormalises its rows in place); leave the "
                               "Embeddings unmeasured (measure(model, embedding=None))")
        if self.max_norm is not None:
            with torch.no_grad():
                torch.embedding_renorm_(self.weight, ids, self.max_norm, self.norm_type)
        measure = (torch.is_grad_enabled() and self.weight.requires_grad
                   and "weight_sqgradnorm" in self._buffers)
        return measure, measure and self._tie is not None

    def _sharded(self, ids):
        """
        Under tensor parallelism (parallelize_module: RowwiseParallel shards the weight over the vocabulary,
        ColwiseParallel over the features; the ids replicated): torch's own lookup and backward (either
        class), and each rank measures its shard of every example's weight gradient from the local output
        gradient, as the shim does: its vocabulary rows' (the tokens of other rows dropped) or its feature
        columns'. The shards' squared norms add over the TP group (nanogns/layers/sharded.py).
        """
        where = f"{self._measured_name or type(self).__name__}.weight"
        weight = self.weight
        ids_local = ids.to_local() if sharded.is_dtensor(ids) else ids
        if self._tie is not None:
            raise RuntimeError(f"{where}: a tied embedding under tensor parallelism is not measured; leave the "
                               "Embeddings unmeasured (measure(model, embedding=None))")
        if sharded.is_dtensor(ids) and not all(p.is_replicate() for p in ids.placements):
            raise RuntimeError(f"{where}: ids {ids.placements} over the mesh: an Embedding under tensor "
                               "parallelism is measured with its ids replicated; leave it unmeasured "
                               "(measure(model, embedding=None))")
        placements = weight.placements if sharded.is_dtensor(weight) else None
        if placements is None or len(placements) != 1 or not placements[0].is_shard():
            raise RuntimeError(f"{where}: weight {placements} over the mesh: an Embedding under tensor "
                               "parallelism is measured with its weight sharded over one mesh dimension "
                               "(RowwiseParallel or ColwiseParallel); leave it unmeasured (measure(model, embedding=None))")
        sharded.localise_buffers(self)
        sharded.note_sharded(self, weight.device_mesh.get_group(), {"weight_sqgradnorm": "sum", "example_count": "once"})
        y = F.embedding(ids, weight, self.padding_idx)
        local_rows, num_embeddings, padding_idx = ids_local, self.num_embeddings, self.padding_idx
        if placements[0].dim % 2 == 0:  # rows: this rank's vocabulary [start, start + n); other ids measured as padding
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
            (n, _), (start, _) = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, placements)
            outside = (ids_local < start) | (ids_local >= start + n)
            if self.padding_idx is not None:
                outside |= ids_local == self.padding_idx
            local_rows = torch.where(outside, n, ids_local - start)
            num_embeddings, padding_idx = n + 1, n
        return _EmbeddingNormTap.apply(y, local_rows, self.weight_sqgradnorm, self.example_count, num_embeddings,
                                       padding_idx, False, self._compiled_sink())

    def _hand_link(self, ids, out, linked):
        if not linked:
            return out
        y, link_q, link_s = out
        self._tie["link"] = (ids, link_q, link_s)
        return y


class PEGradNormEmbedding(_MeasuredEmbedding):
    """
    nn.Embedding whose backward builds the weight gradient and the per-example squared norms
    from the same per-(example, id) rows (sum_{t: id_bt = v} dx_bt; padding_idx excluded as in
    nn.Embedding). Extra memory: about the size of dx in float32 (B*T*D, or B*V*D when V <= T).
    """

    def forward(self, ids):
        ids = self._batch_ids(ids)
        measure, linked = self._prepare(ids)
        if not measure:
            return F.embedding(ids, self.weight, self.padding_idx)
        if sharded.is_dtensor(self.weight) or sharded.is_dtensor(ids):  # tensor parallelism: torch's backward
            return self._sharded(ids)
        out = _EmbeddingFn.apply(ids, self.weight, self.weight_sqgradnorm, self.example_count,
                                 self.padding_idx, linked, self._compiled_sink())
        return self._hand_link(ids, out, linked)


class PEGradNormShimEmbedding(_MeasuredEmbedding):
    """nn.Embedding with torch's own backward (bit-identical .grad), norms measured beside it."""

    def forward(self, ids):
        ids = self._batch_ids(ids)
        measure, linked = self._prepare(ids)
        if measure and (sharded.is_dtensor(self.weight) or sharded.is_dtensor(ids)):  # tensor parallelism
            return self._sharded(ids)
        y = F.embedding(ids, self.weight, self.padding_idx)
        if not measure:
            return y
        out = _EmbeddingNormTap.apply(y, ids, self.weight_sqgradnorm, self.example_count,
                                      self.num_embeddings, self.padding_idx, linked, self._compiled_sink())
        return self._hand_link(ids, out, linked)


# ---------------------------------------------------------------------------------------------
# A token embedding tied to an output head

def tie_weights(embedding, head):
    """
    Tie the token embedding to the output head (GPT's wte = lm_head), as nanoGPT does, and,
    when both layers measure, link them so the shared weight's per-example norm is exact:
    ||E_b + H_b||^2 = ||E_b||^2 + ||H_b||^2 + 2<E_b, H_b>, all kept in the embedding's
    `weight_sqgradnorm`. In forward the embedding hands the head its ids and two "link"
    tensors; in backward (head first) the head sends back, as the link tensors' gradients,
    sum_b ||H_b||^2 and H_b gathered at the example's ids (Q_b[t] = H_b[id_bt], [B,T,D]), and
    the embedding adds sum_b ||E_b||^2 + 2 sum_{b,t} <dx_bt, Q_b[t]>. Autograd itself orders
    and frees this, so an eval or no-grad forward leaves nothing behind. Extra cost: O(B*T'*T*D)
    flops, a float32 [B, T, D] for Q and chunks of [T', T] (T' the head's positions).
    If only one side measures, the shared weight cannot be measured exactly: it is then not
    reported at all (its buffer is removed), with a warning.
    """
    embedding.weight = head.weight
    link_tied(embedding, head)


def link_tied(embedding, head):
    """tie_weights' link between an embedding and a head that already share their weight."""
    emb_measures = isinstance(embedding, (PEGradNormEmbedding, PEGradNormShimEmbedding))
    head_measures = isinstance(head, (PEGradNormLinear, PEGradNormShimLinear)) and not head.weight_transposed
    if emb_measures and head_measures:
        embedding._tie = head._tie = {}  # the embedding's forward leaves the link here for the head
        head._buffers.pop("weight_sqgradnorm", None)
    elif emb_measures or head_measures:
        for module in (embedding, head):
            module._buffers.pop("weight_sqgradnorm", None)
            if hasattr(module, "_tie"):
                module._tie = None
        _warn_once(f"tied weight between {type(embedding).__name__} and {type(head).__name__}: "
                   "both must measure per-example norms for it to be measured; it is not reported")
