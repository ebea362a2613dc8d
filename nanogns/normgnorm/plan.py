"""
How the fused backward shares the rows of x2d [N = B*T, D] among GPU programs (Triton
programs or CUDA blocks); the same plan for both kernels. Pure Python (no Triton needed).

- "whole" mode: a program owns whole examples (several when there are more examples than
  programs wanted), so it finishes each dγ_b, dβ_b itself and squares them.
- "split" mode: few long examples, each split into n_chunks runs of rows_per_chunk rows;
  a second kernel sums each example's chunks before squaring.
Each program writes one float32 partial row [D] per parameter: n_programs * D floats, far
less than a [B, T, D] temporary as long as a chunk has many rows (MIN_ROWS_PER_CHUNK).

The Triton backward then sums those rows in the same launch (plan_finish): the programs are
grouped, the last program of a group to finish sums its group's rows, and the last group to
finish sums the groups' rows into the parameter gradients.
"""
import math
MIN_ROWS_PER_CHUNK = 32   # split mode: the partial rows stay a few percent of the traffic
MAX_TILE = 4096           # Triton: elements of a [rows, BLOCK_D] tile of short rows


def cdiv(a, b):
    return -(-a // b)


def next_power_of_2(n):
    return 1 << (n - 1).bit_length()


def plan_backward(num_examples, T, D, target_programs, max_block_d=None, min_rows_per_chunk=MIN_ROWS_PER_CHUNK,
                  max_tile=MAX_TILE, max_chunks=None):
    """
    A dict: looped (rows wider than max_block_d: the Triton kernel walks the row in pieces and,
    with one partial row per example, never takes several examples), whole, n_chunks,
    rows_per_chunk, examples_per_program, n_programs, rows_per_tile (Triton's rows per tile).
    max_chunks: the most chunks an example is split into (None: as many as target_programs asks).
    """
    looped = max_block_d is not None and next_power_of_2(D) > max_block_d
    if num_examples >= target_programs:  # enough examples: whole examples per program
        n_chunks, rows_per_chunk = 1, T
        examples_per_program = 1 if looped else cdiv(num_examples, target_programs)
    else:  # few long examples: split each into chunks of at least min_rows_per_chunk rows
        n_chunks = max(1, min(cdiv(target_programs, num_examples), cdiv(T, min_rows_per_chunk), max_chunks or T))
        rows_per_chunk = cdiv(T, n_chunks)
        n_chunks = cdiv(T, rows_per_chunk)
        examples_per_program = 1
    n_programs = cdiv(num_examples, examples_per_program) * n_chunks
    # as many rows per tile as fit max_tile, but no more than a program has
    rows_per_tile = 1 if looped else min(max(1, max_tile // next_power_of_2(D)), next_power_of_2(rows_per_chunk))
    return dict(looped=looped, whole=n_chunks == 1 and not looped, n_chunks=n_chunks,
                rows_per_chunk=rows_per_chunk, examples_per_program=examples_per_program,
                n_programs=n_programs, rows_per_tile=rows_per_tile)


def plan_finish(n_units, rows_per_unit):
    """
    How the backward's own programs sum its partial rows once they are written, as a dict. A unit
    is what one squared norm needs: a program of whole examples (rows_per_unit 1), or the
    rows_per_unit chunks of one split example. units_per_group units make a group, whose last
    program sums the group's rows_per_unit * units_per_group rows; the last group then sums the
    n_groups group rows. About as many rows each: groups of sqrt(n_units / rows_per_unit) units.
    """
    units_per_group = max(1, math.isqrt(n_units // rows_per_unit))
    return dict(units_per_group=units_per_group, n_groups=cdiv(n_units, units_per_group))
