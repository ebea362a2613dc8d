"""
A Linear's weight gradient and each example's squared norm of it, in one Triton GEMM that never
writes the per-example gradients.

For an input x [B, T, K] and the output gradient dy [B, T, L] (nanogns.layers.linear's materialised route; the
materialised per-example gradient of Goodfellow 2015, "Efficient Per-Example Gradient
Computations", and Rochette et al. 2019, "Efficient Per-Example Gradient Computations in
Convolutional Neural Networks"):

    W_b = dy_b^T x_b  [L, K],    dW = sum_b W_b,    sq_b = ||W_b||^2

torch.bmm would write every W_b ([B, L, K]) and read it back to square and sum it. Here each
program owns one BLOCK_L x BLOCK_K tile of [L, K] and walks the examples: it accumulates the
tile of W_b over example b's tokens in float32 with tl.dot (tensor cores on a GPU), adds the
tile's sum of squares to example b's norm, adds the tile to its running sum of dW, and after the
last example stores that sum once. W_b only ever lives in registers. (The idea is FlashDP's.)

Sums have a fixed order, so two runs agree to the bit (no atomics, whose float32 adds would land
in whatever order the programs finish):
- norms: each program writes its tile's sum of squares for each of its examples into a float32
  [n_tiles, B] buffer, each entry written once; one sum over tiles then gives [B];
- dW: a program stores its tile once. Where the tiles alone are too few to fill the GPU, the
  examples are split into n_splits runs on a third grid axis, each writing its own float32
  [L, K] partial, summed afterwards. That is the split of the weight GEMM's reduction over the
  B*T tokens, made at examples' boundaries: ||W_b||^2 needs W_b whole, so a split inside an
  example would have to write its partial W_b out, which is what the cuBLAS route does anyway.

per_example_weight_grad(x, dy, need_dw, **config) is the entry point: the kernel on CUDA tensors (float32,
bfloat16, float16), the registered op `linear_gns::per_example_weight_grad` under torch.compile
(a torch.library.triton_op, so the compiler sees the kernel: one node, no graph break, no
mutated input), and reference() elsewhere. Under TRITON_INTERPRET=1 the kernel also runs on CPU
tensors (slowly), which is how the tests check it without a GPU.
"""
import os
import re

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from ..normgnorm.triton_kernels import _on_device

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# The GPU's defaults, for half-precision and for float32 inputs, where no tiling is given (a measured
# Linear takes the tiling its card's routes table names: nanogns.layers.linear.materialised_route;
# bench/gpu_check.py's linear step times the candidates, config_of() reads their labels). A program holds
# two float32 accumulators of its tile (W_b's and dW's): 128 x 128 over 8 warps fits the
# registers with half-precision tiles, one program per multiprocessor; with float32 tiles it
# spills on sm_80, and 64 x 64 over 4 warps does not (tests/test_linear_kernel.py compiles
# both for sm_80 and sm_90 and fails on a spill). programs_per_sm: programs the device runs at
# once, per multiprocessor, for deciding whether to split the examples.
TUNING = {
    "half": dict(block_l=128, block_k=128, block_t=32, num_warps=8, num_stages=3, programs_per_sm=1),
    "float32": dict(block_l=64, block_k=64, block_t=32, num_warps=4, num_stages=3, programs_per_sm=3),
}


@triton.jit
def _weight_grad_kernel(X, DY, DW, SQ, B, T, K, L,
                        stride_xb, stride_xt, stride_xk, stride_db, stride_dt, stride_dl,
                        examples_per_split,
                        NEED_DW: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_K: tl.constexpr,
                        BLOCK_T: tl.constexpr, TF32: tl.constexpr, DOT_F32: tl.constexpr):
    # program (l tile, k tile, split): W_b over this tile for the split's examples
    tile_l = tl.program_id(0)
    tile_k = tl.program_id(1)
    split = tl.program_id(2)
    tile = tile_l * tl.num_programs(1) + tile_k
    ls = tile_l * BLOCK_L + tl.arange(0, BLOCK_L)
    ks = tile_k * BLOCK_K + tl.arange(0, BLOCK_K)
    l_ok = ls < L
    k_ok = ks < K
    ts = tl.arange(0, BLOCK_T)
    first = split * examples_per_split
    end = tl.minimum(first + examples_per_split, B)
    # offsets in int64: B*T*K may pass 2^31, and so may one token's or feature's (a transposed
    # view's stride is B*T); 32-bit products would wrap (tl.cast: a stride of 1 comes as a constant)
    stride_xb = tl.cast(stride_xb, tl.int64)
    stride_xt = tl.cast(stride_xt, tl.int64)
    stride_xk = tl.cast(stride_xk, tl.int64)
    stride_db = tl.cast(stride_db, tl.int64)
    stride_dt = tl.cast(stride_dt, tl.int64)
    stride_dl = tl.cast(stride_dl, tl.int64)
    total = tl.zeros([BLOCK_L, BLOCK_K], dtype=tl.float32)
    for b in range(first, end):
        x_b = X + b * stride_xb
        dy_b = DY + b * stride_db
        w_b = tl.zeros([BLOCK_L, BLOCK_K], dtype=tl.float32)
        for t0 in range(0, T, BLOCK_T):
            t = t0 + ts
            t_ok = t < T
            # dy_b^T read as [BLOCK_L, BLOCK_T] straight from dy's strides; masked entries are 0
            dy_t = tl.load(dy_b + ls[:, None] * stride_dl + t[None, :] * stride_dt,
                           mask=l_ok[:, None] & t_ok[None, :], other=0.0)
            x_t = tl.load(x_b + t[:, None] * stride_xt + ks[None, :] * stride_xk,
                          mask=t_ok[:, None] & k_ok[None, :], other=0.0)
            if DOT_F32:  # the same products: a bfloat16 product is exact in float32
                dy_t = dy_t.to(tl.float32)
                x_t = x_t.to(tl.float32)
            if TF32:
                w_b = tl.dot(dy_t, x_t, w_b, input_precision="tf32")
            else:
                w_b = tl.dot(dy_t, x_t, w_b, input_precision="ieee")
        tl.store(SQ + tile * B + b, tl.sum(tl.sum(w_b * w_b, axis=1), axis=0))
        if NEED_DW:
            total += w_b
    if NEED_DW:
        out = DW + split.to(tl.int64) * L * K + ls.to(tl.int64)[:, None] * K + ks[None, :]
        tl.store(out, total, mask=l_ok[:, None] & k_ok[None, :])


def _tf32(dtype):
    """Whether tl.dot takes float32 tiles as TF32: where torch's own matmuls do
    (torch.backends.cuda.matmul.allow_tf32, which train.py sets), so that the kernel computes the
    GEMM torch would; otherwise in full float32. Half-precision tiles ignore it."""
    return dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32


def _interpreted_bfloat16(x):
    """Whether the tiles go to tl.dot as float32: bfloat16 under the CPU interpreter, whose dot
    (Triton 3.9) multiplies bfloat16's raw bits as integers. A GPU takes bfloat16 tiles as they are."""
    return x.dtype == torch.bfloat16 and not x.is_cuda and os.environ.get("TRITON_INTERPRET") == "1"


_sm_counts = {}


def _multiprocessors(device):
    """The device's multiprocessors; 1 off GPU (the CPU interpreter: few programs are quickest)."""
    if device.type != "cuda":
        return 1
    if device not in _sm_counts:
        _sm_counts[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _sm_counts[device]


_plans = {}
CONFIG_NAMES = ("block_l", "block_k", "block_t", "num_warps", "num_stages", "n_splits")


def plan(B, K, L, dtype, device, **config):
    """(grid, examples_per_split, meta) for B examples and a [L, K] weight: TUNING's tiles for the
    dtype unless config (CONFIG_NAMES) gives them, and the examples split into n_splits runs only
    where the tiles are fewer than the programs the device runs at once (n_splits given: that
    many, at most B)."""
    if config and not config.keys() <= set(CONFIG_NAMES):
        raise TypeError(f"unknown kernel configuration {sorted(config.keys() - set(CONFIG_NAMES))}; "
                        f"choose from {CONFIG_NAMES}")
    key = (B, K, L, dtype, device, *(config.get(name) for name in CONFIG_NAMES))
    found = _plans.get(key)
    if found is not None:
        return found
    tuning = TUNING["float32" if dtype == torch.float32 else "half"]
    c = {name: config.get(name) if config.get(name) is not None else tuning.get(name) for name in CONFIG_NAMES}
    tiles_l, tiles_k = -(-L // c["block_l"]), -(-K // c["block_k"])
    n_splits = c["n_splits"]
    if n_splits is None:
        n_splits = tuning["programs_per_sm"] * _multiprocessors(device) // (tiles_l * tiles_k)
    n_splits = max(1, min(B, n_splits))
    per_split = -(-B // n_splits)
    n_splits = -(-B // per_split)  # no empty run
    found = ((tiles_l, tiles_k, n_splits), per_split,
             dict(BLOCK_L=c["block_l"], BLOCK_K=c["block_k"], BLOCK_T=c["block_t"], num_warps=c["num_warps"],
                  num_stages=c["num_stages"]))
    if len(_plans) >= 4096:  # inputs of ever-new shapes: start afresh
        _plans.clear()
    _plans[key] = found
    return found


def _launch(x, dy, need_dw, kernel=None, **config):
    """(dW float32 [L, K], or a 1-element placeholder without need_dw; float32 [B] squared
    norms) by the kernel, launched as `kernel`: the jit function itself when None, else what
    stands for it (wrap_triton's wrapper inside the op). x [B, T, K] and dy [B, T, L] of one
    dtype, any strides; config: plan()'s choices."""
    B, T, K = x.shape
    L = dy.shape[2]
    # traced with dynamic shapes, the plan takes B, K, L as the numbers they are (a guard on each)
    B, K, L = int(B), int(K), int(L)
    grid, per_split, meta = plan(B, K, L, x.dtype, x.device, **config)
    tiles_l, tiles_k, n_splits = grid
    if kernel is None:
        # fused multiply-add said explicitly (Triton 3.9's default, which warns when left unset
        # that 3.10 turns it off); the op's launch leaves it to the compiler
        kernel, meta = _weight_grad_kernel, dict(meta, enable_fp_fusion=True)
    partial_sq = torch.empty((tiles_l * tiles_k, B), dtype=torch.float32, device=x.device)
    # each run of examples its own dW partial; one run writes dW itself (its offset is 0). Without
    # need_dw one element stands in, never written: a tensor of its own, since under
    # torch.compile the kernel's written arguments are told apart by the tensors they are
    dw_shape = ((L, K) if n_splits == 1 else (n_splits, L, K)) if need_dw else (1,)
    partial_dw = torch.empty(dw_shape, dtype=torch.float32, device=x.device)
    # eagerly, on x's device whichever is current (Triton launches on the current one); traced, the
    # compiler's launch guards its own device
    with _on_device(x.get_device() if kernel is _weight_grad_kernel else -1):
        kernel[grid](x, dy, partial_dw, partial_sq, B, T, K, L,
                     x.stride(0), x.stride(1), x.stride(2), dy.stride(0), dy.stride(1), dy.stride(2), per_split,
                     NEED_DW=need_dw, TF32=_tf32(x.dtype), DOT_F32=_interpreted_bfloat16(x), **meta)
    sq = partial_sq.sum(0)
    if not need_dw:
        return partial_dw, sq
    return (partial_dw if n_splits == 1 else partial_dw.sum(0)), sq


@triton_op("linear_gns::per_example_weight_grad", mutates_args=())
def _op(x: Tensor, dy: Tensor, need_dw: bool, block_l: int = 0, block_k: int = 0, block_t: int = 0,
        num_warps: int = 0, num_stages: int = 0, n_splits: int = 0) -> tuple[Tensor, Tensor]:
    # the compiler traces this (the kernel through wrap_triton, the sums as torch ops); called
    # eagerly, triton_op runs it with wrap_triton switched off. A configuration's 0: plan()'s own
    given = dict(block_l=block_l, block_k=block_k, block_t=block_t, num_warps=num_warps, num_stages=num_stages,
                 n_splits=n_splits)
    return _launch(x, dy, need_dw, wrap_triton(_weight_grad_kernel), **{k: v for k, v in given.items() if v})


def config_of(label):
    """plan()'s configuration from a tiling's label, as the sweep and its table name it:
    "128x256 t64 w8 s4" is BLOCK_L 128, BLOCK_K 256, BLOCK_T 64, 8 warps, 4 stages; a trailing
    " split2" runs the examples in 2 runs (without it plan() decides)."""
    found = re.fullmatch(r"(\d+)x(\d+) t(\d+) w(\d+) s(\d+)(?: split(\d+))?", label)
    if found is None:
        raise ValueError(f"kernel tiling {label!r}: write it as 'LxK tT wW sS' with an optional ' splitN', "
                         "e.g. '128x128 t32 w8 s3 split2'")
    return {name: int(value) for name, value in zip(CONFIG_NAMES, found.groups()) if value is not None}


def label_of(config):
    """config_of's label of a configuration that gives every tile size, warps and stages."""
    label = (f"{config['block_l']}x{config['block_k']} t{config['block_t']} w{config['num_warps']} "
             f"s{config['num_stages']}")
    return label + (f" split{config['n_splits']}" if config.get("n_splits") else "")


def reference(x, dy, need_dw=True):
    """What the kernel computes, in torch: every W_b materialised ([B, L, K], at least float32)."""
    acc = torch.promote_types(x.dtype, torch.float32)
    per_example = torch.bmm(dy.mT.to(acc), x.to(acc))
    sq = per_example.square().sum((1, 2)).float()
    return (per_example.sum(0).float() if need_dw else None), sq


def supports(x, dy):
    """Whether the kernel takes x [B, T, K] and dy [B, T, L]: CUDA tensors (or, under
    TRITON_INTERPRET=1, CPU ones) of one dtype in KERNEL_DTYPES, not empty."""
    device_ok = x.is_cuda or (x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")
    return (device_ok and x.dtype in KERNEL_DTYPES and dy.dtype == x.dtype and dy.device == x.device
            and x.numel() > 0 and dy.numel() > 0)


def per_example_weight_grad(x, dy, need_dw=True, **config):
    """
    (dW = sum_b dy_b^T x_b as float32 [L, K], or None without need_dw; float32 [B] of
    ||dy_b^T x_b||^2) for x [B, T, K] and dy [B, T, L]. The kernel where supports() says so, with
    plan()'s configuration `config` (config_of(label) of a tiling the sweep timed; TUNING's where
    none), through its registered op under torch.compile (eagerly, the launch itself: the op's
    dispatch costs host time); reference() otherwise.
    """
    if not supports(x, dy):
        return reference(x, dy, need_dw)
    if torch.compiler.is_compiling():
        dw, sq = _op(x, dy, need_dw, **config)
    else:
        dw, sq = _launch(x, dy, need_dw, **config)
    return (dw if need_dw else None), sq
