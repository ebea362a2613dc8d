"""
The measured Linear layers: PEGradNormLinear (one backward computes dx, dW, db and the per-example
norms) and PEGradNormShimLinear (torch's own backward, bit-identical .grad, the norms beside it),
their autograd Functions, linear_sqnorms for code that sees x and dy beside torch's backward, and
how a layer measures its weight: the ghost norm or materialised per-example weight gradients
(per_example_mode: read from the routes table of its card's compute capability, else the shapes).

The ghost norm is Goodfellow 2015 ("Efficient Per-Example Gradient Computations") extended to
sequences as in Li et al. 2022 ("Large Language Models Can Be Strong Differentially Private
Learners").
"""
import importlib.util
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanogns.layers import sharded
from nanogns.layers.routed import routed_forward
from nanogns.layers.buffers import (MeasuredLayer, _autocast_dtype, _cast, _chunk, _examples, _hand_out,
                                    register_sqgradnorm_buffers, sum_of_squares)


# Fused layers: use the ghost norm when T^2 (K+L) < FUSED_GHOST_RATIO * K L. The crossover
# measured on CPU (bench/layers.py --sweep) lies between 20 and 80; inside a small GPT's
# backward (T 64, width 128) both cost the same at about 40, where the ghost's few [T, T]
# Gram matrices take far less memory than B*K*L per-example weight gradients.
FUSED_GHOST_RATIO = 48

# How a measured Linear chooses between the ghost norm and materialised per-example weight
# gradients (its per_example_mode): "auto" at its first measured call takes the faster as the routes
# table of its card's compute capability measured it for that shape at those tokens per example, else
# the flop rule of _use_ghost, and keeps it (linear_norm_methods reads the choices; nothing is timed
# in training, so every rank of a run chooses alike; under torch.compile, which reads no file,
# choose_linear_norm_methods reads the table beforehand); "shapes" the flop rule at every call (what
# two runs agree on bit for bit; None, its earlier name, is the same); or one of the two, forced.
PER_EXAMPLE_MODES = ("auto", "shapes", "ghost", "materialise")
NORM_METHODS = ("ghost", "materialise")


def _use_ghost(T, K, L, fused, mode):
    """Ghost norm or materialised per-example weight gradients, from shapes only (T = tokens
    per example), or as `mode` forces. Shim: materialising costs the weight GEMM again, 2TKL
    flops per example, against the ghost norm's 2T^2(K+L). Fused: the materialised W_b are the
    weight GEMM itself split by example, so materialising costs only a batched GEMM and memory
    traffic (~KL per example, dear when T is small) against the ghost's 2T^2(K+L) extra flops."""
    if mode not in ("shapes", None):  # None: "shapes", as it was called before "auto" came
        if mode not in NORM_METHODS:
            raise ValueError(f"per_example_mode must be one of {', '.join(map(repr, PER_EXAMPLE_MODES))}, not {mode!r}")
        return mode == "ghost"
    if fused:
        return T * T * (K + L) < FUSED_GHOST_RATIO * K * L
    return T * (K + L) < K * L


def _weight_sqnorm_ghost(x, dy, max_chunk_numel):
    """sum_b ||dy_b^T x_b||^2 = sum_b sum_{t,t'} <x_bt, x_bt'> <dy_bt, dy_bt'>, the Gram matrices
    in at least float32 (those of a loss-scaled fp16 dy would overflow in fp16)."""
    B, T, K = x.shape
    L = dy.shape[2]
    acc = torch.promote_types(x.dtype, torch.float32)
    chunk = _chunk(2 * T * T + T * (K + L), B, max_chunk_numel)
    if chunk >= B:  # one chunk: no slices
        return _gram_dot(_cast(x, acc), _cast(dy, acc))
    total = None
    for s in range(0, B, chunk):
        part = _gram_dot(_cast(x[s:s + chunk], acc), _cast(dy[s:s + chunk], acc))
        total = part if total is None else total + part
    return total


def _gram_dot(x, dy):
    """<x_b x_b^T, dy_b dy_b^T> summed over the examples of x [c, T, K] and dy [c, T, L], as float32."""
    gram_x, gram_dy = torch.bmm(x, x.mT), torch.bmm(dy, dy.mT)
    return _cast(torch.dot(gram_x.view(-1), gram_dy.view(-1)), torch.float32)


# How materialised norms are computed: by one of several exact routes, whose speed depends on the card
# and the shape. bench/gpu_check.py's linear step times them all (and the ghost norm) at GPT-2 small's
# and a Llama-style model's weight shapes against torch's weight GEMM and float64, and writes a table
# (ROUTE_COLUMNS) that is committed as nanogns/layers/routes/linear-routes-sm<major><minor>.csv, named by
# the card's compute capability (what decides the speed: an H100 and an H200 share sm90). The routes:
#   "bmm"              torch.bmm (cuBLAS) of each example's dy_b^T x_b, W_b in the compute dtype, then
#                      one pass over W_b for its squares and its sum over examples (the weight gradient)
#   "bmm-f32"          the same with W_b in float32 (torch.bmm's out_dtype on CUDA; elsewhere from
#                      float32 copies of the inputs)
#   "kernel <tiling>"  linear_kernel's Triton GEMM with that tiling, which never writes W_b (a GPU
#                      with Triton)
# A layer on a GPU takes its capability's fastest route whose norms and gradient were within
# ROUTE_TOLERANCE of float64 in the sweep, measured at the nearest number of tokens per example; a
# capability without a table (no other capability's table is borrowed), a shape or dtype its table
# lacks, and the CPU take the cuBLAS route.
HAS_TRITON = importlib.util.find_spec("triton") is not None
CUBLAS_ROUTE = "bmm"
ROUTE_COLUMNS = ("card", "model", "layer", "B", "T", "K", "L", "dtype", "route", "ms", "vs_gemm", "norm_err",
                 "grad_err")
ROUTE_TOLERANCE = 1e-2  # relative error against float64 beyond which a swept route counts as broken
ROUTES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "routes")  # package data
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
               torch.float64: "float64"}
_BMM_OUT_DTYPE = hasattr(torch.ops.aten.bmm, "dtype")  # torch.bmm(..., out_dtype=): torch >= 2.8, CUDA


class LinearRouteTableError(ValueError):
    """A file where a card's Linear routes table belongs that is not one."""


def card_family(name):
    """The family of a GPU by its name: "NVIDIA H100 80GB HBM3" and "NVIDIA H100 PCIe" -> "h100",
    "NVIDIA A100-SXM4-80GB" -> "a100", "NVIDIA GeForce RTX 4090" -> "rtx-4090". Routes tables go by
    compute capability instead (route_table_path)."""
    kept = []
    for word in name.lower().split():
        if word in ("nvidia", "geforce", "tesla", "amd", "radeon"):
            continue
        kept.append(word.split("-")[0])
        if any(c.isdigit() for c in word):  # the model number ends the family's name
            break
    return "-".join(kept)


def route_table_path(device):
    """Where the routes table for `device` is committed: on a GPU by its compute capability
    (torch.cuda.get_device_capability), (9, 0) -> ROUTES_DIR/linear-routes-sm90.csv for an H100 and an
    H200 alike; elsewhere by the device type (linear-routes-cpu.csv, which only tests write)."""
    device = torch.device(device)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return os.path.join(ROUTES_DIR, f"linear-routes-sm{major}{minor}.csv")
    return os.path.join(ROUTES_DIR, f"linear-routes-{device.type}.csv")


def read_route_table(path):
    """
    {(K, L, dtype name): {T: [route, ...]}} from a sweep's CSV: each weight shape's routes at each
    number of tokens per example T, fastest first, keeping those whose norms and gradient were within
    ROUTE_TOLERANCE of float64 (torch's own GEMM, route "gemm", is the yardstick, not a route). {}
    where there is no such file.
    """
    import csv
    try:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            rows = list(reader)
    except FileNotFoundError:
        return {}
    missing = [c for c in ROUTE_COLUMNS if c not in (reader.fieldnames or [])]
    if missing:
        raise LinearRouteTableError(f"{path}: not a Linear routes table (no column {', '.join(missing)}); "
                                    "write it with bench/gpu_check.py --steps linear, or remove it")
    timed = {}
    try:
        for row in rows:
            errors = [abs(float(row[c])) for c in ("norm_err", "grad_err") if row[c]]
            if row["route"] == "gemm" or not all(e <= ROUTE_TOLERANCE for e in errors):  # NaN fails too
                continue
            by_tokens = timed.setdefault((int(row["K"]), int(row["L"]), row["dtype"]), {})
            by_tokens.setdefault(int(row["T"]), []).append((float(row["ms"]), row["route"]))
    except (TypeError, ValueError) as e:
        raise LinearRouteTableError(f"{path}: a row that is not a number where one belongs ({e}); write it "
                                    "with bench/gpu_check.py --steps linear, or remove it") from None
    return {shape: {T: [route for _, route in sorted(routes)] for T, routes in by_tokens.items()}
            for shape, by_tokens in timed.items()}


_route_tables = {}  # str(device) -> read_route_table() of its compute capability's table


def _route_table(device):
    """The routes table of device's compute capability (route_table_path), read at its first eager use;
    {} off GPU and where that capability has no table: the layers then go by the shapes. torch.compile
    traces no file read: a table not read before compiling counts as none (choose_linear_norm_methods
    reads it)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    table = _route_tables.get(str(device))
    if table is None:
        if torch.compiler.is_compiling():
            return {}
        table = read_route_table(route_table_path(device)) if device.type == "cuda" else {}
        _route_tables[str(device)] = table
    return table


def _swept_routes(T, K, L, dtype, device):
    """(the table's routes for a [L, K] weight in dtype, fastest first, at the tokens per example it
    measured nearest to T; whether it measured at T itself), ([], False) where it has none."""
    by_tokens = _route_table(device).get((K, L, DTYPE_NAMES.get(dtype)))
    if not by_tokens or T < 1:
        return [], False
    nearest = None
    for swept in by_tokens:
        if nearest is None or abs(math.log(swept / T)) < abs(math.log(nearest / T)):
            nearest = swept
    routes = [route for route in by_tokens[nearest] if HAS_TRITON or not route.startswith("kernel ")]
    return routes, nearest == T


def materialised_route(T, K, L, dtype, device):
    """How a Linear of weight [L, K] seeing T tokens per example in dtype on device materialises its
    norms: its card's fastest materialised route, else CUBLAS_ROUTE."""
    routes, _ = _swept_routes(T, K, L, dtype, device)
    return next((route for route in routes if route != "ghost"), CUBLAS_ROUTE)


def table_method(T, K, L, dtype, device):
    """"ghost" or "materialise", as its card's table found the faster for this shape and dtype at T
    tokens per example itself; None where it did not measure that (the layer then goes by _use_ghost)."""
    routes, exact = _swept_routes(T, K, L, dtype, device)
    if not exact or not routes:
        return None
    return "ghost" if routes[0] == "ghost" else "materialise"


def _weight_sqnorm_materialised(x, dy, max_chunk_numel, want_grad, ids=None, route=None):
    """
    sum_b ||W_b||^2 with W_b = dy_b^T x_b (float32 0-dim); also their sum, the weight gradient (in at
    least float32), when want_grad; and for a tied output head (ids given, [B, T]) Q_b[t] = W_b[id_bt]
    as float32 [B, T, K]. `route` (materialised_route's by default) says how. The cuBLAS routes
    materialise W_b a chunk of examples at a time (at most max_chunk_numel float32 elements' worth, or
    one example) and read it once for the squares and the sum, gathering Q_b from the rows at hand;
    the kernel never writes W_b, and a tied head's Q_b then comes from _head_grad_at_ids.
    """
    B, T, K = x.shape
    L = dy.shape[2]
    if route is None:
        route = materialised_route(T, K, L, x.dtype, x.device)
    if route.startswith("kernel "):
        from nanogns.layers import linear_kernel  # here, on first use: it imports Triton
        if linear_kernel.supports(x, dy):
            config = linear_kernel.config_of(route.removeprefix("kernel "))
            grad, per_example = linear_kernel.per_example_weight_grad(x, dy, want_grad, **config)
            q = None if ids is None else _head_grad_at_ids(x, dy, ids, max_chunk_numel)
            return per_example.sum(), grad, q
        route = CUBLAS_ROUTE
    acc = torch.promote_types(x.dtype, torch.float32)
    w_dtype = acc if route == "bmm-f32" else x.dtype
    chunk = _chunk(K * L * w_dtype.itemsize // 4, B, max_chunk_numel)
    total = grad = None
    q_parts = []
    for s in range(0, B, chunk):
        xc, dc = (x, dy) if chunk >= B else (x[s:s + chunk], dy[s:s + chunk])  # one chunk: no slices
        per_example = _per_example_weight_grads(xc, dc, w_dtype)  # [chunk, L, K]
        part, part_grad = _squares_and_sum(per_example, want_grad, acc)
        total = part if total is None else total + part
        if want_grad:
            grad = part_grad if grad is None else grad.add_(part_grad)
        if ids is not None:
            rows = ids[s:s + chunk, :, None].expand(-1, -1, K)
            q_parts.append(per_example.gather(1, rows).float())
    q = None if ids is None else torch.cat(q_parts) if len(q_parts) > 1 else q_parts[0]
    return total, grad, q


def _per_example_weight_grads(x, dy, dtype):
    """W_b = dy_b^T x_b, [c, L, K] in dtype: in the inputs' own, or wider through torch.bmm's out_dtype
    where CUDA has it for half-precision inputs, else from copies of the inputs in dtype."""
    if dtype == x.dtype:
        return torch.bmm(dy.mT, x)
    if _BMM_OUT_DTYPE and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and dtype == torch.float32:
        return torch.bmm(dy.mT, x, out_dtype=dtype)
    return torch.bmm(dy.mT.to(dtype), x.to(dtype))


def _squares_and_sum(per_example, want_grad, acc):
    """(sum of squares of W_b [c, L, K] as float32, their sum over the examples in acc, or None without
    want_grad), reading W_b once where that can do both: traced, the two sums share one iteration space
    and the compiler fuses them into one pass; eagerly on a GPU, float32 W_b through var_mean; else
    sum_of_squares' precise pieces and a sum."""
    if torch.compiler.is_compiling():
        w = _cast(per_example, acc)
        return _cast((w * w).sum(0).sum(), torch.float32), w.sum(0) if want_grad else None
    if not want_grad:
        return sum_of_squares(per_example), None
    if per_example.dtype == torch.float32 and per_example.device.type != "cpu":
        return _one_read_squares_and_sum(per_example)
    return sum_of_squares(per_example), per_example.sum(0, dtype=acc)


def _one_read_squares_and_sum(per_example):
    """(sum of squares, sum over the first dimension) of a float32 [c, ...] in one read of it: per
    position the variance and the mean over the c examples, sum_b w_b^2 = c var + (c mean)^2 / c."""
    c = per_example.shape[0]
    var, mean = torch.var_mean(per_example, 0, correction=0)
    total = mean.mul_(c).view(-1)
    return c * var.sum() + torch.dot(total, total) / c, total.view(per_example.shape[1:])


def _head_grad_at_ids(x, dy, ids, max_chunk_numel):
    """For a tied output head whose per-example weight gradients are not materialised (ghost
    norm): Q_b[t] = H_b[id_bt] = sum_t' dy_bt'[id_bt] x_bt', [B, T, D] float32, the head's
    per-example weight gradient read at the rows the embedding used, O(B T' T D) flops."""
    B, T2, V = dy.shape
    T = ids.shape[1]
    chunk = _chunk(2 * T2 * T, B, max_chunk_numel)
    parts = []
    for s in range(0, B, chunk):
        dc, ic = dy[s:s + chunk], ids[s:s + chunk]
        gathered = torch.gather(dc, 2, ic[:, None, :].expand(ic.shape[0], T2, T)).float()  # [c, T', T]
        parts.append(torch.bmm(gathered.mT, x[s:s + chunk].float()))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


# ---------------------------------------------------------------------------------------------
# The layers: their autograd Functions, the two classes, and the methods the layers of a model chose

class _LinearFn(torch.autograd.Function):
    """y = x W^T + b whose backward computes dx, dW, db and the per-example norms together."""

    @staticmethod
    def forward(ctx, x, weight, bias, w_sq, b_sq, count, ids, link_q, link_s, ghost, max_chunk_numel, sink=None):
        ctx.save_for_backward(x, weight, ids)
        ctx.bufs, ctx.sink = (w_sq, b_sq, count), sink is not None
        ctx.has_bias, ctx.linked = bias is not None, link_q is not None
        ctx.ghost, ctx.max_chunk_numel = ghost, max_chunk_numel
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight, ids = ctx.saved_tensors
        w_sq, b_sq, count = ctx.bufs
        K, L = x.shape[-1], dy.shape[-1]
        B = _examples(x, 1)
        x3, dy3 = x.reshape(B, -1, K), dy.reshape(B, -1, L)
        dx = dw = db = q = h_sq = w_sum = b_sum = None
        if ctx.needs_input_grad[0]:
            dx = dy.matmul(weight)
        if ctx.needs_input_grad[1] and (w_sq is not None or ctx.linked):
            ids2 = ids.reshape(B, -1) if ctx.linked else None
            sq, dw, q = _weight_norm(ctx, _norm_ways(x3, dy3, ids2, ctx.max_chunk_numel, weight.dtype))
            if ctx.linked:  # tied head: the norm and the cross-term factor go to the embedding
                h_sq = sq
            else:
                w_sum = sq
        elif ctx.needs_input_grad[1]:
            dw = dy.reshape(-1, L).mT.mm(x.reshape(-1, K))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            per_example = dy3.sum(1, dtype=torch.promote_types(dy.dtype, torch.float32))  # [B, L]; float64 stays
            db = _cast(per_example.sum(0), dy.dtype)
            if b_sq is not None:
                b_sum = sum_of_squares(per_example)
        sink_grad = _hand_out(ctx, x.device, w_sum, b_sum, B)
        return dx, dw, db, None, None, None, None, q, h_sq, None, None, sink_grad


def _norm_ways(x3, dy3, ids, max_chunk_numel, grad_dtype=None):
    """{method: function} for the two ways of a Linear's weight norm from x3 [B, T, K] and dy3 [B, T, L],
    each returning (sum_b ||W_b||^2, the weight gradient in grad_dtype or None if grad_dtype is None (a
    shim layer's is torch's), Q for a tied head whose embedding's ids [B, T] are given, else None)."""
    def ghost():
        dw = None if grad_dtype is None else dy3.reshape(-1, dy3.shape[-1]).mT.mm(x3.reshape(-1, x3.shape[-1]))
        q = _head_grad_at_ids(x3, dy3, ids, max_chunk_numel) if ids is not None else None
        return _weight_sqnorm_ghost(x3, dy3, max_chunk_numel), dw, q

    def materialised():
        sq, dw, q = _weight_sqnorm_materialised(x3, dy3, max_chunk_numel, grad_dtype is not None, ids)
        return sq, None if dw is None else _cast(dw, grad_dtype), q

    return {"ghost": ghost, "materialise": materialised}


def _weight_norm(ctx, ways):
    """The result of the one of `ways` (_norm_ways) that the layer's call chose (ctx.ghost): nothing is
    timed in the backward."""
    return ways["ghost" if ctx.ghost else "materialise"]()


class _LinearNormTap(torch.autograd.Function):
    """Identity on the output y of a torch linear; its backward measures the per-example norms
    from dy and the saved input x and hands dy on untouched."""

    @staticmethod
    def forward(ctx, y, x, has_bias, w_sq, b_sq, count, ids, link_q, link_s, ghost, max_chunk_numel, sink=None):
        ctx.save_for_backward(x, ids)
        ctx.bufs, ctx.sink = (w_sq, b_sq, count), sink is not None
        ctx.has_bias, ctx.linked = has_bias, link_q is not None
        ctx.ghost, ctx.max_chunk_numel = ghost, max_chunk_numel
        # a DTensor y (tensor parallelism): x is already local, dy is measured on its local tensor
        ctx.dy_placements = sharded.grad_placements(y) if sharded.is_dtensor(y) else None
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy):
        x, ids = ctx.saved_tensors
        w_sq, b_sq, count = ctx.bufs
        dl = dy if ctx.dy_placements is None else sharded.local_grad(dy, ctx.dy_placements)
        K, L = x.shape[-1], dl.shape[-1]
        B = _examples(x, 1)
        x3, dy3 = x.reshape(B, -1, K), dl.reshape(B, -1, L)
        q = h_sq = w_sum = b_sum = None
        if w_sq is not None or ctx.linked:
            ids2 = ids.reshape(B, -1) if ctx.linked else None
            sq, _, q = _weight_norm(ctx, _norm_ways(x3, dy3, ids2, ctx.max_chunk_numel))
            if ctx.linked:
                h_sq = sq
            else:
                w_sum = sq
        if b_sq is not None:
            b_sum = sum_of_squares(dy3.sum(1, dtype=torch.float32))
        sink_grad = _hand_out(ctx, x.device, w_sum, b_sum, B)
        return dy, None, None, None, None, None, None, q, h_sq, None, None, sink_grad


class _MeasuredLinear(MeasuredLayer, nn.Linear):
    """What the two Linear classes share: buffers, the tie link, autocast handling, the choice
    between the ghost norm and materialised per-example weight gradients."""
    per_example_mode = "auto"  # one of PER_EXAMPLE_MODES, on the class or a layer
    max_chunk_numel = 1 << 24  # bound on the float32 elements of per-example temporaries
    fused = True
    weight_transposed = False  # set by measure() for a weight stored [in, out] (Hugging Face's Conv1D)
    # set by measure() for a Linear inside a known mixture-of-experts block (registry.MOE_BLOCKS), which
    # hands it the batch flattened to [B*T, K] rows in example order: such an input is viewed [B, T, K]
    flat_examples = False

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        register_sqgradnorm_buffers(self)
        self._tie = None  # set by tie_weights when this is a tied output head
        # "ghost" or "materialise": the method of this layer's last measured call; under "auto" the
        # one it keeps (chosen at its first measured call, or restored: set_linear_norm_methods)
        self.norm_method = None

    # set by measure() for a Linear of an expert written as Linears (nanogns/layers/routed.py): its block
    _gns_block = None

    def forward(self, x):
        if self._gns_block is not None:  # an expert's rows: laid out per example by their tokens
            return routed_forward(self, x, self._forward)
        return self._forward(x)

    def _forward(self, x):
        x3 = self._examples_view(x)
        if x3 is not None:
            return self._forward(x3).reshape(x.shape[0], -1)
        self._check_call(_examples(x, 1))
        tensor_parallel = sharded.is_dtensor(x)
        if tensor_parallel:  # before the buffers are read: parallelize_module made them DTensors
            sharded.localise_buffers(self)
        args = self._measurement_args(x)
        if args is None:
            return self._linear(x, self.weight, self.bias)
        if tensor_parallel:
            return self._measured_sharded(x, *args)
        return self._measured(x, *args)

    def _examples_view(self, x):
        """A flat_examples layer's [B*T, K] input (B and T the model's, examples first) viewed [B, T, K];
        None for any other input, which is measured as it is (or refused by _check_call)."""
        if not self.flat_examples or x.dim() != 2:
            return None
        state = self._forward_state or {}
        B, T = state.get("B"), state.get("T")
        if not B or not T or T == 1 or state.get("batch_dim", 0) != 0 or x.shape[0] != B * T:
            return None
        return x.reshape(B, T, x.shape[1])

    def _measured_sharded(self, x, ids, link_q, link_s, w_sq, b_sq, ghost):
        """Under ColwiseParallel / RowwiseParallel (x, the parameters, the output DTensors on the TP mesh):
        torch's own linear and backward (either class), the norms measured beside them from the local
        x and dy as the shim does, and how they add over the TP group noted (nanogns/layers/sharded.py):
        a weight shard's sums add; a bias whose output gradient is replicated (rowwise) counts once."""
        where = self._measured_name or type(self).__name__
        if link_q is not None or self.weight_transposed:
            raise RuntimeError(f"{where}: a tied output head or a transposed (Conv1D) weight under tensor "
                               "parallelism is not measured; leave it unmeasured (measure(model, kinds=...))")
        x_split = sharded.feature_sharded(x.placements, x.dim(), f"{where}'s input")
        dtype = _autocast_dtype(x)
        if dtype is not None and x.is_floating_point():
            x = x.to(dtype)
        y = self._linear(x, self.weight, self._parameters.get("bias"))
        dy_split = sharded.feature_sharded(sharded.grad_placements(y), y.dim(), f"{where}'s output gradient")
        sharded.note_sharded(self, x.device_mesh.get_group(),
                             {"weight_sqgradnorm": "sum" if x_split or dy_split else "once",
                              "bias_sqgradnorm": "sum" if dy_split else "once", "example_count": "once"})
        return _LinearNormTap.apply(y, x.detach().to_local(), self.bias is not None, w_sq, b_sq, self.example_count,
                                    None, None, None, ghost, self.max_chunk_numel, self._compiled_sink())

    def _linear(self, x, weight, bias):
        """x W^T + b; for a transposed weight ([in, out], Hugging Face's Conv1D) Conv1D's own addmm,
        so that the shim's .grad stays bit-identical to the layer it replaced."""
        if not self.weight_transposed:
            return F.linear(x, weight, bias)
        flat = x.reshape(-1, x.shape[-1])
        y = flat.mm(weight) if bias is None else torch.addmm(bias, flat, weight)
        return y.view(*x.shape[:-1], weight.shape[-1])

    def _measurement_args(self, x):
        """(ids, link_q, link_s, w_sq, b_sq, ghost) for this call, or None if nothing is measured.
        Runs on every forward: parameters and buffers are read from their dicts (a module
        attribute lookup goes through two __getattr__)."""
        link = self._tie.pop("link", None) if self._tie is not None else None
        if not torch.is_grad_enabled():
            return None
        # a parametrized weight (spectral norm) is computed and not in _parameters: its per-example
        # gradient is not the parameter's, and find_sqgradnorm_buffers does not report it
        weight, bias = self._parameters.get("weight"), self._parameters.get("bias")
        w_trains = weight.requires_grad if weight is not None else self.weight.requires_grad
        b_trains = bias is not None and bias.requires_grad
        w_sq = self._buffers.get("weight_sqgradnorm") if weight is not None and w_trains else None
        b_sq = self._buffers.get("bias_sqgradnorm") if b_trains else None
        ids = link_q = link_s = None
        if link is not None and w_trains:
            ids, link_q, link_s = link
            if _examples(x, 1) != _examples(ids, 0):
                raise ValueError(f"tied output head: input {tuple(x.shape)} does not have the "
                                 f"embedding ids' {tuple(ids.shape)} examples in its first dimension")
        if w_sq is None and b_sq is None and link_q is None:
            return None
        mode, method = self.per_example_mode, self.norm_method
        compiling = torch.compiler.is_compiling()
        tokens = math.prod(x.shape[1:-1])
        if mode == "auto" and method is None:  # chosen once, the same on every rank: nothing is timed
            dtype = (_autocast_dtype(x) if x.is_floating_point() else None) or x.dtype
            method = _auto_method(self, tokens, dtype, x.device)
            if not compiling:
                self.norm_method = method
        if mode == "auto":
            return ids, link_q, link_s, w_sq, b_sq, method == "ghost"
        ghost = _use_ghost(tokens, self.in_features, self.out_features, self.fused, mode)
        if not compiling:
            self.norm_method = "ghost" if ghost else "materialise"
        return ids, link_q, link_s, w_sq, b_sq, ghost

    def _autocast(self, x):
        """Cast like autocast would, outside the Function, so .grad flows back through the casts."""
        weight, bias = self.weight, self._parameters.get("bias")  # the weight may be computed (parametrized)
        if self.weight_transposed:
            weight = weight.mT
        dtype = _autocast_dtype(x)
        if dtype is None or not x.is_floating_point():
            return x, weight, bias
        return x.to(dtype), weight.to(dtype), bias.to(dtype) if bias is not None else None


class PEGradNormLinear(_MeasuredLinear):
    """
    nn.Linear whose single backward computes dx, dW, db and the per-example squared norms.
    The weight's norm is either materialised (W_b = dy_b^T x_b, the weight GEMM split by example:
    a batched GEMM, summed for the weight gradient) or a ghost norm (sum((x_b x_b^T) * (dy_b dy_b^T)),
    one more GEMM-sized pass), as `per_example_mode` (class or layer) says: "auto" (the default) takes
    at the layer's first measured call the faster as its card's compute capability's routes table
    measured it at that shape and T (tokens per example), else the shapes rule, and keeps it (nothing
    is timed in training); "shapes" picks per call from the shapes alone; "ghost" / "materialise"
    force one. Examples are processed in chunks of at most max_chunk_numel float32 elements' worth
    of temporaries (or one example, if one needs more: its K*L W_b materialised, in the route's dtype, 3*T^2 + T*(K+L)
    ghost); beyond that only [B, L] bias sums and, when materialising, two [L, K] float32
    accumulators. Materialising takes the route (bmm, bmm-f32, the Triton kernel at a tiling) that
    its card's routes table chose for its shape (materialised_route), on the CPU bmm.
    """
    fused = True

    def _measured(self, x, ids, link_q, link_s, w_sq, b_sq, ghost):
        x, weight, bias = self._autocast(x)
        return _LinearFn.apply(x, weight, bias, w_sq, b_sq, self.example_count, ids, link_q, link_s,
                               ghost, self.max_chunk_numel, self._compiled_sink())


class PEGradNormShimLinear(_MeasuredLinear):
    """
    nn.Linear whose backward is torch's own (so .grad is bit-identical), with the per-example
    squared norms measured beside it from dy and the input. Ghost or materialised norms, chosen as
    in PEGradNormLinear, and chunking as there, except that here materialising costs the weight
    GEMM again.
    """
    fused = False

    def _measured(self, x, ids, link_q, link_s, w_sq, b_sq, ghost):
        dtype = _autocast_dtype(x)
        if dtype is not None and x.is_floating_point():
            x = x.to(dtype)  # the very tensor F.linear saves, so saved only once
        y = self._linear(x, self.weight, self._parameters.get("bias"))
        return _LinearNormTap.apply(y, x.detach(), self.bias is not None, w_sq, b_sq, self.example_count,
                                    ids, link_q, link_s, ghost, self.max_chunk_numel, self._compiled_sink())


def _auto_method(layer, tokens, dtype, device):
    """An "auto" layer's method: its capability's table's where that measured the layer's shape in dtype
    at `tokens` per example, else the shapes rule's. A function of the shape and the table alone, so
    every rank of a run (one kind of card) comes to the same."""
    K, L = layer.in_features, layer.out_features
    method = table_method(tokens, K, L, dtype, device)
    if method is None:
        method = "ghost" if _use_ghost(tokens, K, L, layer.fused, "shapes") else "materialise"
    return method


def measured_linears(model):
    """(name, layer) of every measured Linear of `model`, in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, _MeasuredLinear)]


def set_per_example_mode(model, mode):
    """Set per_example_mode (one of PER_EXAMPLE_MODES) on every measured Linear of `model`."""
    if mode not in PER_EXAMPLE_MODES and mode is not None:
        raise ValueError(f"per_example_mode must be one of {', '.join(map(repr, PER_EXAMPLE_MODES))}, not {mode!r}")
    for _, layer in measured_linears(model):
        layer.per_example_mode = mode


def linear_norm_methods(model):
    """{layer name: "ghost" or "materialise"} of every measured Linear that has measured its weight
    (or had its method restored): what a checkpoint keeps and out_dir records."""
    return {name: layer.norm_method for name, layer in measured_linears(model) if layer.norm_method is not None}


def set_linear_norm_methods(model, methods):
    """Give the measured Linears of `model` named in `methods` (linear_norm_methods' dict) their
    methods: "auto" layers keep them instead of choosing; other modes go on deciding per call."""
    for name, layer in measured_linears(model):
        if name in methods:
            if methods[name] not in NORM_METHODS:
                raise ValueError(f"{name}: a Linear's method is one of {', '.join(NORM_METHODS)}, not {methods[name]!r}")
            layer.norm_method = methods[name]


@torch.no_grad()
def choose_linear_norm_methods(model, examples, tokens, device, dtype=torch.float32, seed=0):
    """
    Before torch.compile, which reads no file: read the routes table of device's compute capability,
    and give each measured Linear of `model` in "auto" mode that has no method yet (none restored) the
    one its first call would take (_auto_method): the table's, where it measured the layer's shape at
    `tokens` per example in `dtype`, else the shapes rule's. Nothing is timed, so every rank comes to
    the same; `examples` and `seed` are not used (kept for callers). A weight not measured (frozen, or
    shared with an unmeasured layer) is skipped. Touches nothing but norm_method. Returns
    linear_norm_methods(model).
    """
    device = torch.device(device)
    _route_table(device)  # read now: the compiled graph reads no file
    for _, layer in measured_linears(model):
        weight = layer._parameters.get("weight")
        measured = weight is not None and weight.requires_grad and layer._buffers.get("weight_sqgradnorm") is not None
        if layer.per_example_mode != "auto" or layer.norm_method is not None or not measured:
            continue
        layer.norm_method = _auto_method(layer, tokens, dtype, device)
    return linear_norm_methods(model)


@torch.no_grad()
def agree_linear_norm_methods(model, group=None):
    """
    Give every rank of `group` its first rank's method for each measured Linear (None where that
    rank has none yet), all layers in one broadcast: the ranks then measure alike even where one
    restored other methods than another. Call it on every rank at the same point, as the buffers'
    all-reduce. Returns linear_norm_methods(model).
    """
    layers = [layer for _, layer in measured_linears(model)]
    if not layers:
        return {}
    codes = [0 if layer.norm_method is None else 1 + NORM_METHODS.index(layer.norm_method) for layer in layers]
    codes = torch.tensor(codes, dtype=torch.int64, device=layers[0].example_count.device)
    first = 0 if group is None else torch.distributed.get_global_rank(group, 0)
    torch.distributed.broadcast(codes, src=first, group=group)
    for layer, code in zip(layers, codes.tolist()):
        layer.norm_method = None if code == 0 else NORM_METHODS[code - 1]
    return linear_norm_methods(model)


@torch.no_grad()
def linear_sqnorms(x, dy, weight=True, bias=True):
    """
    (sum_b ||dW_b||^2, sum_b ||db_b||^2) of a Linear y = x W^T + b from its input x [B, ..., K] and
    output gradient dy [B, ..., L], float32 0-dim (None where not asked): PEGradNormShimLinear's
    maths and chunking, for code that sees x and dy beside torch's own backward (nanogns/estimators/hooks.py). It
    keeps no layer and reads no table: ghost or materialise as PEGradNormShimLinear.per_example_mode
    forces, else ("auto", "shapes") from the shapes. x is taken in dy's dtype, the one the layer
    computed in under autocast.
    """
    B, K, L = _examples(x, 1), x.shape[-1], dy.shape[-1]
    x3, dy3 = x.to(dy.dtype).reshape(B, -1, K), dy.reshape(B, -1, L)
    max_chunk_numel = PEGradNormShimLinear.max_chunk_numel
    mode = PEGradNormShimLinear.per_example_mode
    w_sq = b_sq = None
    if weight and _use_ghost(x3.shape[1], K, L, False, "shapes" if mode == "auto" else mode):
        w_sq = _weight_sqnorm_ghost(x3, dy3, max_chunk_numel)
    elif weight:
        w_sq = _weight_sqnorm_materialised(x3, dy3, max_chunk_numel, False)[0]
    if bias:
        b_sq = sum_of_squares(dy3.sum(1, dtype=torch.float32))
    return w_sq, b_sq
