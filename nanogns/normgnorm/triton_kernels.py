"""
Triton kernels for LayerNorm with per-example dγ, dβ norms (see normgnorm/__init__.py for the
maths), and for RMSNorm, the same kernels with the constexpr RMS: no mean, no centring, no bias
(no dβ), and dx without the mean's term. float32, float16 and bfloat16 inputs; all arithmetic and
accumulation in float32.

Rows are the flattened leading dims, x2d [N, D] with N = B*T, example b owning rows
b*T .. b*T+T-1. A row that fits one block (D <= MAX_BLOCK_D) is held in registers; wider rows
take the "looped" kernels, which walk the row in BLOCK_D pieces.

One launch forward, one launch backward. The backward, without any [B, T, D] temporary, rows
shared out as normgnorm/plan.py says:
1. each program takes a run of rows, writes dx, and sums dy ⊙ x̂ and dy over its rows into one
   float32 partial row [D]. In "whole" mode a program owns whole examples, so it also squares
   each complete dγ_b, dβ_b itself;
2. the programs then finish the sums themselves (plan_finish): they are grouped, and the last
   program of a group to be done sums the group's partial rows (in split mode example by
   example, squaring each complete dγ_b, dβ_b); the last group to be done sums the groups' rows
   into dγ, dβ and adds the squared norms to the float32 buffers. Program 0 adds B to the count.
"Last" is counted with one atomic counter per group and one for the groups; the counters go back
to zero as they are used. The atomics only count: every sum has a fixed order, so results are
deterministic. Program 0 first fills dγ, dβ with NaN: were the counting ever to miss its last
program, the gradients would come back NaN, never as whatever memory held.

The scratch and the counters are allocated for each launch (torch's caching allocator makes that
cheap), so no two launches share them: launches on two streams, or two CUDA graphs (a graph's
allocations come from its own pool and live as long as it does) never count on one counter.
Every launch runs on its tensors' device, whichever device is current.
"""
from contextlib import nullcontext

import torch
import triton
import triton.language as tl

from .plan import MAX_TILE, MIN_ROWS_PER_CHUNK, plan_backward, plan_finish

# Wider rows use the looped kernels. A [1, 8192] float32 tile over 16 warps is 16 values a
# thread per live array; the backward holds about six, which still fits the register file.
MAX_BLOCK_D = 8192
LOOPED_BLOCK_D = 4096   # piece of a row the looped kernels hold at once
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
def _forward_kernel_looped(X, Y, W, Bias, Mean, Rstd, N, D, eps,
                           HAS_BIAS: tl.constexpr, BLOCK_D: tl.constexpr, RMS: tl.constexpr):
    # one program a row (N, unused, keeps the arguments those of _forward_kernel)
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
def _sum_values(Values, first, end, BLOCK: tl.constexpr):
    # Values[first .. end] summed (float32)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i0 in range(first, end, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        acc += tl.load(Values + i, mask=i < end, other=0.0)
    return tl.sum(acc, axis=0)


@triton.jit
def _group_rows(Part, first_unit, end_unit, rows_per_unit, D, cols, col_ok, SQUARE: tl.constexpr,
                TILE: tl.constexpr, BLOCK_C: tl.constexpr):
    # the partial rows of units first_unit .. end_unit summed over these columns, and with SQUARE
    # (a unit is an example's chunks) each unit's sum squared, summed
    squares = tl.zeros([BLOCK_C], dtype=tl.float32)
    if SQUARE:
        total = tl.zeros([BLOCK_C], dtype=tl.float32)
        for unit in range(first_unit, end_unit):
            g = _sum_rows(Part, unit * rows_per_unit, rows_per_unit, D, cols, col_ok, TILE, BLOCK_C)
            total += g
            squares += g * g
    else:
        total = _sum_rows(Part, first_unit * rows_per_unit, (end_unit - first_unit) * rows_per_unit, D, cols, col_ok,
                          TILE, BLOCK_C)
    return total, squares


@triton.jit
def _finish(Work, Counters, pid, num_examples, n_programs, n_chunks, D, DW, DB, WeightSq, BiasSq,
            part_w_at, part_b_at, sq_w_at, sq_b_at, group_w_at, group_b_at, group_sq_w_at, group_sq_b_at,
            units_per_group, n_groups,
            NEED_DW: tl.constexpr, NEED_DB: tl.constexpr, WHOLE: tl.constexpr,
            BLOCK_C: tl.constexpr, TILE: tl.constexpr):
    # after this program's partial rows are written: the last program of its group sums the group's,
    # and the last group's the totals (module docstring). A unit: a program of whole examples, or
    # the n_chunks programs of one split example.
    if WHOLE:
        rows_per_unit = 1
        n_units = n_programs
    else:
        rows_per_unit = n_chunks
        n_units = num_examples
    group = pid // (units_per_group * rows_per_unit)
    first_unit = group * units_per_group
    end_unit = tl.minimum(first_unit + units_per_group, n_units)
    if pid == 0:
        # NaN until the last program's sums land: they come after this store (this program's
        # release below, and the group's, precede their acquiring), so they win; a count that
        # misses the last program leaves NaN, not stale memory
        for start in range(0, D, BLOCK_C):
            cols = start + tl.arange(0, BLOCK_C)
            nan = tl.full([BLOCK_C], float("nan"), dtype=tl.float32)
            if NEED_DW:
                tl.store(DW + cols, nan.to(DW.dtype.element_ty), mask=cols < D)
            if NEED_DB:
                tl.store(DB + cols, nan.to(DB.dtype.element_ty), mask=cols < D)
    # every thread's stores before the count, whose release makes them visible to the program that reads them
    tl.debug_barrier()
    arrived = tl.atomic_add(Counters + group, 1, sem="acq_rel", scope="gpu")
    if arrived == (end_unit - first_unit) * rows_per_unit - 1:  # the group's last: its sums
        tl.atomic_xchg(Counters + group, 0, sem="relaxed", scope="gpu")
        sq_w = 0.0
        sq_b = 0.0
        for start in range(0, D, BLOCK_C):
            cols = start + tl.arange(0, BLOCK_C)
            col_ok = cols < D
            out = group.to(tl.int64) * D + cols
            if NEED_DW:
                g, squares = _group_rows(Work + part_w_at, first_unit, end_unit, rows_per_unit, D, cols, col_ok,
                                         not WHOLE, TILE, BLOCK_C)
                tl.store(Work + group_w_at + out, g, mask=col_ok)
                sq_w += tl.sum(squares, axis=0)
            if NEED_DB:
                g, squares = _group_rows(Work + part_b_at, first_unit, end_unit, rows_per_unit, D, cols, col_ok,
                                         not WHOLE, TILE, BLOCK_C)
                tl.store(Work + group_b_at + out, g, mask=col_ok)
                sq_b += tl.sum(squares, axis=0)
        if WHOLE:  # each program squared its own examples' sums
            if NEED_DW:
                sq_w = _sum_values(Work + sq_w_at, first_unit, end_unit, BLOCK_C)
            if NEED_DB:
                sq_b = _sum_values(Work + sq_b_at, first_unit, end_unit, BLOCK_C)
        if NEED_DW:
            tl.store(Work + group_sq_w_at + group, sq_w)
        if NEED_DB:
            tl.store(Work + group_sq_b_at + group, sq_b)
        tl.debug_barrier()
        arrived = tl.atomic_add(Counters + n_groups, 1, sem="acq_rel", scope="gpu")
        if arrived == n_groups - 1:  # the last group: the parameter gradients and the buffers
            tl.atomic_xchg(Counters + n_groups, 0, sem="relaxed", scope="gpu")
            for start in range(0, D, BLOCK_C):
                cols = start + tl.arange(0, BLOCK_C)
                col_ok = cols < D
                if NEED_DW:
                    g = _sum_rows(Work + group_w_at, 0, n_groups, D, cols, col_ok, TILE, BLOCK_C)
                    tl.store(DW + cols, g.to(DW.dtype.element_ty), mask=col_ok)
                if NEED_DB:
                    g = _sum_rows(Work + group_b_at, 0, n_groups, D, cols, col_ok, TILE, BLOCK_C)
                    tl.store(DB + cols, g.to(DB.dtype.element_ty), mask=col_ok)
            if NEED_DW:
                tl.store(WeightSq, tl.load(WeightSq) + _sum_values(Work + group_sq_w_at, 0, n_groups, BLOCK_C))
            if NEED_DB:
                tl.store(BiasSq, tl.load(BiasSq) + _sum_values(Work + group_sq_b_at, 0, n_groups, BLOCK_C))


@triton.jit
def _backward_kernel(X, DY, DX, W, Mean, Rstd, DW, DB, WeightSq, BiasSq, Count, Work, Counters,
                     num_examples, T, D, examples_per_program, n_chunks, rows_per_chunk,
                     part_w_at, part_b_at, sq_w_at, sq_b_at, group_w_at, group_b_at, group_sq_w_at, group_sq_b_at,
                     n_programs, units_per_group, n_groups,
                     NEED_DW: tl.constexpr, NEED_DB: tl.constexpr, WHOLE: tl.constexpr,
                     BLOCK_D: tl.constexpr, ROWS: tl.constexpr, RMS: tl.constexpr,
                     BLOCK_C: tl.constexpr, TILE: tl.constexpr):
    pid = tl.program_id(0)
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
        tl.store(Work + part_w_at + part + cols, total_w, mask=col_ok)
        if WHOLE:
            tl.store(Work + sq_w_at + pid, tl.sum(sq_w, axis=0))
    if NEED_DB:
        tl.store(Work + part_b_at + part + cols, total_b, mask=col_ok)
        if WHOLE:
            tl.store(Work + sq_b_at + pid, tl.sum(sq_b, axis=0))
    if NEED_DW or NEED_DB:
        _finish(Work, Counters, pid, num_examples, n_programs, n_chunks, D, DW, DB, WeightSq, BiasSq,
                part_w_at, part_b_at, sq_w_at, sq_b_at, group_w_at, group_b_at, group_sq_w_at, group_sq_b_at,
                units_per_group, n_groups, NEED_DW, NEED_DB, WHOLE, BLOCK_C, TILE)
    if pid == 0:
        tl.store(Count, tl.load(Count) + num_examples)


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
def _backward_kernel_looped(X, DY, DX, W, Mean, Rstd, DW, DB, WeightSq, BiasSq, Count, Work, Counters,
                            num_examples, T, D, examples_per_program, n_chunks, rows_per_chunk,
                            part_w_at, part_b_at, sq_w_at, sq_b_at, group_w_at, group_b_at, group_sq_w_at,
                            group_sq_b_at, n_programs, units_per_group, n_groups,
                            NEED_DW: tl.constexpr, NEED_DB: tl.constexpr, BLOCK_D: tl.constexpr,
                            RMS: tl.constexpr, BLOCK_C: tl.constexpr, TILE: tl.constexpr):
    # split mode only (one example a program, examples_per_program unused); the program's partial
    # rows are its accumulators, zeroed first
    pid = tl.program_id(0)
    PartW, PartB = Work + part_w_at, Work + part_b_at
    example = pid // n_chunks
    t_begin = (pid % n_chunks) * rows_per_chunk
    t_end = tl.minimum(t_begin + rows_per_chunk, T)
    part = pid.to(tl.int64) * D
    for start in range(0, D, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        if NEED_DW:
            tl.store(PartW + part + cols, tl.zeros([BLOCK_D], dtype=tl.float32), mask=cols < D)
        if NEED_DB:
            tl.store(PartB + part + cols, tl.zeros([BLOCK_D], dtype=tl.float32), mask=cols < D)
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
    if NEED_DW or NEED_DB:
        _finish(Work, Counters, pid, num_examples, n_programs, n_chunks, D, DW, DB, WeightSq, BiasSq,
                part_w_at, part_b_at, sq_w_at, sq_b_at, group_w_at, group_b_at, group_sq_w_at, group_sq_b_at,
                units_per_group, n_groups, NEED_DW, NEED_DB, False, BLOCK_C, TILE)
    if pid == 0:
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
# max_chunks: the most programs one example is split into; the last of them sums their partial
# rows alone, so more would leave one program reading more than the rest of the launch.
BACKWARD_TUNING = dict(programs_per_sm=4, min_rows_per_chunk=MIN_ROWS_PER_CHUNK, max_tile=MAX_TILE,
                       values_per_thread=16, max_chunks=128)
FINISH_VALUES_PER_THREAD = 8  # elements of the finishing sums' tile each thread holds

_sm_counts = {}


def _target_programs(index):
    """Programs the backward aims for on CUDA device `index`: a few per SM; few (2) off GPU, under the CPU interpreter."""
    if index < 0:
        return 2
    if index not in _sm_counts:
        _sm_counts[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return BACKWARD_TUNING["programs_per_sm"] * _sm_counts[index]


# -- launching ------------------------------------------------------------------------------
# A normalisation is paid per layer and micro-step, and on a GPU its host time, not the
# kernels', sets what it costs: kernel[grid](...) binds and specialises every argument and
# builds a cache key on each call. So everything a shape fixes (grid, constexprs, warps, the
# workspace's layout) is planned once per shape, and after a launch's first call through
# Triton the compiled kernel that call returned is launched by its own launcher: the same call
# that Triton's ends with. Triton specialises a kernel on its arguments' dtypes, on each
# integer's value being 1 or a multiple of 16, and on each pointer's 16-byte alignment; the
# plan's key fixes the first two, and a call whose tensors are not all 16-byte aligned goes
# through Triton's launcher (which compiles for that), as does every launch while a profiler
# hooks Triton's launches.

MAX_CACHED = 4096  # plans kept per cache; inputs of ever-new shapes start it afresh


def _remember(cache, key, value):
    if len(cache) >= MAX_CACHED:
        cache.clear()
    cache[key] = value
    return value


def _aligned(*tensors):
    """True where every tensor's address is a multiple of 16 bytes (None counts as aligned)."""
    address = 0
    for t in tensors:
        if t is not None:
            address |= t.data_ptr()
    return address % 16 == 0


def _launch_hooked():
    """Whether something (a profiler) hooks Triton's launches: None, or (Triton >= 3.7) an empty chain, is not."""
    enter, leave = triton.knobs.runtime.launch_enter_hook, triton.knobs.runtime.launch_exit_hook
    return bool(enter is not None and getattr(enter, "calls", True) or leave is not None and getattr(leave, "calls", True))


def _current_stream(index):
    """The raw current CUDA stream of device `index`, 0 off GPU."""
    return torch._C._cuda_getCurrentRawStream(index) if index >= 0 else 0


_NO_GUARD = nullcontext()


def _on_device(index):
    """A context that makes CUDA device `index` current for a launch (Triton launches on the
    current device) where another is; nothing to switch off GPU (index < 0) or on it already."""
    if index < 0 or index == torch.cuda.current_device():
        return _NO_GUARD
    return torch.cuda.device(index)


class _Launch:
    """One kernel's launch as a plan fixes it: grid and meta-parameters, and once a launch
    through Triton has returned its compiled kernel, that kernel's launcher."""
    __slots__ = ("grid", "grid3", "meta", "kernel", "run", "function", "packed_metadata", "constexprs")

    def __init__(self, grid, meta):
        self.grid, self.grid3, self.meta = grid, grid + (1,) * (3 - len(grid)), meta
        self.kernel = None  # the kernel whose compiled launcher is kept

    def __call__(self, kernel, args, stream, aligned):
        """kernel[grid](*args, **meta), by the kept launcher where the kernel is the one it was kept
        for (a recorder may stand in) and args are aligned as at the kept launch."""
        if kernel is self.kernel and aligned and not _launch_hooked():
            self.run(*self.grid3, stream, self.function, self.packed_metadata, None, None, None, *args, *self.constexprs)
        else:
            compiled = kernel[self.grid](*args, **self.meta)
            # a GPU launch returns its compiled kernel (the interpreter, and the launch recorder of
            # triton_aot.py, return other things, never kept)
            if aligned and all(hasattr(compiled, name) for name in ("run", "function", "packed_metadata")):
                self.run = compiled.run  # (loads the kernel onto the device if it is not yet)
                self.function, self.packed_metadata = compiled.function, compiled.packed_metadata
                self.constexprs = tuple(self.meta[name] for name in kernel.arg_names[len(args):])
                self.kernel = kernel


_forward_plans = {}


def _forward_plan(key, N, D, rms, has_bias, max_block_d):
    """(looped, its _Launch) of the forward for x2d [N, D]."""
    block_d = triton.next_power_of_2(D)
    if block_d <= max_block_d:
        rows = max(1, 4096 // block_d)  # several short rows per program
        meta = dict(HAS_BIAS=has_bias, BLOCK_D=block_d, ROWS=rows, RMS=rms, num_warps=_num_warps(rows * block_d),
                    **LAUNCH)
        return _remember(_forward_plans, key, (False, _Launch((triton.cdiv(N, rows),), meta)))
    block = min(LOOPED_BLOCK_D, max_block_d)
    meta = dict(HAS_BIAS=has_bias, BLOCK_D=block, RMS=rms, num_warps=_num_warps(block), **LAUNCH)
    return _remember(_forward_plans, key, (True, _Launch((N,), meta)))


def forward(x2d, weight, bias, eps, rms=False, max_block_d=MAX_BLOCK_D):
    """y (x's dtype and shape), float32 mean (None with rms: RMSNorm) and rstd [N], for contiguous
    x2d [N, D], or any contiguous x [..., D], whose N rows the kernels see alike (no reshape paid)."""
    D = x2d.shape[-1]
    N = x2d.numel() // D
    y = torch.empty_like(x2d)
    rstd = torch.empty(N, dtype=torch.float32, device=x2d.device)
    mean = None if rms else torch.empty_like(rstd)
    index = x2d.get_device()
    key = (N, D, rms, x2d.dtype, weight.dtype, None if bias is None else bias.dtype, index, max_block_d)
    looped, launch = _forward_plans.get(key) or _forward_plan(key, N, D, rms, bias is not None, max_block_d)
    # (the bias is never read without HAS_BIAS, the mean never written with RMS)
    args = (x2d, y, weight, weight if bias is None else bias, rstd if rms else mean, rstd, N, D, eps)
    with _on_device(index):
        launch(_forward_kernel_looped if looped else _forward_kernel, args, _current_stream(index),
               _aligned(x2d, weight, bias))
    return y, mean, rstd


_backward_plans = {}


def _backward_plan(key, B, T, D, need_dw, need_db, rms, target_programs, max_block_d, min_rows_per_chunk):
    """The backward's launch for B examples of T rows of D features, as a dict: the plan of
    normgnorm/plan.py and plan_finish, the sizes of the float32 workspace and of the counters,
    the kernel's integer arguments (where each scratch array starts in the workspace among them)
    and its _Launch."""
    tuning = BACKWARD_TUNING
    p = plan_backward(B, T, D, target_programs, max_block_d, min_rows_per_chunk, tuning["max_tile"],
                      tuning["max_chunks"])
    n_programs, whole, looped = p["n_programs"], p["whole"], p["looped"]
    finish = plan_finish(n_programs, 1) if whole else plan_finish(B, p["n_chunks"])
    n_groups = finish["n_groups"]
    # the workspace: each program's partial rows and (whole mode) squared norms, then each
    # group's; an array not needed has size 0 and is never read
    sizes = dict(part_w=n_programs * D * need_dw, part_b=n_programs * D * need_db,
                 sq_w=n_programs * (whole and need_dw), sq_b=n_programs * (whole and need_db),
                 group_w=n_groups * D * need_dw, group_b=n_groups * D * need_db,
                 group_sq_w=n_groups * need_dw, group_sq_b=n_groups * need_db)
    offsets, size = [], 0
    for n in sizes.values():
        offsets.append(size)
        size += -(-n // 4) * 4  # each array 16-byte aligned, as the specialisation assumes
    ints = (B, T, D, p["examples_per_program"], p["n_chunks"], p["rows_per_chunk"], *offsets, n_programs,
            finish["units_per_group"], n_groups)
    if looped:
        block = min(LOOPED_BLOCK_D, max_block_d)
        num_warps = _num_warps(block)
        meta = dict(BLOCK_D=block, RMS=rms)
    else:
        block_d = triton.next_power_of_2(D)
        num_warps = _num_warps(p["rows_per_tile"] * block_d, tuning["values_per_thread"])
        meta = dict(WHOLE=whole, BLOCK_D=block_d, ROWS=p["rows_per_tile"], RMS=rms)
    # the finishing sums walk the rows in [TILE, BLOCK_C] tiles sized to the kernel's threads
    finish_tile = num_warps * 32 * FINISH_VALUES_PER_THREAD
    block_c = min(triton.next_power_of_2(D), finish_tile)
    meta.update(NEED_DW=need_dw, NEED_DB=need_db, BLOCK_C=block_c, TILE=min(32, finish_tile // block_c),
                num_warps=num_warps, **LAUNCH)
    return _remember(_backward_plans, key, dict(p, workspace=size, counters=n_groups + 1, ints=ints,
                                                launch=_Launch((n_programs,), meta), **finish))


def _scratch(device, floats, counters):
    """The backward's float32 scratch and its int32 counters, zero (each launch puts back those it
    counts with), new for each launch: from the caching allocator, or under CUDA graph capture
    from the graph's own pool, so that no other launch or graph shares them."""
    return (torch.empty(floats, dtype=torch.float32, device=device),
            torch.zeros(counters, dtype=torch.int32, device=device))


def backward(dy2d, x2d, weight, mean, rstd, num_examples, need_dw, need_db, weight_sq, bias_sq, count,
             max_block_d=MAX_BLOCK_D, target_programs=None, min_rows_per_chunk=None):
    """
    dx, dw, db (None where not needed) for contiguous dy2d, x2d [N, D] (or [..., D], dx then of
    x's shape, as in forward); adds Σ_b ||dγ_b||², Σ_b ||dβ_b||² to weight_sq, bias_sq and
    num_examples to count, all on the device, in one launch. mean None: RMSNorm (need_db False).
    max_block_d, target_programs and min_rows_per_chunk pick the kernel variant and the
    work split (the tests use them to reach every path at small sizes); left out, the work is
    shared out as BACKWARD_TUNING says.
    """
    D = x2d.shape[-1]
    N = x2d.numel() // D
    index = x2d.get_device()
    rms = mean is None
    key = (N, D, num_examples, need_dw, need_db, rms, x2d.dtype, dy2d.dtype, weight.dtype, index, max_block_d,
           target_programs, min_rows_per_chunk, *BACKWARD_TUNING.values())
    plan = _backward_plans.get(key)
    if plan is None:
        plan = _backward_plan(key, num_examples, N // num_examples, D, need_dw, need_db, rms,
                              target_programs or _target_programs(index), max_block_d,
                              min_rows_per_chunk or BACKWARD_TUNING["min_rows_per_chunk"])
    dx = torch.empty_like(x2d)
    dw = torch.empty_like(weight) if need_dw else None
    db = torch.empty_like(weight) if need_db else None
    work, counters = _scratch(x2d.device, plan["workspace"], plan["counters"])
    # work stands in for what is not needed, never read nor written
    args = (x2d, dy2d, dx, weight, rstd if rms else mean, rstd, work if dw is None else dw, work if db is None else db,
            weight_sq, work if bias_sq is None else bias_sq, count, work, counters, *plan["ints"])
    with _on_device(index):
        plan["launch"](_backward_kernel_looped if plan["looped"] else _backward_kernel, args, _current_stream(index),
                       _aligned(dy2d, x2d, weight, mean, rstd, weight_sq, bias_sq, count))
    return dx, dw, db
