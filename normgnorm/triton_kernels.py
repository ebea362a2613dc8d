"""
Triton kernels for LayerNorm with per-example dγ, dβ norms (see normgnorm/__init__.py for the
maths), and for RMSNorm, the same kernels with the constexpr RMS: no mean, no centring, no bias
(no dβ), and dx without the mean's term. float32, float16 and bfloat16 inputs; all arithmetic and
accumulation in float32.

Rows are the flattened leading dims, x2d [N, D] with N = B*T, example b owning rows
b*T .. b*T+T-1. A row that fits one block (D <= MAX_BLOCK_D) is held in registers; wider rows
take the "looped" kernels, which walk the row in BLOCK_D pieces.

Backward, without any [B, T, D] temporary, rows shared out as normgnorm/plan.py says:
1. `_backward_kernel`: each program takes a run of rows, writes dx, and sums dy ⊙ x̂ and dy
   over its rows into one float32 partial row [D]. In "whole" mode a program owns whole
   examples, so it also squares each complete dγ_b, dβ_b itself.
2. "split" mode only, `_reduce_examples_kernel`: sums each example's chunks into dγ_b, dβ_b
   [B, D] and squares them (per column block).
3. `_finish_kernel`: sums the partial rows into the parameter gradients dγ, dβ, and (program 0)
   adds the squared norms to the float32 buffers and B to the example count.
Every sum has a fixed order, so results are deterministic (no atomics).
"""
import os
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from .plan import MAX_TILE, MIN_ROWS_PER_CHUNK, plan_backward

# Wider rows use the looped kernels. A [1, 8192] float32 tile over 16 warps is 16 values a
# thread per live array; the backward holds about six, which still fits the register file.
MAX_BLOCK_D = 8192
LOOPED_BLOCK_D = 4096   # piece of a row the looped kernels hold at once
COLUMN_BLOCK = 64       # columns per program in the reduction kernels
# Fused multiply-add, said explicitly: left unset, Triton 3.9 warns that its default changes
# (to off) in 3.10. FMA rounds once where a multiply then an add rounds twice.
LAUNCH = dict(enable_fp_fusion=True)


@triton.jit
def _forward_kernel(X, Y, W, Bias, Mean, Rstd, N, D, eps,
                    HAS_BIAS: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, RMS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < N
    col_ok = cols < D
    mask = row_ok[:, None] & col_ok[None, :]
    offsets = rows.to(tl.int64)[:, None] * D + cols[None, :]
    x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
    if RMS:
        xc = x  # zero where masked, as loaded
    else:
        mean = tl.sum(x, axis=1) / D
        xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / D + eps)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = xc * rstd[:, None] * w[None, :]
    if HAS_BIAS:
        y += tl.load(Bias + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offsets, y.to(Y.dtype.element_ty), mask=mask)
    if not RMS:
        tl.store(Mean + rows, mean, mask=row_ok)
    tl.store(Rstd + rows, rstd, mask=row_ok)


@triton.jit
def _forward_kernel_looped(X, Y, W, Bias, Mean, Rstd, D, eps,
                           HAS_BIAS: tl.constexpr, BLOCK_D: tl.constexpr, RMS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    X += row * D
    Y += row * D
    mean = 0.0
    if not RMS:
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for start in range(0, D, BLOCK_D):
            cols = start + tl.arange(0, BLOCK_D)
            acc += tl.load(X + cols, mask=cols < D, other=0.0).to(tl.float32)
        mean = tl.sum(acc, axis=0) / D
        tl.store(Mean + row, mean)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in range(0, D, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        x = tl.load(X + cols, mask=cols < D, other=0.0).to(tl.float32)
        xc = tl.where(cols < D, x - mean, 0.0)
        acc += xc * xc
    rstd = tl.rsqrt(tl.sum(acc, axis=0) / D + eps)
    for start in range(0, D, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        col_ok = cols < D
        x = tl.load(X + cols, mask=col_ok, other=0.0).to(tl.float32)
        y = (x - mean) * rstd * tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y += tl.load(Bias + cols, mask=col_ok, other=0.0).to(tl.float32)
        tl.store(Y + cols, y.to(Y.dtype.element_ty), mask=col_ok)
    tl.store(Rstd + row, rstd)


@triton.jit
def _backward_kernel(X, DY, DX, W, Mean, Rstd, Work, part_w_at, part_b_at, sq_w_at, sq_b_at,
                     num_examples, T, D, examples_per_program, n_chunks, rows_per_chunk,
                     NEED_DW: tl.constexpr, NEED_DB: tl.constexpr, WHOLE: tl.constexpr,
                     BLOCK_D: tl.constexpr, ROWS: tl.constexpr, RMS: tl.constexpr):
    pid = tl.program_id(0)
    PartW, PartB, SqW, SqB = Work + part_w_at, Work + part_b_at, Work + sq_w_at, Work + sq_b_at
    chunk = pid % n_chunks
    first_example = (pid // n_chunks) * examples_per_program
    end_example = tl.minimum(first_example + examples_per_program, num_examples)
    t_begin = chunk * rows_per_chunk
    t_end = tl.minimum(t_begin + rows_per_chunk, T)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    total_w = tl.zeros([BLOCK_D], dtype=tl.float32)
    total_b = tl.zeros([BLOCK_D], dtype=tl.float32)
    sq_w = tl.zeros([BLOCK_D], dtype=tl.float32)
    sq_b = tl.zeros([BLOCK_D], dtype=tl.float32)
    for example in range(first_example, end_example):
        acc_w = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
        acc_b = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
        for t0 in range(t_begin, t_end, ROWS):
            t = t0 + tl.arange(0, ROWS)
            row_ok = t < t_end
            rows = (example * T + t).to(tl.int64)
            mask = row_ok[:, None] & col_ok[None, :]
            offsets = rows[:, None] * D + cols[None, :]
            x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + offsets, mask=mask, other=0.0).to(tl.float32)
            if RMS:  # x̂ = x rstd (zero where masked)
                rstd = tl.load(Rstd + rows, mask=row_ok, other=0.0)
                xhat = x * rstd[:, None]
            else:
                mean = tl.load(Mean + rows, mask=row_ok, other=0.0)
                rstd = tl.load(Rstd + rows, mask=row_ok, other=0.0)
                xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
            wdy = dy * w[None, :]
            c1 = tl.sum(xhat * wdy, axis=1) / D
            if RMS:  # dx has no mean(w dy) term
                c2 = tl.zeros([ROWS], dtype=tl.float32)
            else:
                c2 = tl.sum(wdy, axis=1) / D
            dx = (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
            tl.store(DX + offsets, dx.to(DX.dtype.element_ty), mask=mask)
            if NEED_DW:
                acc_w += dy * xhat
            if NEED_DB:
                acc_b += dy
        g_w = tl.sum(acc_w, axis=0)
        g_b = tl.sum(acc_b, axis=0)
        total_w += g_w
        total_b += g_b
        if WHOLE:  # this program saw all of the example: its dγ_b, dβ_b are complete
            sq_w += g_w * g_w
            sq_b += g_b * g_b
    part = pid.to(tl.int64) * D
    if NEED_DW:
        tl.store(PartW + part + cols, total_w, mask=col_ok)
        if WHOLE:
            tl.store(SqW + pid, tl.sum(sq_w, axis=0))
    if NEED_DB:
        tl.store(PartB + part + cols, total_b, mask=col_ok)
        if WHOLE:
            tl.store(SqB + pid, tl.sum(sq_b, axis=0))


@triton.jit
def _row_slice(X, DY, W, row, start, D, mean, rstd, BLOCK_D: tl.constexpr):
    # columns start .. start + BLOCK_D of one row: their mask, dy, w * dy and x-hat (zero past D), in float32
    cols = start + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    x = tl.load(X + row * D + cols, mask=col_ok, other=0.0).to(tl.float32)
    dy = tl.load(DY + row * D + cols, mask=col_ok, other=0.0).to(tl.float32)
    wdy = dy * tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    return cols, col_ok, dy, wdy, tl.where(col_ok, (x - mean) * rstd, 0.0)


@triton.jit
def _backward_kernel_looped(X, DY, DX, W, Mean, Rstd, Work, part_w_at, part_b_at, T, D, n_chunks, rows_per_chunk,
                            NEED_DW: tl.constexpr, NEED_DB: tl.constexpr, BLOCK_D: tl.constexpr,
                            RMS: tl.constexpr):
    # split mode only; the program's partial rows (zeroed by the caller) are its accumulators
    pid = tl.program_id(0)
    PartW, PartB = Work + part_w_at, Work + part_b_at
    example = pid // n_chunks
    t_begin = (pid % n_chunks) * rows_per_chunk
    t_end = tl.minimum(t_begin + rows_per_chunk, T)
    part = pid.to(tl.int64) * D
    for t in range(t_begin, t_end):
        row = (example * T + t).to(tl.int64)
        mean = 0.0 if RMS else tl.load(Mean + row)
        rstd = tl.load(Rstd + row)
        acc1 = tl.zeros([BLOCK_D], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_D], dtype=tl.float32)
        for start in range(0, D, BLOCK_D):
            cols, col_ok, dy, wdy, xhat = _row_slice(X, DY, W, row, start, D, mean, rstd, BLOCK_D)
            acc1 += xhat * wdy
            acc2 += wdy
        c1 = tl.sum(acc1, axis=0) / D
        c2 = 0.0 if RMS else tl.sum(acc2, axis=0) / D
        for start in range(0, D, BLOCK_D):
            cols, col_ok, dy, wdy, xhat = _row_slice(X, DY, W, row, start, D, mean, rstd, BLOCK_D)
            dx = (wdy - (xhat * c1 + c2)) * rstd
            tl.store(DX + row * D + cols, dx.to(DX.dtype.element_ty), mask=col_ok)
            if NEED_DW:
                p = tl.load(PartW + part + cols, mask=col_ok, other=0.0)
                tl.store(PartW + part + cols, p + dy * xhat, mask=col_ok)
            if NEED_DB:
                p = tl.load(PartB + part + cols, mask=col_ok, other=0.0)
                tl.store(PartB + part + cols, p + dy, mask=col_ok)


@triton.jit
def _sum_rows(Part, first_row, n_rows, D, cols, col_ok, TILE: tl.constexpr, BLOCK_C: tl.constexpr):
    # rows first_row .. first_row + n_rows of the float32 [rows, D] partial sums, summed over these columns
    acc = tl.zeros([TILE, BLOCK_C], dtype=tl.float32)
    for r0 in range(0, n_rows, TILE):
        rows = r0 + tl.arange(0, TILE)
        mask = (rows < n_rows)[:, None] & col_ok[None, :]
        offsets = (first_row + rows).to(tl.int64)[:, None] * D + cols[None, :]
        acc += tl.load(Part + offsets, mask=mask, other=0.0)
    return tl.sum(acc, axis=0)


@triton.jit
def _reduce_examples_kernel(Work, part_w_at, part_b_at, ex_w_at, ex_b_at, sq_w_at, sq_b_at, n_chunks, D,
                            n_column_blocks,
                            NEED_DW: tl.constexpr, NEED_DB: tl.constexpr,
                            BLOCK_C: tl.constexpr, CHUNK_TILE: tl.constexpr):
    # program (example, column block): dγ_b, dβ_b over these columns, and their squares' sum
    # (examples on the first grid axis, which has no 65535 limit)
    PartW, PartB, ExW, ExB = Work + part_w_at, Work + part_b_at, Work + ex_w_at, Work + ex_b_at
    SqW, SqB = Work + sq_w_at, Work + sq_b_at
    example = tl.program_id(0)
    block = tl.program_id(1)
    cols = block * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < D
    out = example.to(tl.int64) * D + cols
    if NEED_DW:
        g_w = _sum_rows(PartW, example * n_chunks, n_chunks, D, cols, col_ok, CHUNK_TILE, BLOCK_C)
        tl.store(ExW + out, g_w, mask=col_ok)
        tl.store(SqW + example * n_column_blocks + block, tl.sum(g_w * g_w, axis=0))
    if NEED_DB:
        g_b = _sum_rows(PartB, example * n_chunks, n_chunks, D, cols, col_ok, CHUNK_TILE, BLOCK_C)
        tl.store(ExB + out, g_b, mask=col_ok)
        tl.store(SqB + example * n_column_blocks + block, tl.sum(g_b * g_b, axis=0))


@triton.jit
def _finish_kernel(Work, part_w_at, part_b_at, sq_w_at, sq_b_at, DW, DB, WeightSq, BiasSq, Count,
                   n_parts, D, n_sq, num_examples,
                   NEED_DW: tl.constexpr, NEED_DB: tl.constexpr,
                   BLOCK_C: tl.constexpr, PART_TILE: tl.constexpr, SQ_TILE: tl.constexpr):
    # every program: the parameter gradients over its columns (sum of the partial rows);
    # program 0 also: the buffers += the squared-norm pieces, example_count += B
    PartW, PartB, SqW, SqB = Work + part_w_at, Work + part_b_at, Work + sq_w_at, Work + sq_b_at
    block = tl.program_id(0)
    cols = block * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < D
    if NEED_DW:
        g_w = _sum_rows(PartW, 0, n_parts, D, cols, col_ok, PART_TILE, BLOCK_C)
        tl.store(DW + cols, g_w.to(DW.dtype.element_ty), mask=col_ok)
    if NEED_DB:
        g_b = _sum_rows(PartB, 0, n_parts, D, cols, col_ok, PART_TILE, BLOCK_C)
        tl.store(DB + cols, g_b.to(DB.dtype.element_ty), mask=col_ok)
    if block == 0:
        sq_w = tl.zeros([SQ_TILE], dtype=tl.float32)
        sq_b = tl.zeros([SQ_TILE], dtype=tl.float32)
        for i0 in range(0, n_sq, SQ_TILE):
            i = i0 + tl.arange(0, SQ_TILE)
            if NEED_DW:
                sq_w += tl.load(SqW + i, mask=i < n_sq, other=0.0)
            if NEED_DB:
                sq_b += tl.load(SqB + i, mask=i < n_sq, other=0.0)
        if NEED_DW:
            tl.store(WeightSq, tl.load(WeightSq) + tl.sum(sq_w, axis=0))
        if NEED_DB:
            tl.store(BiasSq, tl.load(BiasSq) + tl.sum(sq_b, axis=0))
        tl.store(Count, tl.load(Count) + num_examples)


def _num_warps(elements, values_per_thread=8):
    return min(16, max(1, triton.next_power_of_2(elements) // (32 * values_per_thread)))


# How the backward shares out its work on a GPU. The values are a reasoned first choice, not
# yet tuned on hardware: `python bench/layernorm.py --sweep` times alternatives on a GPU.
# programs_per_sm: programs aimed for per multiprocessor; min_rows_per_chunk: fewest rows a
# program takes of one example; max_tile: elements of a program's [rows, BLOCK_D] tile;
# values_per_thread: elements of the tile each thread holds (sets the warps). 16, not 8: a full
# 4096-element tile over 16 warps needs a little over 64 registers a thread, and ptxas may
# squeeze it into 64 (two programs per SM) by spilling; over 8 warps it fits two without.
BACKWARD_TUNING = dict(programs_per_sm=4, min_rows_per_chunk=MIN_ROWS_PER_CHUNK, max_tile=MAX_TILE,
                       values_per_thread=16)

_sm_counts = {}


def _target_programs(device):
    """Programs the backward aims for: a few per SM on a GPU, few under the CPU interpreter."""
    if device.type != "cuda":
        return 2
    if device not in _sm_counts:
        _sm_counts[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return BACKWARD_TUNING["programs_per_sm"] * _sm_counts[device]


# -- launching ------------------------------------------------------------------------------
# A normalisation is paid per layer and micro-step, and on a GPU its host time, not the
# kernels', sets what it costs: kernel[grid](...) binds and specialises every argument and
# builds a cache key on each call. So everything a shape fixes (grid, constexprs, warps, the
# workspace's layout) is planned once per shape, and after a kernel's first launch through
# Triton the compiled kernel that launch returned is launched directly: the same call that
# Triton's own launcher ends with. Triton specialises a kernel on its arguments' dtypes, on
# each integer's value being 1 or a multiple of 16, and on each pointer's 16-byte alignment;
# the plan's key fixes the first two, and a call whose tensors are not all 16-byte aligned
# goes through Triton's launcher every time. NORMGNORM_TRITON_LAUNCH=jit always does.

_compiled = {}  # (kernel, plan key) -> (compiled kernel, its constexpr values in order)
MAX_CACHED = 4096  # plans and compiled kernels kept per cache; inputs of ever-new shapes start it afresh


def _remember(cache, key, value):
    if len(cache) >= MAX_CACHED:
        cache.clear()
    cache[key] = value


def _direct_launch_allowed():
    return os.environ.get("NORMGNORM_TRITON_LAUNCH", "") != "jit"


def _aligned(*tensors):
    """True where every tensor's address is a multiple of 16 bytes (None counts as aligned)."""
    address = 0
    for t in tensors:
        if t is not None:
            address |= t.data_ptr()
    return address % 16 == 0


def _launch(kernel, grid, args, meta, key, traced=False):
    """kernel[grid](*args, **meta); key: hashable, None where the direct launch must not be used
    (fixes everything of args but the addresses, which the caller has checked are aligned).
    traced: inside the registered ops below, as torch.compile traces them: the launch is
    wrap_triton's, which the compiler turns into its own (the FMA choice left to it)."""
    if traced:
        wrap_triton(kernel)[grid](*args, **{name: value for name, value in meta.items() if name not in LAUNCH})
        return
    if key is not None:
        found = _compiled.get((kernel, key))
        if found is not None:
            compiled, constexprs = found
            compiled[grid + (1,) * (3 - len(grid))](*args, *constexprs)
            return
    compiled = kernel[grid](*args, **meta)
    # a GPU launch returns its compiled kernel (the interpreter, and the launch recorder of
    # triton_aot.py, return other things, never cached)
    if key is not None and hasattr(compiled, "packed_metadata") and hasattr(compiled, "run"):
        names = kernel.arg_names[len(args):]
        _remember(_compiled, (kernel, key), (compiled, tuple(meta[name] for name in names)))


_forward_plans = {}


def _forward_plan(N, D, rms, has_bias, max_block_d):
    """(looped, grid, meta) of the forward for x2d [N, D]."""
    key = (N, D, rms, has_bias, max_block_d)  # also in the key of the direct launch (forward)
    plan = _forward_plans.get(key)
    if plan is None:
        block_d = triton.next_power_of_2(D)
        if block_d <= max_block_d:
            rows = max(1, 4096 // block_d)  # several short rows per program
            plan = (False, (triton.cdiv(N, rows),),
                    dict(HAS_BIAS=has_bias, BLOCK_D=block_d, ROWS=rows, RMS=rms,
                         num_warps=_num_warps(rows * block_d), **LAUNCH))
        else:
            block = min(LOOPED_BLOCK_D, max_block_d)
            plan = (True, (N,), dict(HAS_BIAS=has_bias, BLOCK_D=block, RMS=rms, num_warps=_num_warps(block), **LAUNCH))
        _remember(_forward_plans, key, plan)
    return plan


def forward(x2d, weight, bias, eps, rms=False, max_block_d=MAX_BLOCK_D, traced=False):
    """y (x's dtype), float32 mean (None with rms: RMSNorm) and rstd [N], for contiguous x2d [N, D].
    traced: launched through wrap_triton (forward_op)."""
    N, D = x2d.shape
    y = torch.empty_like(x2d)
    rstd = torch.empty(N, dtype=torch.float32, device=x2d.device)
    mean = None if rms else torch.empty_like(rstd)
    has_bias = bias is not None
    bias_arg = bias if has_bias else weight  # never read without HAS_BIAS
    mean_arg = rstd if rms else mean  # never written with RMS
    looped, grid, meta = _forward_plan(N, D, rms, has_bias, max_block_d)
    key = None
    if not traced and x2d.is_cuda and _direct_launch_allowed() and _aligned(x2d, weight, bias):
        key = (N, D, rms, has_bias, max_block_d, x2d.dtype, weight.dtype, bias_arg.dtype, x2d.device.index)
    if looped:
        _launch(_forward_kernel_looped, grid, (x2d, y, weight, bias_arg, mean_arg, rstd, D, eps), meta, key, traced)
    else:
        _launch(_forward_kernel, grid, (x2d, y, weight, bias_arg, mean_arg, rstd, N, D, eps), meta, key, traced)
    return y, mean, rstd


_backward_plans = {}


def _backward_plan(B, T, D, need_dw, need_db, rms, target_programs, max_block_d, min_rows_per_chunk):
    """The backward's launches for B examples of T rows of D features, as a dict: the plan of
    normgnorm/plan.py, the float32 workspace's size and where each scratch array starts in it,
    and each kernel's grid and meta-parameters."""
    tuning = BACKWARD_TUNING
    key = (B, T, D, need_dw, need_db, rms, target_programs, max_block_d, min_rows_per_chunk, *tuning.values())
    found = _backward_plans.get(key)
    if found is not None:
        return found
    p = plan_backward(B, T, D, target_programs, max_block_d, min_rows_per_chunk, tuning["max_tile"])
    n_programs, whole, looped = p["n_programs"], p["whole"], p["looped"]
    n_column_blocks = triton.cdiv(D, COLUMN_BLOCK)
    # the workspace: each program's partial rows, then (split mode) each example's dγ_b, dβ_b,
    # then the squared-norm pieces; an array not needed has size 0 and is never read
    sizes = dict(part_w=n_programs * D if need_dw else 0, part_b=n_programs * D if need_db else 0,
                 ex_w=B * D if need_dw and not whole else 0, ex_b=B * D if need_db and not whole else 0)
    n_sq = n_programs if whole else B * n_column_blocks
    sizes.update(sq_w=n_sq if need_dw else 0, sq_b=n_sq if need_db else 0)
    offsets, size = {}, 0
    for name, n in sizes.items():
        offsets[name] = size
        size += -(-n // 4) * 4  # each array 16-byte aligned, as the specialisation assumes
    at = lambda *names: tuple(offsets[name] for name in names)  # noqa: E731
    flags = dict(NEED_DW=need_dw, NEED_DB=need_db)
    if looped:
        block = min(LOOPED_BLOCK_D, max_block_d)
        first = (at("part_w", "part_b"),
                 (T, D, p["n_chunks"], p["rows_per_chunk"]),
                 dict(flags, BLOCK_D=block, RMS=rms, num_warps=_num_warps(block), **LAUNCH))
    else:
        block_d = triton.next_power_of_2(D)
        first = (at("part_w", "part_b", "sq_w", "sq_b"),
                 (B, T, D, p["examples_per_program"], p["n_chunks"], p["rows_per_chunk"]),
                 dict(flags, WHOLE=whole, BLOCK_D=block_d, ROWS=p["rows_per_tile"], RMS=rms,
                      num_warps=_num_warps(p["rows_per_tile"] * block_d, tuning["values_per_thread"]), **LAUNCH))
    plan = dict(p, key=key, workspace=size, first=first, n_column_blocks=n_column_blocks)
    if need_dw or need_db:
        if not whole:  # each example's dγ_b, dβ_b from its chunks, and their squares
            plan["reduce"] = (at("part_w", "part_b", "ex_w", "ex_b", "sq_w", "sq_b"),
                              (p["n_chunks"], D, n_column_blocks),
                              dict(flags, BLOCK_C=COLUMN_BLOCK, num_warps=4, **LAUNCH,
                                   CHUNK_TILE=min(32, triton.next_power_of_2(p["n_chunks"]))))
        n_parts = n_programs if whole else B
        plan["finish"] = (at("ex_w" if not whole else "part_w", "ex_b" if not whole else "part_b", "sq_w", "sq_b"),
                          (n_parts, D, n_sq, B),
                          dict(flags, BLOCK_C=COLUMN_BLOCK, PART_TILE=min(32, triton.next_power_of_2(n_parts)),
                               SQ_TILE=min(1024, triton.next_power_of_2(n_sq)), num_warps=4, **LAUNCH))
    _remember(_backward_plans, key, plan)
    return plan


def backward(dy2d, x2d, weight, mean, rstd, num_examples, need_dw, need_db, weight_sq, bias_sq, count,
             max_block_d=MAX_BLOCK_D, target_programs=None, min_rows_per_chunk=None, traced=False):
    """
    dx, dw, db (None where not needed) for contiguous dy2d, x2d [N, D]; adds Σ_b ||dγ_b||²,
    Σ_b ||dβ_b||² to weight_sq, bias_sq and num_examples to count, all on the device. mean None:
    RMSNorm (need_db False).
    max_block_d, target_programs and min_rows_per_chunk pick the kernel variant and the
    work split (the tests use them to reach every path at small sizes); left out, the work is
    shared out as BACKWARD_TUNING says. traced: launched through wrap_triton (backward_op).
    """
    N, D = x2d.shape
    B = num_examples
    T = N // B
    device = x2d.device
    rms = mean is None
    mean = rstd if rms else mean  # never read with RMS
    plan = _backward_plan(B, T, D, need_dw, need_db, rms, target_programs or _target_programs(device), max_block_d,
                          min_rows_per_chunk or BACKWARD_TUNING["min_rows_per_chunk"])
    dx = torch.empty_like(x2d)
    # the looped kernel adds into its partial rows: they start at zero
    work = (torch.zeros if plan["looped"] else torch.empty)(plan["workspace"], dtype=torch.float32, device=device)
    key = None
    if not traced and x2d.is_cuda and _direct_launch_allowed() and \
            _aligned(dy2d, x2d, weight, mean, rstd, weight_sq, bias_sq, count):
        key = (*plan["key"], x2d.dtype, dy2d.dtype, weight.dtype, device.index)
    offsets, ints, meta = plan["first"]
    _launch(_backward_kernel_looped if plan["looped"] else _backward_kernel, (plan["n_programs"],),
            (x2d, dy2d, dx, weight, mean, rstd, work, *offsets, *ints), meta, key, traced)
    if not (need_dw or need_db):
        count.add_(B)
        return dx, None, None
    if "reduce" in plan:
        offsets, ints, meta = plan["reduce"]
        _launch(_reduce_examples_kernel, (B, plan["n_column_blocks"]), (work, *offsets, *ints), meta, key, traced)
    dw = torch.empty_like(weight) if need_dw else None
    db = torch.empty_like(weight) if need_db else None
    placeholder = work  # stands in for what is not needed, never read
    offsets, ints, meta = plan["finish"]
    _launch(_finish_kernel, (plan["n_column_blocks"],),
            (work, *offsets, placeholder if dw is None else dw, placeholder if db is None else db,
             weight_sq, placeholder if bias_sq is None else bias_sq, count, *ints), meta, key, traced)
    return dx, dw, db


# -- the kernels as torch.compile sees them ----------------------------------------------------
# torch.library.triton_ops: the compiler traces their bodies, the launches through wrap_triton,
# so the kernels are nodes of its graph that it launches from its own code (and may capture in a
# CUDA graph) rather than opaque Python ops run on every call. Called eagerly they run as above.

@triton_op("normgnorm::triton_forward", mutates_args=())
def forward_op(x2d: Tensor, weight: Tensor, bias: Optional[Tensor], eps: float,
               rms: bool) -> tuple[Tensor, Tensor, Tensor]:
    """forward() for contiguous x2d [N, D]; an RMSNorm's mean, which it has not, is empty."""
    y, mean, rstd = forward(x2d, weight, bias, eps, rms, traced=True)
    return y, (rstd.new_empty(0) if mean is None else mean), rstd


@triton_op("normgnorm::triton_backward", mutates_args=("weight_sq", "bias_sq", "count"))
def backward_op(dy2d: Tensor, x2d: Tensor, weight: Tensor, mean: Tensor, rstd: Tensor, num_examples: int,
                need_dw: bool, need_db: bool, weight_sq: Tensor, bias_sq: Optional[Tensor], count: Tensor,
                rms: bool) -> tuple[Tensor, Tensor, Tensor]:
    """backward() for contiguous dy2d, x2d [N, D]: dx, and dw, db (empty where not needed: an op
    returns tensors), adding to the buffers."""
    dx, dw, db = backward(dy2d, x2d, weight, None if rms else mean, rstd, num_examples, need_dw, need_db,
                          weight_sq, bias_sq, count, traced=True)
    return dx, (weight.new_empty(0) if dw is None else dw), (weight.new_empty(0) if db is None else db)
