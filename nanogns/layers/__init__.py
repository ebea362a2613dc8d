"""
Per-example gradient norm layers: drop-in Linear, Embedding, LayerNorm and RMSNorm classes whose
backward pass also accumulates, for every trainable parameter p, the running sum over
examples b of ||g_b / B||^2 (the per-example gradient as the layer sees it), in float32.

    --linearclass=gns      PEGradNormLinear              fused: one backward computes the
                                                          gradients and the norms
    --linearclass=shim     PEGradNormShimLinear           torch's own backward (bit-identical
                                                          .grad), norms added beside it
    --embeddingclass=gns   PEGradNormEmbedding            fused
    --embeddingclass=shim  PEGradNormShimEmbedding        torch's own backward, norms beside it
    --lnclass=shim         PEGradNormSeparatedLayerNorm   normalisation, then an affine part
                                                          that measures dgamma_b and dbeta_b
                           LayerNorm                      unmeasured: nn.LayerNorm that also takes
                                                          nanoGPT's LayerNorm(ndim, bias)
    --lnclass=shim         PEGradNormSeparatedRMSNorm     for RMSNorm: torch's rms_norm (bit-identical
                                                          output and .grad), dgamma_b measured beside it
    --lnclass=fused        PEGradNormFusedLayerNorm       the normgnorm kernel: y, dx, dgamma, dbeta and
                           PEGradNormFusedRMSNorm         the norms in one forward and one backward

MEASURED_CLASSES (below) is the one table from a kind of layer (linear, embedding, layernorm,
rmsnorm) and a flag value to its measured class: layer_config's flags are derived from it, and
measure(model, linear="gns", embedding="gns", norm="shim", kinds=None, strict=False) swaps the
layers of any model (nanoGPT's, Hugging Face's, yours) for those classes in place, keeping their
Parameters, linking a tied embedding and head and leaving out any other shared weight.

The first dimension of a layer's input indexes the examples: [B, T, ...] (the rest are summed
over within an example), a 2-D [N, K] input is N examples of one row each. In a model measure()
converted, a layer whose input's first dimension is not the model's batch (tokens flattened to
[B*T, K]) is an error, and the layers of mixture-of-experts blocks are left out (see measure).

Buffer convention (read by gnstracking.py):
- a measured module has a non-persistent float32 0-dim buffer `example_count` (examples seen
  since the last zeroing, summed over gradient-accumulation micro-steps), and
- for each of its parameters `name`, a non-persistent float32 0-dim buffer `{name}_sqgradnorm`.
Non-persistent buffers stay out of state_dict, so checkpoints load into plain nanoGPT and back.
Buffers accumulate (add_) in backward, so gradient-accumulation micro-steps sum; only
parameters that require grad are measured. The buffers stay float32 through model.half() and
model.to(torch.bfloat16). A layer's weight_pegsqnorm() / bias_pegsqnorm() give the reference
implementation's number, sum * count = (1/B) sum_b ||g_b||^2. Under a float16 GradScaler the
loss is scaled by s, so the buffers hold s^2 times the true sums: the tracker divides by s^2,
the layers never see s.

Every layer must be applied once per forward (a layer used twice would need the cross terms
between its uses: in a model measure() converted, an error); the one exception handled here is
the tied token embedding / output head, linked by tie_weights() (or measure()). Each class's docstring gives its maths; the ghost norm is Goodfellow
2015 ("Efficient Per-Example Gradient Computations") extended to sequences as in Li et al.
2022 ("Large Language Models Can Be Strong Differentially Private Learners").

torch.compile: every class compiles (the buffers are handed to the autograd Functions as
inputs and mutated with add_ in backward, which torch 2.13's AOTAutograd accepts; the
normalisations instead hand their sums out of the compiled backward as the gradient of a sink,
added to the buffers after it: _MeasuredNorm).
"""
import functools
import importlib.util
import math
import os
import time
import types
import warnings
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.parametrize import is_parametrized

# the kinds' names (the analysis's groups, layer_config's classes); norm= chooses for both NORM_KINDS
from nanogns.maths import KIND_NAMES, NORM_KINDS
import nanogns.normgnorm as normgnorm
from nanogns.normgnorm.torch_path import rms_norm_eps
from nanogns.refusals import ReferenceNameError, refuse_module_names, refused


def register_sqgradnorm_buffers(module):
    """Give `module` an example counter and one float32 running-sum buffer per own parameter."""
    for name, _ in module.named_parameters(recurse=False):
        module.register_buffer(f"{name}_sqgradnorm", torch.zeros((), dtype=torch.float32), persistent=False)
    module.register_buffer("example_count", torch.zeros((), dtype=torch.float32), persistent=False)


def find_sqgradnorm_buffers(model):
    """
    One (name, parameter, sqgradnorm buffer, count buffer) per measured trainable parameter,
    in model.named_parameters() order, each parameter once (tied ones under their first name).
    A parameter that more than one module holds is measured only when those are a token
    embedding and an output head linked by tie_weights (or measure()): any other sharing, and a
    measured module that sits in the model twice, would give a part of its gradient, so such a
    parameter is left out with a warning naming it.
    """
    holders, found = {}, {}
    for module in model.modules(remove_duplicate=False):  # a module held twice is counted twice
        for p in module.parameters(recurse=False):
            holders.setdefault(id(p), []).append(module)
    for module in model.modules():
        if "example_count" not in module._buffers:
            continue
        for pname, p in module.named_parameters(recurse=False):
            buf = module._buffers.get(f"{pname}_sqgradnorm")
            if buf is not None and p.requires_grad:
                found.setdefault(id(p), []).append((buf, module._buffers["example_count"]))
    entries = []
    for name, p in model.named_parameters():
        if id(p) not in found:
            continue
        shared_by = holders[id(p)]
        if len(found[id(p)]) == 1 and (len(shared_by) == 1 or _linked_pair(shared_by)):
            entries.append((name, p, *found[id(p)][0]))
        else:
            classes = ", ".join(type(m).__name__ for m in shared_by)
            _warn_once(f"{name} is shared by {len(shared_by)} layers ({classes}): only a token embedding tied "
                       "to an output head is measured exactly when shared; it is not reported")
    return entries


def _linked_pair(modules):
    """Whether `modules` are one token embedding and one output head linked by tie_weights."""
    return (len(modules) == 2 and modules[0] is not modules[1]
            and getattr(modules[0], "_tie", None) is not None and modules[0]._tie is getattr(modules[1], "_tie", None))


def _is_norm_buffer(name):
    return name == "example_count" or name.endswith("_sqgradnorm")


def register_coordinate_buffers(model, params):
    """
    Give each separated LayerNorm and RMSNorm parameter whose id is in `params` a float32 buffer
    `{name}_sqgrad_coords` of its size, to which its backward then adds the per-coordinate sums
    S_d = sum_b (g_bd / B)^2 (adamgns.py applies a diagonal preconditioner to them). They are the
    Adam estimator's own: not zeroed, all-reduced or read with the scalar sums. Returns
    coordinate_buffers(model).
    """
    for module in model.modules():
        if isinstance(module, (PEGradNormSeparatedLayerNorm, PEGradNormSeparatedRMSNorm)):
            for name, p in module.named_parameters(recurse=False):
                if id(p) in params and p.requires_grad and f"{name}_sqgrad_coords" not in module._buffers:
                    module.register_buffer(f"{name}_sqgrad_coords", p.new_zeros(p.numel(), dtype=torch.float32),
                                           persistent=False)
    return coordinate_buffers(model)


def coordinate_buffers(model):
    """(name, parameter, per-coordinate sum buffer) of each parameter that has one, in named_parameters order."""
    found = {}
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            buffer = module._buffers.get(f"{name}_sqgrad_coords")
            if buffer is not None:
                found.setdefault(id(p), buffer)
    return [(name, p, found[id(p)]) for name, p in model.named_parameters() if id(p) in found]


def all_sqgradnorm_buffers(model):
    """Every per-example-norm buffer of `model`, the running sums and the example counts, each
    once, in module order: what is zeroed after a step and summed over DDP ranks before it."""
    found = {}
    for module in model.modules():
        if "example_count" in module._buffers:
            for name, buf in module._buffers.items():
                if buf is not None and _is_norm_buffer(name):
                    found.setdefault(id(buf), buf)
    return list(found.values())


@torch.no_grad()
def allreduce_sqgradnorm_buffers(model, group=None):
    """
    Sum every per-example-norm buffer (buffered.all_sqgradnorm_buffers) over the ranks of `group`,
    in place, with one all_reduce of all of them stacked into one tensor. Call it on every rank
    after the last micro-step's backward, before the tracker reads the buffers (and before they
    are zeroed).

    Afterwards each count is the global batch B = W * B_rank, and each sum is
    S = sum over ranks of sum_b ||g_b / B_rank||^2: every rank's layers saw the gradient of its
    own rank's mean loss, not of the global one. The mean per-example squared norm is then
        |G_1|^2 = (B_rank^2 / B) * S = B * S / W^2,
    so the tracker must know W (the naive B * S is W^2 times too large). Under a float16
    GradScaler S is still s^2 times too large, as on one process.
    """
    allreduce_buffers(all_sqgradnorm_buffers(model), group)


@torch.no_grad()
def allreduce_buffers(bufs, group=None):
    """Sum the float32 tensors `bufs` (any shapes) over the ranks of `group` in place, with one
    all_reduce of them all laid end to end: one collective per step, however many layers."""
    if not bufs:
        return
    flat = torch.cat([b.reshape(-1) for b in bufs])
    torch.distributed.all_reduce(flat, group=group)
    torch._foreach_copy_(bufs, [part.view_as(b) for part, b in zip(flat.split([b.numel() for b in bufs]), bufs)])


@torch.no_grad()
def zero_sqgradnorm_buffers(model):
    """Zero every per-example-norm buffer in place (after each optimizer step)."""
    bufs = all_sqgradnorm_buffers(model)
    if bufs:
        torch._foreach_zero_(bufs)  # one call for all of them


_warned = set()


def _warn_once(message):
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)


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


# ---------------------------------------------------------------------------------------------
# Per-example squared norms, as pure functions of [B, T, .] tensors (float32 results).

# A CPU BLAS dot accumulates each SIMD lane serially: over 7M float32 elements on one thread
# it is off by 1.6e-4 relative (6e-5 on two). Dots over pieces of this many elements, summed
# in float64, are off by ~1e-7 for 1.5x the time of one dot.
CPU_DOT_PIECE = 1 << 16


def sum_of_squares(t):
    """Sum of squares of t as float32, accumulated in at least float32. Dot products: faster
    than vector_norm and more precise (on CPU a float32 vector_norm is off by ~5e-4 relative at
    7M elements); on CPU in pieces (CPU_DOT_PIECE), float16/bfloat16 pieces taken to float64
    (a float32 dot of 65536 equal squares is off by 2e-5 on one thread)."""
    flat = t.reshape(-1)
    low = flat.dtype not in (torch.float32, torch.float64)
    if flat.device.type == "cpu" and flat.numel() > CPU_DOT_PIECE:
        if low:
            flat = flat.double()  # the copy is needed anyway
        # the whole pieces' dots in one batched call (a call per piece cost more than the arithmetic)
        whole = flat.numel() - flat.numel() % CPU_DOT_PIECE
        pieces = flat[:whole].view(-1, 1, CPU_DOT_PIECE)
        total = torch.bmm(pieces, pieces.mT).sum(dtype=torch.float64)
        if whole < flat.numel():
            rest = flat[whole:]
            total = total + torch.dot(rest, rest)
        return total.float()
    if low:
        return torch.linalg.vector_norm(flat, dtype=torch.float32).square()
    return _cast(torch.dot(flat, flat), torch.float32)


def _chunk(per_example_numel, B, max_chunk_numel):
    """How many examples to process at once so the temporaries stay under max_chunk_numel."""
    return max(1, min(B, max_chunk_numel // max(1, per_example_numel)))


def _cast(t, dtype):
    """t in dtype, without a call when it is already (a no-op .to() still costs a dispatch)."""
    return t if t.dtype == dtype else t.to(dtype)


# Fused layers: use the ghost norm when T^2 (K+L) < FUSED_GHOST_RATIO * K L. The crossover
# measured on CPU (bench/layers.py --sweep) lies between 20 and 80; inside a small GPT's
# backward (T 64, width 128) both cost the same at about 40, where the ghost's few [T, T]
# Gram matrices take far less memory than B*K*L per-example weight gradients.
FUSED_GHOST_RATIO = 48

# How a measured Linear chooses between the ghost norm and materialised per-example weight
# gradients (its per_example_mode): "auto" times both on its own tensors at its first measured
# backward and keeps the faster (linear_norm_methods reads the choices; under torch.compile, which
# times nothing, choose_linear_norm_methods times them beforehand, else the shapes decide); "shapes" the flop rule
# of _use_ghost at every call (what two runs agree on bit for bit; None, its earlier name, is the
# same); or one of the two, forced.
PER_EXAMPLE_MODES = ("auto", "shapes", "ghost", "materialise")
NORM_METHODS = ("ghost", "materialise")
TIMING_REPEATS = 3  # runs of each method when choosing; the fastest run of each is compared


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


def _timed_choice(layer, ways, device):
    """
    Run each of `ways` ({method: function computing the weight's norm and whatever goes with it})
    TIMING_REPEATS times on the layer's own tensors, keep the method of the fastest single run on
    `layer` (its norm_method) and return that method's result: its norm is then added once, like
    any other call's. The functions must not write to the buffers.
    """
    fastest, results = {}, {}
    for method, way in ways.items():
        fastest[method] = math.inf
        for _ in range(TIMING_REPEATS):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            results[method] = way()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            fastest[method] = min(fastest[method], time.perf_counter() - start)
    layer.norm_method = min(fastest, key=fastest.get)
    return results[layer.norm_method]


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
# (ROUTE_COLUMNS) that is committed as nanogns/layers/routes/linear-routes-<card family>.csv. The routes:
#   "bmm"              torch.bmm (cuBLAS) of each example's dy_b^T x_b, W_b in the compute dtype, then
#                      one pass over W_b for its squares and its sum over examples (the weight gradient)
#   "bmm-f32"          the same with W_b in float32 (torch.bmm's out_dtype on CUDA; elsewhere from
#                      float32 copies of the inputs)
#   "kernel <tiling>"  linear_gns_kernel's Triton GEMM with that tiling, which never writes W_b (a GPU
#                      with Triton)
# A layer on a GPU takes its card's fastest route whose norms and gradient were within ROUTE_TOLERANCE
# of float64 in the sweep, measured at the nearest number of tokens per example; a card without a
# table, a shape or dtype its table lacks, and the CPU take the cuBLAS route.
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
    """The family of a GPU, as its routes table is named: "NVIDIA H100 80GB HBM3" and "NVIDIA H100 PCIe"
    -> "h100", "NVIDIA A100-SXM4-80GB" -> "a100", "NVIDIA GeForce RTX 4090" -> "rtx-4090"."""
    kept = []
    for word in name.lower().split():
        if word in ("nvidia", "geforce", "tesla", "amd", "radeon"):
            continue
        kept.append(word.split("-")[0])
        if any(c.isdigit() for c in word):  # the model number ends the family's name
            break
    return "-".join(kept)


def route_table_path(card_name):
    """Where the routes table of the card called card_name (torch.cuda.get_device_name) is committed."""
    return os.path.join(ROUTES_DIR, f"linear-routes-{card_family(card_name)}.csv")


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


_route_tables = {}  # str(device) -> read_route_table() of its card


def _route_table(device):
    """The routes table of device's card, read at its first eager use; {} off GPU. torch.compile traces
    no file read: a table not read before compiling counts as none (choose_linear_norm_methods reads it)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    table = _route_tables.get(str(device))
    if table is None:
        if torch.compiler.is_compiling():
            return {}
        table = read_route_table(route_table_path(torch.cuda.get_device_name(device))) if device.type == "cuda" else {}
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
    tokens per example itself; None where it did not measure that (the layer then times them)."""
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
        import nanogns.layers.linear_kernel as linear_gns_kernel  # here, on first use: it imports Triton
        if linear_gns_kernel.supports(x, dy):
            config = linear_gns_kernel.config_of(route.removeprefix("kernel "))
            grad, per_example = linear_gns_kernel.per_example_weight_grad(x, dy, want_grad, **config)
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


def _embedding_rows(ids, dx, num_embeddings, padding_idx):
    """
    Per-example embedding gradients, compactly: one float32 row per distinct (example b,
    id v) pair, holding sum_{t: id_bt = v} dx_bt (padding positions zeroed, as nn.Embedding
    does), so that sum of squares over all rows = sum_b ||E_b||^2. Returns (rows [R, D],
    row_ids [R] the vocabulary row of each, dx as float32 [B*T, D] with padding zeroed);
    unused rows are zero. No loop over examples, no host sync.
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
        rows = dx.new_zeros(B * num_embeddings, D).index_add_(0, key, dx)
        row_ids = torch.arange(B * num_embeddings, device=ids.device) % num_embeddings
    else:
        # sort the (example, id) keys and give each distinct key one row
        sorted_key, order = torch.sort(key, stable=True)
        is_new = torch.ones_like(sorted_key, dtype=torch.bool)
        is_new[1:] = sorted_key[1:] != sorted_key[:-1]
        segment = torch.cumsum(is_new, 0) - 1
        row_of_position = torch.empty_like(segment).scatter_(0, order, segment)
        rows = dx.new_zeros(B * T, D).index_add_(0, row_of_position, dx)
        row_ids = torch.zeros_like(key).scatter_(0, segment, sorted_key % num_embeddings)
    return rows, row_ids, dx


def _examples(t, trailing):
    """Number of examples in t: its first dimension, or 1 when it has only `trailing` dims."""
    return t.shape[0] if t.dim() > trailing else 1


def _autocast_dtype(x):
    """The autocast compute dtype for x's device if autocast is on, else None."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


class MeasuredLayer:
    """
    Mixin of every per-example-norm layer: moves keep the buffers'
    values and casts keep them float32; the reference implementation's accessors read them.
    """

    # set by measure(): the model's forward state its pre-hook keeps (batch size, sequence length,
    # forward count), this layer's name in the model, and the forward it last measured in
    _forward_state = None
    _measured_name = None
    _last_forward = None

    def _check_call(self, n):
        """
        Refuse, by raising, a call of a layer of a measured model (in a forward with grad) whose
        per-example norm would be wrong:
        - its input has n rows (its first dimension) where the model's input has B examples: the
          rows are tokens (a [B*T, K] flattened batch, a per-token index), so its norms would be
          per-token ones counted as examples (a frozen layer measures nothing and passes);
        - it is applied a second time in one forward: each example's gradient would need the cross
          terms between the two uses, which nothing computes (the count would also come out 2B).
          Eager only: under torch.compile this one is skipped.
        """
        state = self._forward_state
        if state is None or not torch.is_grad_enabled():
            return
        B = state["B"]
        if B is not None and n != B and any(p is not None and p.requires_grad for p in self._parameters.values()):
            raise RuntimeError(f"{self._measured_name}: sees {n} rows, the batch has {B} examples: per-token input, "
                               "not measured; leave its block out with measure(model, kinds={Block: None})")
        if torch.compiler.is_compiling():
            return
        forward = state["forward"]
        if forward is not None and forward == self._last_forward:
            names = ", ".join(f"{self._measured_name}.{n}" for n, p in self.named_parameters(recurse=False))
            raise RuntimeError(f"{names}: the measured {type(self).__name__} {self._measured_name} was applied twice "
                               "in one forward; its per-example norm would need the cross terms between the uses. "
                               "Leave that kind unmeasured (measure(model, ...=None)) or apply each layer once")
        self._last_forward = forward

    def _apply(self, fn, recurse=True):
        ours = {n: b for n, b in self._buffers.items()
                if b is not None and (_is_norm_buffer(n) or n.endswith("_sqgrad_coords"))}
        for n in ours:
            del self._buffers[n]
        super()._apply(fn, recurse)
        for n, b in ours.items():
            moved = fn(b)
            self._buffers[n] = moved if moved.dtype == torch.float32 else b.to(moved.device)
        return self

    # The reference implementation's accessors and buffer names. Its layers keep a [sum, count]
    # pair per parameter and give the product; here the sum and the count are two buffers.

    def weight_pegsqnorm(self):
        """weight_sqgradnorm * example_count = B sum_b ||g_b / B||^2 = (1/B) sum_b ||g_b||^2 (float32
        0-dim), as the reference's accessor; an error where the weight is not measured."""
        return self._pegsqnorm("weight")

    def bias_pegsqnorm(self):
        """bias_sqgradnorm * example_count, as weight_pegsqnorm(); an error where there is no bias."""
        return self._pegsqnorm("bias")

    def _pegsqnorm(self, name):
        where = f"{type(self).__name__}.{name}_pegsqnorm()"
        p = self._parameters.get(name)
        if p is None and is_parametrized(self, name):
            raise RuntimeError(f"{where}: the {name} is parametrized (a computed tensor), so it is not measured")
        if p is None:
            raise RuntimeError(f"{where}: this layer has no {name}, so there is nothing to measure")
        if not p.requires_grad:
            raise RuntimeError(f"{where}: the {name} does not require grad, so it is not measured")
        buf = self._buffers.get(f"{name}_sqgradnorm")
        if buf is None and getattr(self, "_tie", None) is not None:
            raise RuntimeError(f"{where}: this head's weight is tied to a token embedding, which measures the "
                               "shared weight exactly: use the embedding's weight_pegsqnorm()")
        if buf is None:
            raise RuntimeError(f"{where}: this {name} is tied to a layer that does not measure per-example "
                               "norms, so it is not measured")
        return buf * self.example_count

    def __getattr__(self, name):
        # the reference implementation's names (_REFERENCE_LAYER_NAMES) are refused when asked for,
        # and stay out of dir(); everything else is nn.Module's (parameters, buffers, submodules)
        if name in _REFERENCE_LAYER_NAMES:
            raise ReferenceNameError(f"PEGradNorm*.{name} is the reference implementation's and is not kept "
                                     f"in this fork: {_REFERENCE_LAYER_NAMES[name]}")
        return super().__getattr__(name)


_SUM_AND_COUNT = "(both float32 0-dim)"
_REFERENCE_LAYER_NAMES = {
    "weight_upegsqnorm": f"use weight_sqgradnorm (the running sum) and example_count {_SUM_AND_COUNT}, "
                         "or weight_pegsqnorm() for their product",
    "bias_upegsqnorm": f"use bias_sqgradnorm (the running sum) and example_count {_SUM_AND_COUNT}, "
                       "or bias_pegsqnorm() for their product",
    "marked_buffers": "use buffered.find_sqgradnorm_buffers(model): (name, parameter, sum buffer, count buffer) "
                      "per measured parameter",
    "named_buffers_with_marker": "use buffered.find_sqgradnorm_buffers(model): (name, parameter, sum buffer, "
                                 "count buffer) per measured parameter",
    "register_marked_buffer": "use buffered.register_sqgradnorm_buffers(module)",
    "register_upegsqnorm_buffer": "use buffered.register_sqgradnorm_buffers(module)",
}


# ---------------------------------------------------------------------------------------------
# Linear

class _LinearFn(torch.autograd.Function):
    """y = x W^T + b whose backward computes dx, dW, db and the per-example norms together."""

    @staticmethod
    def forward(ctx, x, weight, bias, w_sq, b_sq, count, ids, link_q, link_s, ghost, chooser, max_chunk_numel):
        ctx.save_for_backward(x, weight, ids)
        ctx.bufs = (w_sq, b_sq, count)
        ctx.has_bias, ctx.linked = bias is not None, link_q is not None
        ctx.ghost, ctx.chooser, ctx.max_chunk_numel = ghost, chooser, max_chunk_numel
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight, ids = ctx.saved_tensors
        w_sq, b_sq, count = ctx.bufs
        K, L = x.shape[-1], dy.shape[-1]
        B = _examples(x, 1)
        x3, dy3 = x.reshape(B, -1, K), dy.reshape(B, -1, L)
        dx = dw = db = q = h_sq = None
        if ctx.needs_input_grad[0]:
            dx = dy.matmul(weight)
        if ctx.needs_input_grad[1] and (w_sq is not None or ctx.linked):
            ids2 = ids.reshape(B, -1) if ctx.linked else None
            sq, dw, q = _weight_norm(ctx, x.device, _norm_ways(x3, dy3, ids2, ctx.max_chunk_numel, weight.dtype))
            if ctx.linked:  # tied head: the norm and the cross-term factor go to the embedding
                h_sq = sq
            else:
                w_sq.add_(sq)
        elif ctx.needs_input_grad[1]:
            dw = dy.reshape(-1, L).mT.mm(x.reshape(-1, K))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            per_example = dy3.sum(1, dtype=torch.float32)  # [B, L]
            db = _cast(per_example.sum(0), dy.dtype)
            if b_sq is not None:
                b_sq.add_(sum_of_squares(per_example))
        if count is not None:
            count.add_(B)
        return dx, dw, db, None, None, None, None, q, h_sq, None, None, None


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


def _weight_norm(ctx, device, ways):
    """The result of one of `ways` (_norm_ways): the one the layer's call chose (ctx.ghost), the one its
    layer has chosen since, or, while its layer (ctx.chooser) has none, the faster, timed here."""
    chooser = ctx.chooser
    if chooser is None:
        return ways["ghost" if ctx.ghost else "materialise"]()
    if chooser.norm_method is None:
        return _timed_choice(chooser, ways, device)
    return ways[chooser.norm_method]()


class _LinearNormTap(torch.autograd.Function):
    """Identity on the output y of a torch linear; its backward measures the per-example norms
    from dy and the saved input x and hands dy on untouched."""

    @staticmethod
    def forward(ctx, y, x, has_bias, w_sq, b_sq, count, ids, link_q, link_s, ghost, chooser, max_chunk_numel):
        ctx.save_for_backward(x, ids)
        ctx.bufs = (w_sq, b_sq, count)
        ctx.has_bias, ctx.linked = has_bias, link_q is not None
        ctx.ghost, ctx.chooser, ctx.max_chunk_numel = ghost, chooser, max_chunk_numel
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy):
        x, ids = ctx.saved_tensors
        w_sq, b_sq, count = ctx.bufs
        K, L = x.shape[-1], dy.shape[-1]
        B = _examples(x, 1)
        x3, dy3 = x.reshape(B, -1, K), dy.reshape(B, -1, L)
        q = h_sq = None
        if w_sq is not None or ctx.linked:
            ids2 = ids.reshape(B, -1) if ctx.linked else None
            sq, _, q = _weight_norm(ctx, x.device, _norm_ways(x3, dy3, ids2, ctx.max_chunk_numel))
            if ctx.linked:
                h_sq = sq
            else:
                w_sq.add_(sq)
        if b_sq is not None:
            b_sq.add_(sum_of_squares(dy3.sum(1, dtype=torch.float32)))
        count.add_(B)
        return dy, None, None, None, None, None, None, q, h_sq, None, None, None


class _MeasuredLinear(MeasuredLayer, nn.Linear):
    """What the two Linear classes share: buffers, the tie link, autocast handling, the choice
    between the ghost norm and materialised per-example weight gradients."""
    per_example_mode = "auto"  # one of PER_EXAMPLE_MODES, on the class or a layer
    max_chunk_numel = 1 << 24  # bound on the float32 elements of per-example temporaries
    fused = True
    weight_transposed = False  # set by measure() for a weight stored [in, out] (Hugging Face's Conv1D)

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        register_sqgradnorm_buffers(self)
        self._tie = None  # set by tie_weights when this is a tied output head
        # "ghost" or "materialise": the method of this layer's last measured call; under "auto" the
        # one it keeps (timed at its first measured backward, or restored: set_linear_norm_methods)
        self.norm_method = None

    def forward(self, x):
        self._check_call(_examples(x, 1))
        args = self._measurement_args(x)
        if args is None:
            return self._linear(x, self.weight, self.bias)
        return self._measured(x, *args)

    def _linear(self, x, weight, bias):
        """x W^T + b; for a transposed weight ([in, out], Hugging Face's Conv1D) Conv1D's own addmm,
        so that the shim's .grad stays bit-identical to the layer it replaced."""
        if not self.weight_transposed:
            return F.linear(x, weight, bias)
        flat = x.reshape(-1, x.shape[-1])
        y = flat.mm(weight) if bias is None else torch.addmm(bias, flat, weight)
        return y.view(*x.shape[:-1], weight.shape[-1])

    def _measurement_args(self, x):
        """(ids, link_q, link_s, w_sq, b_sq, ghost, chooser) for this call, or None if nothing is
        measured; chooser is this layer where its backward is to time both methods and choose.
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
        if mode == "auto" and method is None:  # the card's table, where it measured this shape at these tokens
            dtype = (_autocast_dtype(x) if x.is_floating_point() else None) or x.dtype
            method = table_method(math.prod(x.shape[1:-1]), self.in_features, self.out_features, dtype, x.device)
            if not compiling:
                self.norm_method = method
        if mode == "auto" and method is not None:
            return ids, link_q, link_s, w_sq, b_sq, method == "ghost", None
        if mode == "auto" and not compiling:
            return ids, link_q, link_s, w_sq, b_sq, None, self  # timed in backward
        # the shapes decide (under torch.compile "auto" too: nothing is timed while tracing)
        ghost = _use_ghost(math.prod(x.shape[1:-1]), self.in_features, self.out_features, self.fused,
                           "shapes" if mode == "auto" else mode)
        if not compiling:
            self.norm_method = "ghost" if ghost else "materialise"
        return ids, link_q, link_s, w_sq, b_sq, ghost, None

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
    one more GEMM-sized pass), as `per_example_mode` (class or layer) says: "auto" (the default)
    times both at the layer's first measured backward and keeps the faster, "shapes" picks per call
    from the shapes alone (T = tokens per example), "ghost" / "materialise" force one. Examples are
    processed in chunks of at most max_chunk_numel float32 elements' worth of temporaries (or one
    example, if one needs more: its K*L W_b materialised, in the route's dtype, 3*T^2 + T*(K+L)
    ghost); beyond that only [B, L] bias sums and, when materialising, two [L, K] float32
    accumulators. Materialising takes the route (bmm, bmm-f32, the Triton kernel at a tiling) that
    its card's routes table chose for its shape (materialised_route), on the CPU bmm.
    """
    fused = True

    def _measured(self, x, ids, link_q, link_s, w_sq, b_sq, ghost, chooser):
        x, weight, bias = self._autocast(x)
        return _LinearFn.apply(x, weight, bias, w_sq, b_sq, self.example_count, ids, link_q, link_s,
                               ghost, chooser, self.max_chunk_numel)


class PEGradNormShimLinear(_MeasuredLinear):
    """
    nn.Linear whose backward is torch's own (so .grad is bit-identical), with the per-example
    squared norms measured beside it from dy and the input. Ghost or materialised norms, chosen as
    in PEGradNormLinear, and chunking as there, except that here materialising costs the weight
    GEMM again.
    """
    fused = False

    def _measured(self, x, ids, link_q, link_s, w_sq, b_sq, ghost, chooser):
        dtype = _autocast_dtype(x)
        if dtype is not None and x.is_floating_point():
            x = x.to(dtype)  # the very tensor F.linear saves, so saved only once
        y = self._linear(x, self.weight, self._parameters.get("bias"))
        return _LinearNormTap.apply(y, x.detach(), self.bias is not None, w_sq, b_sq, self.example_count,
                                    ids, link_q, link_s, ghost, chooser, self.max_chunk_numel)


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
    methods: "auto" layers keep them instead of timing; other modes go on deciding per call."""
    for name, layer in measured_linears(model):
        if name in methods:
            if methods[name] not in NORM_METHODS:
                raise ValueError(f"{name}: a Linear's method is one of {', '.join(NORM_METHODS)}, not {methods[name]!r}")
            layer.norm_method = methods[name]


@torch.no_grad()
def choose_linear_norm_methods(model, examples, tokens, device, dtype=torch.float32, seed=0):
    """
    Before torch.compile, which times nothing and reads no file: read the routes table of device's
    card, and give each measured Linear of `model` in "auto" mode that has no method yet (none
    restored) the faster of the two: the table's, where it measured the layer's shape at `tokens`
    per example in `dtype`, else timed as its first backward would time them, on random inputs
    [examples, tokens, in] and output gradients [examples, tokens, out] of `dtype` (the shapes a
    GPT's Linears see in training). A tied output head that the table does not cover, whose timing
    needs the embedding's ids, keeps the shape rule; a weight not measured (frozen, or shared with an
    unmeasured layer) is skipped. Touches nothing but norm_method: not the model's
    parameters, gradients or buffers, nor the global random state. Returns linear_norm_methods(model).
    """
    generator = torch.Generator(device=device).manual_seed(seed)
    device = torch.device(device)
    _route_table(device)  # read now: the compiled graph reads no file
    for _, layer in measured_linears(model):
        weight = layer._parameters.get("weight")
        measured = weight is not None and weight.requires_grad and layer._buffers.get("weight_sqgradnorm") is not None
        if layer.per_example_mode != "auto" or layer.norm_method is not None or not measured:
            continue
        layer.norm_method = table_method(tokens, layer.in_features, layer.out_features, dtype, device)
        if layer.norm_method is not None or layer._tie is not None:
            continue
        x3, dy3 = (torch.randn(examples, tokens, width, generator=generator, device=device, dtype=dtype)
                   for width in (layer.in_features, layer.out_features))
        _timed_choice(layer, _norm_ways(x3, dy3, None, layer.max_chunk_numel, dtype if layer.fused else None), device)
    return linear_norm_methods(model)


@torch.no_grad()
def agree_linear_norm_methods(model, group=None):
    """
    Give every rank of `group` its first rank's method for each measured Linear (None where that
    rank has none yet), all layers in one broadcast: each rank times its own layers, and the
    ranks must then measure alike. Call it on every rank at the same point, as the buffers'
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
    maths and chunking, for code that sees x and dy beside torch's own backward (gnshooks.py). It
    keeps no layer to time on: ghost or materialise as PEGradNormShimLinear.per_example_mode
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


# ---------------------------------------------------------------------------------------------
# Embedding

def _embedding_backward_norms(ctx, dy, dq, ds, fused):
    """Shared by both embedding Functions: per-example norms (and the weight gradient if
    fused) from the saved ids and dy, with the tied head's contributions dq, ds if linked."""
    ids, = ctx.saved_tensors
    w_sq, count = ctx.bufs
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
    w_sq.add_(sq)
    count.add_(B)
    if not fused:
        return None
    D = rows.shape[1]
    if ctx.num_embeddings <= ids2.shape[1]:
        dw = rows.view(B, ctx.num_embeddings, D).sum(0)
    else:
        dw = rows.new_zeros(ctx.num_embeddings, D).index_add_(0, row_ids, rows)
    return dw.to(ctx.weight_dtype)


class _EmbeddingFn(torch.autograd.Function):
    """Embedding lookup whose backward builds the weight gradient from per-example rows."""

    @staticmethod
    def forward(ctx, ids, weight, w_sq, count, padding_idx, linked):
        ctx.save_for_backward(ids)
        ctx.bufs = (w_sq, count)
        ctx.num_embeddings, ctx.embedding_dim = weight.shape
        ctx.padding_idx, ctx.weight_dtype = padding_idx, weight.dtype
        ctx.set_materialize_grads(False)
        y = F.embedding(ids, weight, padding_idx)
        if not linked:
            return y
        return (y, *_link_tensors(ids, weight))

    @staticmethod
    def backward(ctx, dy, dq=None, ds=None):
        dw = _embedding_backward_norms(ctx, dy, dq, ds, fused=True)
        return None, dw, None, None, None, None


class _EmbeddingNormTap(torch.autograd.Function):
    """Identity on a torch embedding's output; its backward measures the per-example norms."""

    @staticmethod
    def forward(ctx, y, ids, w_sq, count, num_embeddings, padding_idx, linked):
        ctx.save_for_backward(ids)
        ctx.bufs = (w_sq, count)
        ctx.num_embeddings, ctx.embedding_dim, ctx.padding_idx = num_embeddings, y.shape[-1], padding_idx
        ctx.set_materialize_grads(False)
        if not linked:
            return y.view_as(y)
        return (y.view_as(y), *_link_tensors(ids, y))

    @staticmethod
    def backward(ctx, dy, dq=None, ds=None):
        _embedding_backward_norms(ctx, dy, dq, ds, fused=False)
        return dy, None, None, None, None, None, None


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
        if self.max_norm is not None:
            with torch.no_grad():
                torch.embedding_renorm_(self.weight, ids, self.max_norm, self.norm_type)
        measure = (torch.is_grad_enabled() and self.weight.requires_grad
                   and "weight_sqgradnorm" in self._buffers)
        return measure, measure and self._tie is not None

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
        out = _EmbeddingFn.apply(ids, self.weight, self.weight_sqgradnorm, self.example_count,
                                 self.padding_idx, linked)
        return self._hand_link(ids, out, linked)


class PEGradNormShimEmbedding(_MeasuredEmbedding):
    """nn.Embedding with torch's own backward (bit-identical .grad), norms measured beside it."""

    def forward(self, ids):
        ids = self._batch_ids(ids)
        measure, linked = self._prepare(ids)
        y = F.embedding(ids, self.weight, self.padding_idx)
        if not measure:
            return y
        out = _EmbeddingNormTap.apply(y, ids, self.weight_sqgradnorm, self.example_count,
                                      self.num_embeddings, self.padding_idx, linked)
        return self._hand_link(ids, out, linked)


# ---------------------------------------------------------------------------------------------
# The normalisations under torch.compile: their per-example sums leave the backward as values

class _MeasuredNorm(MeasuredLayer):
    """
    What the measured normalisations share. Under torch.compile their backward writes nothing: it
    returns the per-example sums as the gradient of the layer's sink, a float32 leaf vector laid
    out as sink_layout() (normgnorm.torch_path.SINK_SLOTS, then any per-coordinate buffers), and
    autograd accumulates that gradient like any other. A hook run as it lands adds it to the
    buffers and clears it, so the buffers stay what the estimators read, over any number of
    micro-steps. (A buffer written inside a compiled backward costs copies, rules out CUDA graphs
    and has open correctness bugs in torch.) In eager mode the backward adds to the buffers
    itself, and the sink is not used.
    The sink is neither a parameter nor a buffer (nothing optimises, saves, broadcasts or
    all-reduces it). It lives where the weight does, made anew wherever the weight is moved or
    assigned (measure() builds its layers on the meta device and then hands them their Parameters),
    a buffer is registered, or the layer is copied or unpickled.
    """

    def sink_layout(self):
        """(buffer name, size) of each part of the sink, in order; a part whose buffer the layer has not
        (the bias's, without a bias) holds 0 and goes nowhere."""
        coords = [(f"{name}_sqgrad_coords", self._buffers[f"{name}_sqgrad_coords"].numel())
                  for name in ("weight", "bias") if self._buffers.get(f"{name}_sqgrad_coords") is not None]
        return [(name, 1) for name in normgnorm.torch_path.SINK_SLOTS] + coords

    def _new_sink(self):
        """A fresh sink, with its hook, where the weight is; None while there is no weight, or no
        buffers yet, or the weight is on the meta device."""
        weight = self._parameters.get("weight")
        if weight is None or weight.device.type == "meta" or "example_count" not in self._buffers:
            self._sink = None
            return
        self._sink_parts = self.sink_layout()  # read once: the hook runs at every backward
        sink = torch.zeros(sum(size for _, size in self._sink_parts), dtype=torch.float32, device=weight.device,
                           requires_grad=True)
        sink.register_post_accumulate_grad_hook(self._add_sink_grad)
        self._sink = sink

    def _add_sink_grad(self, sink):
        """The hook: what the backward passes handed the sink, added to the buffers."""
        grad, sink.grad = sink.grad, None
        bufs, parts = [], []
        for (name, _), part in zip(self._sink_parts, grad.split([size for _, size in self._sink_parts])):
            buf = self._buffers.get(name)
            if buf is not None:
                bufs.append(buf)
                parts.append(part.view(buf.shape))
        with torch.no_grad():
            torch._foreach_add_(bufs, parts)

    def _measures(self):
        """Whether a call now measures: grad is on, and a parameter of the layer's own trains."""
        return torch.is_grad_enabled() and any(p is not None and p.requires_grad for p in self._parameters.values())

    def _compiled_sink(self):
        """The sink while compiling a call that measures; None in eager mode, where the backward adds
        to the buffers itself."""
        return self.__dict__.get("_sink") if torch.compiler.is_compiling() and self._measures() else None

    def register_parameter(self, name, param):
        super().register_parameter(name, param)
        if name == "weight" and "example_count" in self._buffers:
            self._new_sink()

    def register_buffer(self, name, tensor, persistent=True):
        super().register_buffer(name, tensor, persistent)
        self._new_sink()

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self._new_sink()
        return self

    def __setstate__(self, state):
        super().__setstate__(state)
        self._new_sink()


# ---------------------------------------------------------------------------------------------
# LayerNorm

class _LayerNormFn(torch.autograd.Function):
    """
    torch's layer_norm, whose backward also measures the affine part's per-example gradients
    dgamma_b = sum_t dy * xhat and dbeta_b = sum_t dy (float32). Forward and backward are torch's
    native kernels, so output and every gradient are torch's own; besides x (which torch saves
    too) only the row statistics mean, rstd ([B, T, 1]) are kept for backward. Given a sink (under
    torch.compile), the sums are its gradient (_MeasuredNorm) and the buffers are not touched.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, w_sq, b_sq, count, normalized_shape, eps, coords=(None, None), sink=None):
        # native_layer_norm has no autocast rule of its own: apply layer_norm's here. GPU
        # autocast runs layer_norm in float32; CPU autocast leaves it in the input's dtype.
        ctx.cast = x.device.type != "cpu" and torch.is_autocast_enabled(x.device.type)
        xc, wc, bc = _float32_unless_double(x, weight, bias) if ctx.cast else (x, weight, bias)
        y, mean, rstd = torch.native_layer_norm(xc, normalized_shape, wc, bc, eps)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.bufs = (w_sq, b_sq, count)
        ctx.coords = coords  # per-coordinate sums (register_coordinate_buffers), or None
        ctx.normalized_shape = normalized_shape
        ctx.sink = sink is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        w_sq, b_sq, count = ctx.bufs
        shape = ctx.normalized_shape
        xc, wc, bc = _float32_unless_double(x, weight, bias) if ctx.cast else (x, weight, bias)
        need_dw, need_db = ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]
        # dx, dgamma, dbeta: torch's own kernel, as nn.LayerNorm's backward (bit-identical .grad)
        dx, dw, db = torch.ops.aten.native_layer_norm_backward(dy, xc, shape, mean, rstd, wc, bc,
                                                               [ctx.needs_input_grad[0], need_dw, need_db])
        dx = dx.to(x.dtype) if dx is not None else None
        dw = dw.to(weight.dtype) if need_dw else None
        db = db.to(bias.dtype) if need_db else None
        B, N = _examples(x, len(shape)), weight.numel()
        if ctx.sink:  # the sums as values, in ops the compiler fuses with torch's backward
            sink_grad = normgnorm.torch_path.per_example_sums(
                dy.reshape(B, -1, N), xc.reshape(B, -1, N), mean.reshape(B, -1, 1), rstd.reshape(B, -1, 1),
                w_sq is not None, b_sq is not None, tuple(c is not None for c in ctx.coords))
            return dx, dw, db, None, None, None, None, None, None, sink_grad
        # the per-example dγ_b, dβ_b and their squared norms (on CPU in one native pass over x and dy)
        dw_b, db_b = normgnorm.cpu_ext.per_example_grads(dy.reshape(B, -1, N), xc.reshape(B, -1, N), mean.reshape(B, -1, 1),
                                                         rstd.reshape(B, -1, 1), need_dw, need_db, w_sq, b_sq)
        for grads_b, coords in ((dw_b, ctx.coords[0]), (db_b, ctx.coords[1])):
            if grads_b is not None and coords is not None:
                coords.add_(grads_b.square().sum(0))
        count.add_(B)
        return dx, dw, db, None, None, None, None, None, None, None


def _float32_unless_double(*tensors):
    """Autocast's float32 policy: floating tensors below float32 are cast up, float64 stays."""
    return tuple(t.float() if t is not None and t.dtype in (torch.float16, torch.bfloat16) else t for t in tensors)


# torch's nn.LayerNorm parameters in order, with their defaults
LAYERNORM_DEFAULTS = dict(normalized_shape=None, eps=1e-5, elementwise_affine=True, bias=True, device=None, dtype=None)


def layernorm_arguments(name, args, kwargs):
    """
    The arguments of a LayerNorm call as a dict of nn.LayerNorm's parameters, from either torch's
    order (normalized_shape, eps=1e-5, elementwise_affine=True, bias=True, device=None, dtype=None)
    or nanoGPT's and the reference implementation's LayerNorm(ndim, bias): a bool second positional
    argument is bias (torch would take it for eps = 1.0 or 0.0).
    """
    order = list(LAYERNORM_DEFAULTS)
    if len(args) >= 2 and isinstance(args[1], bool):
        order = ["normalized_shape", "bias"]
    if len(args) > len(order):
        raise TypeError(f"{name} takes at most {len(order)} positional arguments ({', '.join(order)}), "
                        f"got {len(args)}: {args!r}")
    given = dict(zip(order, args))
    for key, value in kwargs.items():
        if key not in LAYERNORM_DEFAULTS:
            raise TypeError(f"{name} got an unexpected keyword argument {key!r}; "
                            f"it takes {', '.join(LAYERNORM_DEFAULTS)}")
        if key in given:
            raise TypeError(f"{name} got {key} twice: {given[key]!r} by position and {value!r} by keyword")
        given[key] = value
    if "normalized_shape" not in given:
        raise TypeError(f"{name} needs normalized_shape (the feature size ndim)")
    if isinstance(given.get("eps"), bool):
        raise TypeError(f"{name} got eps={given['eps']!r}: eps is a float; for bias write bias={given['eps']!r}")
    return {**LAYERNORM_DEFAULTS, **given}


class LayerNorm(nn.LayerNorm):
    """
    nn.LayerNorm that also takes nanoGPT's and the reference implementation's LayerNorm(ndim, bias)
    (a plain LayerNorm with an optional bias, eps 1e-5), as well as torch's own arguments.
    The measured LayerNorms (below) build on it.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(**layernorm_arguments(type(self).__name__, args, kwargs))


class PEGradNormSeparatedLayerNorm(_MeasuredNorm, LayerNorm):
    """
    nn.LayerNorm whose affine part y = gamma * xhat + beta is measured separately from the
    normalisation xhat: backward adds the per-example squared norms of dgamma_b = sum_t dy * xhat
    and dbeta_b = sum_t dy (the cheap ones: Gray et al. 2024 find these alone predict the whole
    model's gradient noise scale). Forward and every gradient are torch's own (bit-identical);
    xhat is recomputed in backward rather than saved, so memory is as nn.LayerNorm's.
    Same parameters and state_dict keys as nn.LayerNorm, bias=False included. Takes torch's
    arguments or the reference's (ndim, bias), as LayerNorm above.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        register_sqgradnorm_buffers(self)

    def forward(self, x):
        self._check_call(_examples(x, len(self.normalized_shape)))
        w_trains = self.weight is not None and self.weight.requires_grad
        b_trains = self.bias is not None and self.bias.requires_grad
        if not torch.is_grad_enabled() or not (w_trains or b_trains):
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return _LayerNormFn.apply(x, self.weight, self.bias,
                                  self.weight_sqgradnorm if w_trains else None,
                                  self.bias_sqgradnorm if b_trains else None,
                                  self.example_count, self.normalized_shape, self.eps,
                                  (self._buffers.get("weight_sqgrad_coords"), self._buffers.get("bias_sqgrad_coords")),
                                  self._compiled_sink())

    # The reference implementation's names: its separated LayerNorm held the gain and bias in a
    # submodule .affine (after a .layernorm without them); here they are the layer's own.
    affine = property(lambda self: self, doc="The layer itself: its weight and bias are the affine part's.")
    layernorm = refused("PEGradNormSeparatedLayerNorm.layernorm", "the layer normalises and applies its "
                        "weight and bias in one call; for the normalisation alone use "
                        "F.layer_norm(x, ln.normalized_shape, None, None, ln.eps)")


# ---------------------------------------------------------------------------------------------
# RMSNorm

class _RMSNormTap(torch.autograd.Function):
    """
    Identity on the output of torch's rms_norm; its backward adds sum_b ||dgamma_b||^2 with
    dgamma_b = sum_t dy * xhat (LayerNorm's rule without centring) and hands dy on untouched. xhat = x * rstd is
    recomputed from the input in float32 (float64 for float64), as torch computes it: CUDA
    autocast runs rms_norm in float32, and a float32 copy of a half-precision x is exact. Given a
    sink (under torch.compile), the sums are its gradient (_MeasuredNorm), the buffers untouched.
    """

    @staticmethod
    def forward(ctx, y, x, w_sq, count, normalized_shape, eps, coords=None, sink=None):
        ctx.save_for_backward(x)
        ctx.bufs = (w_sq, count)
        ctx.coords = coords  # per-coordinate sums (register_coordinate_buffers), or None
        ctx.normalized_shape, ctx.eps = normalized_shape, eps
        ctx.sink = sink is not None
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy):
        x, = ctx.saved_tensors
        w_sq, count = ctx.bufs
        B, N = _examples(x, len(ctx.normalized_shape)), math.prod(ctx.normalized_shape)
        x3 = x.reshape(B, -1, N)
        acc = torch.promote_types(x.dtype, torch.float32)
        mean_square = torch.linalg.vector_norm(x3, dim=-1, keepdim=True, dtype=acc).square_().div_(N)
        rstd = mean_square.add_(rms_norm_eps(ctx.eps, x.dtype)).rsqrt_()
        if ctx.sink:  # the sums as values, in ops the compiler fuses with torch's backward
            sink_grad = normgnorm.torch_path.per_example_sums(dy.reshape(B, -1, N), x3, None, rstd, True, False,
                                                              (ctx.coords is not None, False))
            return dy, None, None, None, None, None, None, sink_grad
        dw_b, _ = normgnorm.cpu_ext.per_example_grads(dy.reshape(B, -1, N), x3, None, rstd, True, False, w_sq, None)
        if ctx.coords is not None:
            ctx.coords.add_(dw_b.square().sum(0))
        count.add_(B)
        return dy, None, None, None, None, None, None, None


class PEGradNormSeparatedRMSNorm(_MeasuredNorm, nn.RMSNorm):
    """
    nn.RMSNorm (the same arguments, parameter and state_dict keys; eps None is torch's machine
    epsilon) whose backward also adds the per-example squared norms of its gain's gradient,
    dgamma_b = sum_t dy * xhat: LayerNorm's rule without the centring. Output and every gradient
    are torch's own rms_norm's (bit-identical); the norms are measured beside it from dy and the
    input, which torch saves too, at the cost of one more read of x in backward.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        register_sqgradnorm_buffers(self)

    def forward(self, x):
        self._check_call(_examples(x, len(self.normalized_shape)))
        y = F.rms_norm(x, self.normalized_shape, self.weight, self.eps)
        weight = self._parameters.get("weight")  # None without affine, or parametrized: not measured
        if not torch.is_grad_enabled() or weight is None or not weight.requires_grad:
            return y
        return _RMSNormTap.apply(y, x.detach(), self.weight_sqgradnorm, self.example_count,
                                 self.normalized_shape, self.eps, self._buffers.get("weight_sqgrad_coords"),
                                 self._compiled_sink())


# ---------------------------------------------------------------------------------------------
# The fused normalisations (--lnclass=fused): the normgnorm kernel (Triton or CUDA on GPU, PyTorch
# elsewhere) computes y and, in its backward, dx, dgamma, dbeta and the per-example norms together.
# fused_gns.py, the reference implementation's home for them, imports them from here.

class _FusedNorm(_MeasuredNorm):
    """
    What the fused normalisations share: the torch class's arguments and `backend`, the eager
    implementation (None: Triton on CUDA, the CPU kernel on CPU; normgnorm.resolve_backend). Under
    torch.compile every backend runs the one compiled route, the PyTorch path fused with the model.
    The kernel normalises over the last dimension only; elementwise_affine=False leaves nothing to
    measure and runs torch's own.
    """
    separated = None  # buffered.py's class for what the kernel does not take

    def __init__(self, *args, backend=None, **kwargs):
        super().__init__(*args, **kwargs)
        if len(self.normalized_shape) != 1:
            raise ValueError(f"{type(self).__name__} normalises over the last dimension only, not "
                             f"{self.normalized_shape}; use buffered.{self.separated}")
        self.backend = backend
        register_sqgradnorm_buffers(self)


class PEGradNormFusedLayerNorm(_FusedNorm, LayerNorm):
    """Takes torch's nn.LayerNorm arguments or the reference's (ndim, bias) (see buffered.LayerNorm)."""
    separated = "PEGradNormSeparatedLayerNorm"

    def forward(self, x):
        self._check_call(_examples(x, len(self.normalized_shape)))
        if torch.compiler.is_compiling() and not self._measures():  # nothing to measure: torch's own
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        params, bufs = self._parameters, self._buffers  # dict reads: a module attribute is two __getattr__
        weight = params.get("weight")
        if weight is not None and "bias" in params and x.shape[-1:] == weight.shape:
            # own parameters: the Function itself, without layer_norm()'s checks of buffers that this
            # layer registered (eager and compiled: the one path)
            return normgnorm._NormFn.apply(x, weight, params["bias"], bufs["weight_sqgradnorm"],
                                           bufs.get("bias_sqgradnorm"), bufs["example_count"], self._compiled_sink(),
                                           self.eps, self.backend or "", False)
        if self.weight is None:
            return F.layer_norm(x, self.normalized_shape, None, None, self.eps)
        return normgnorm.layer_norm(x, self.weight, self.bias,
                                    self.weight_sqgradnorm, self._buffers.get("bias_sqgradnorm"),
                                    self.example_count, self.eps, self.backend)


class PEGradNormFusedRMSNorm(_FusedNorm, nn.RMSNorm):
    """Takes torch's nn.RMSNorm arguments; eps None is torch's default (machine epsilon of the
    computation type). Measures Σ_b ||dγ_b||² of its gain, dγ_b = Σ_t dy_bt ⊙ x̂_bt."""
    separated = "PEGradNormSeparatedRMSNorm"

    def forward(self, x):
        self._check_call(_examples(x, len(self.normalized_shape)))
        if torch.compiler.is_compiling() and not self._measures():  # nothing to measure: torch's own
            return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)
        weight = self._parameters.get("weight")
        if weight is not None and x.dim() and x.shape[-1:] == weight.shape:
            # own gain: the Function itself, without rms_norm()'s checks of this layer's own buffers
            bufs = self._buffers
            return normgnorm._NormFn.apply(x, weight, None, bufs["weight_sqgradnorm"], None, bufs["example_count"],
                                           self._compiled_sink(), rms_norm_eps(self.eps, x.dtype), self.backend or "",
                                           True)
        if self.weight is None:
            return F.rms_norm(x, self.normalized_shape, None, self.eps)
        return normgnorm.rms_norm(x, self.weight, self.weight_sqgradnorm, self.example_count, self.eps,
                                  self.backend)


# ---------------------------------------------------------------------------------------------
# The registry, and measure(): per-example norms put into any model

# For each kind of layer and each flag value, the measured class: the one table that
# layer_config's flags (so train.py's --linearclass / --embeddingclass / --lnclass), measure()
# and the analysis's layer groups come from. A new measured layer type is its class plus one
# entry here.
MEASURED_CLASSES = {
    "linear": {"gns": PEGradNormLinear, "shim": PEGradNormShimLinear},
    "embedding": {"gns": PEGradNormEmbedding, "shim": PEGradNormShimEmbedding},
    "layernorm": {"shim": PEGradNormSeparatedLayerNorm, "fused": PEGradNormFusedLayerNorm},
    "rmsnorm": {"shim": PEGradNormSeparatedRMSNorm, "fused": PEGradNormFusedRMSNorm},
}
# The classes measure() converts, each to the measured class of its kind: torch's, ours, and
# foreign ones named by their module path, so that their package is never imported here (a model
# holding one has imported it). Exact classes only: a subclass may compute something else, so it
# is named with kinds= or left unmeasured (the coverage warning lists it).
SOURCE_KINDS = {
    nn.Linear: "linear", nn.Embedding: "embedding", nn.LayerNorm: "layernorm", LayerNorm: "layernorm",
    nn.RMSNorm: "rmsnorm",
    # Hugging Face's GPT-2 layers: y = x W + b, a Linear whose weight is stored [in, out]
    "transformers.pytorch_utils.Conv1D": "linear",
    # Hugging Face's Llama-family RMSNorm (gain `weight`, eps `variance_epsilon`): the same maths as
    # nn.RMSNorm, the normalisation in float32 (Gemma's (1 + weight) is another class, not listed)
    **{f"transformers.models.{m}.modeling_{m}.{c}RMSNorm": "rmsnorm" for m, c in [
        ("llama", "Llama"), ("mistral", "Mistral"), ("mixtral", "Mixtral"), ("qwen2", "Qwen2"),
        ("qwen2_moe", "Qwen2Moe"), ("qwen3", "Qwen3"), ("qwen3_moe", "Qwen3Moe"), ("phi3", "Phi3"),
        ("granite", "Granite"), ("smollm3", "SmolLM3"), ("deepseek_v3", "DeepseekV3")]},
}
TRANSPOSED_WEIGHT = {"transformers.pytorch_utils.Conv1D"}  # weight [in, out]
# The mixture-of-experts blocks of SOURCE_KINDS' families. Their router and experts work on tokens,
# not examples: the routed experts on the rows the router gathered from the whole batch (an expert
# may get exactly B of them by chance), the shared expert and its gate (Qwen2/3-MoE) on the
# flattened [B*T, D] batch. So every layer inside one is left out. By the same rule, a module
# whose name in its parent holds "expert" (an `experts` ModuleList, a `shared_expert`) is left out
# in any model, and kinds={Block: None} leaves out a block measure() does not know.
TOKEN_BLOCKS = {
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
    "transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE",
}


def _class_path(cls):
    return f"{cls.__module__}.{cls.__qualname__}"


def source_kind(cls, kinds=None):
    """The kind measure() converts a module of class `cls` as, or None: kinds= first, then SOURCE_KINDS."""
    if kinds and cls in kinds:
        return kinds[cls]
    return SOURCE_KINDS.get(cls) or SOURCE_KINDS.get(_class_path(cls))


def _token_rows(name, module, kinds):
    """Why the layers in `module` (called `name` in the model) see tokens rather than examples, by
    what it is (kinds={Class: None}, TOKEN_BLOCKS, an expert's name), or None."""
    cls = type(module)
    if kinds and kinds.get(cls, "") is None:
        return f"in {name} ({cls.__name__}), left out by kinds={{{cls.__name__}: None}}"
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
    the analysis groups them by (gnsmath.KINDS_NAME in out_dir)."""
    kinds = {}
    for module in model.modules():
        kind = kind_of_measured(type(module))
        for p in module.parameters(recurse=False):
            if kind is not None:
                kinds.setdefault(id(p), kind)
    return {name: kinds[id(p)] for name, p, _, _ in find_sqgradnorm_buffers(model) if id(p) in kinds}


def _measured_class(kind, value):
    """MEASURED_CLASSES[kind][value], or None."""
    return MEASURED_CLASSES[kind].get(value)


def _build_like(module, kind, cls, weight, bias):
    """An empty `cls` (on the meta device) shaped and configured like `module`; None where it cannot be."""
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
    if kind == "layernorm":  # nanoGPT's LayerNorm(ndim, bias) has no eps attribute: its 1e-5
        return cls(shape, eps=getattr(module, "eps", 1e-5), bias=bias is not None, device="meta")
    # rmsnorm: torch's eps, or Hugging Face's variance_epsilon; None is torch's default
    return cls(shape, eps=getattr(module, "eps", getattr(module, "variance_epsilon", None)), device="meta")


def _convert(module, kind, cls):
    """A `cls` doing what `module` (of kind `kind`) does with the very same Parameter objects; None
    where the module cannot be measured as it is (said in the returned reason)."""
    weight, bias = module._parameters.get("weight"), module._parameters.get("bias")
    if weight is None or is_parametrized(module):
        return None, "no weight of its own (none, or parametrized)"
    try:
        new = _build_like(module, kind, cls, weight, bias)
    except ValueError as e:  # e.g. the fused kernels normalise over the last dimension only
        return None, str(e)
    if new is None:
        return None, "sparse or scale_grad_by_freq gradients"
    for name in ("weight", "bias"):
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
        if name not in ("weight", "bias"):
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


def _forget_batch(model, args, kwargs, output):
    state = model._gns_forward_state
    state["B"] = state["T"] = state["forward"] = None


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

    A layer must see examples, not tokens. Left out by what it is: every layer inside a
    mixture-of-experts block (TOKEN_BLOCKS: Mixtral's, Qwen2/3-MoE's, DeepSeek-V3's), inside a
    module whose name holds "expert" (an `experts` ModuleList, a `shared_expert`), or inside a
    class named with kinds={Block: None}: their rows are routed or flattened tokens, and a routed
    expert may get exactly B rows. A pre-hook on `model` learns B and T from its input (its first
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
        if not isinstance(cls, type) or (kind is not None and kind not in KIND_NAMES):
            raise ValueError(f"measure: kinds maps classes to one of {', '.join(map(repr, KIND_NAMES))} or None, "
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
    value_of = {"linear": linear, "embedding": embedding, "layernorm": norm, "rmsnorm": norm}

    # swap each module for its measured class; one held under two names is left as it is (it
    # would be applied twice, and its per-example norm needs the cross terms between the uses)
    held = {}
    for module in model.modules(remove_duplicate=False):
        held[id(module)] = held.get(id(module), 0) + 1
    # what sees tokens by what it is (an MoE block's router and experts): left out, whatever its rows
    refused = {}
    for name, module in model.named_modules():
        why = None if id(module) in refused else _token_rows(name, module, kinds)
        if why:
            for inner in module.modules():
                refused.setdefault(id(inner), why)
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

    # the forward state the measured layers read: B and T of the model's input, a forward count
    state = getattr(model, "_gns_forward_state", None)
    if state is None:
        state = model._gns_forward_state = {"B": None, "T": None, "forward": None, "count": 0, "batch_dim": batch_dim}
        model.register_forward_pre_hook(_learn_batch, with_kwargs=True)
        model.register_forward_hook(_forget_batch, with_kwargs=True, always_call=True)
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
    return model


# ---------------------------------------------------------------------------------------------
# The reference implementation's names (CerebrasResearch/nanoGNS, exact/buffered.py). Kept with
# the same meaning: the five layer classes with its constructor arguments, LayerNorm(ndim, bias),
# zero_sqgradnorm_buffers(model), and on the layers weight_pegsqnorm() / bias_pegsqnorm() and the
# separated LayerNorm's .affine (all above). The rest fails at once, saying what to use instead.

_SHIM_LINEAR = "use PEGradNormShimLinear, whose backward adds the norms to weight_sqgradnorm / bias_sqgradnorm"
_FUSED_LINEAR = "use PEGradNormLinear, whose backward computes the weight gradient and the norms together"
_SHIM_EMBEDDING = "use PEGradNormShimEmbedding, whose backward adds the norms to weight_sqgradnorm"
_FUSED_EMBEDDING = "use PEGradNormEmbedding, whose backward builds the weight gradient and the norms together"
_SEPARATED = ("use PEGradNormSeparatedLayerNorm(ndim, bias): its own weight and bias are the affine part "
              "(.affine is the layer itself), measured into weight_sqgradnorm / bias_sqgradnorm")
_SELF_TEST = "use pytest tests/test_buffered.py, this fork's tests of the same layers"

__getattr__ = refuse_module_names(__name__, {
    "exists": "write `x is not None`",
    "safe_sum": "use x.sum(dim, keepdim, dtype=torch.float32).to(x.dtype)",
    "safe_sqnorm": "use x.float().square().sum(dim, keepdim).to(x.dtype)",
    "stack_with_ones": "use torch.stack([x, torch.ones_like(x)], dim); this fork keeps the running sum and "
                       "the example count in two buffers, {name}_sqgradnorm and example_count",
    "ModuleWithBuffers": "use buffered.MeasuredLayer, the measured layers' shared base; "
                         "register_sqgradnorm_buffers(module) gives a module the buffers, "
                         "find_sqgradnorm_buffers(model) finds them",
    "pe_linear_grad_norm": _SHIM_LINEAR,
    "PEGLinearGradNormNoop": _SHIM_LINEAR,
    "wgrad_plus_pe_grad_norm_highmem": _FUSED_LINEAR + " (per_example_mode='materialise' forms W_b)",
    "at_index": "write `x[i] if i < len(x) else False`",
    "PEGradNormLinearFunction": _FUSED_LINEAR,
    "embedding_dense_backward": "use torch.ops.aten.embedding_dense_backward for the summed gradient; for "
                                "per-example norms " + _FUSED_EMBEDDING,
    "embedding_pe_grad_norm": _SHIM_EMBEDDING,
    "PEGEmbeddingGradNormNoop": _SHIM_EMBEDDING,
    "embedding_peg_plus_grads": _FUSED_EMBEDDING,
    "PEGEmbeddingGradNorm": _FUSED_EMBEDDING,
    "ElementWiseAffine": _SEPARATED,
    "PEGradNormEANoop": _SEPARATED,
    "PEGradNormShimElementWiseAffine": _SEPARATED,
    "ShimLinearTest": _SELF_TEST,
    "ShimEmbeddingTest": _SELF_TEST,
    "LNShimTest": _SELF_TEST,
})
