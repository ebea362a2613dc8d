"""
The Triton kernels of normgnorm run on CPU by the Triton interpreter, against the float64
oracles of test_normgnorm.py. Not collected by itself (the name does not start with test_):
test_normgnorm.py::test_triton_kernels_interpreted runs it in a fresh process with
TRITON_INTERPRET=1, which must be set before triton is first imported. Shapes are small: the
interpreter takes about a millisecond per program.
"""
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through test_normgnorm.py (needs TRITON_INTERPRET=1 before triton is imported)",
                allow_module_level=True)
pytest.importorskip("triton")

import nanogns.normgnorm as normgnorm  # noqa: E402
from nanogns.normgnorm import plan, triton_kernels  # noqa: E402
from test_normgnorm import (BUFFER_TOL, DTYPES, ENTRIES, EPS, LAYERS, RMS_ENTRIES, SHAPES, TOL,  # noqa: E402
                            check_layer_compiled, check_op, check_peglayernorm_compiled, make_inputs, oracle)


@pytest.fixture
def no_torch_path(monkeypatch):
    """Make sure the op's "triton" backend really runs the kernels, not the PyTorch path."""
    def refuse(*args, **kwargs):
        raise AssertionError("the PyTorch path ran instead of the Triton kernels")
    monkeypatch.setattr(normgnorm.torch_path, "forward", refuse)
    monkeypatch.setattr(normgnorm.torch_path, "backward", refuse)


def test_triton_backend_runs_on_cpu_under_the_interpreter():
    assert normgnorm.resolve_backend("triton", torch.zeros(1, 2)) == "triton"
    assert normgnorm.resolve_backend("", torch.zeros(1, 2)) == "cpu"  # never by default off GPU


def run_kernels(shape, dtype, bias, need_dw=True, need_db=True, x_scale=1.0, rms=False, **plan_args):
    """Forward + backward straight through the kernels (rms: RMSNorm's, bias False), checked against the oracle."""
    x, dy, weight, b = make_inputs(shape, dtype, bias, seed=3)
    x = x * x_scale
    D = shape[-1]
    B = shape[0] if len(shape) >= 2 else 1
    fwd_args = {k: v for k, v in plan_args.items() if k == "max_block_d"}
    y, mean, rstd = triton_kernels.forward(x.reshape(-1, D), weight, b, EPS, rms=rms, **fwd_args)
    f32 = dict(dtype=torch.float32)
    # start the buffers away from zero: the kernels must add to them
    sq_w, sq_b, count = torch.full((), 0.5, **f32), torch.full((), 0.25, **f32), torch.full((), 2.0, **f32)
    need_db = need_db and bias
    dx, dw, db = triton_kernels.backward(dy.reshape(-1, D), x.reshape(-1, D), weight, mean, rstd, B, need_dw, need_db,
                                  sq_w, sq_b if bias else None, count, **plan_args)
    ref = oracle(x, weight, b, dy, rms)
    tol = TOL[dtype]
    torch.testing.assert_close(y.view(shape).double(), ref["y"].to(dtype).double(), **tol)
    torch.testing.assert_close(dx.view(shape).double(), ref["dx"].to(dtype).double(), **tol)
    if rms:
        assert mean is None
    else:
        torch.testing.assert_close(mean, x.reshape(-1, D).double().mean(1).float(), rtol=1e-5, atol=1e-5)
    if need_dw:
        torch.testing.assert_close(dw.double(), ref["dw"].to(dtype).double(), **tol)
        torch.testing.assert_close(sq_w.double(), 0.5 + ref["sq_w"], **BUFFER_TOL)
    else:
        assert dw is None and sq_w.item() == 0.5
    if need_db:
        torch.testing.assert_close(db.double(), ref["db"].to(dtype).double(), **tol)
        torch.testing.assert_close(sq_b.double(), 0.25 + ref["sq_b"], **BUFFER_TOL)
    else:
        assert db is None and sq_b.item() == 0.25
    assert count.item() == 2 + B


# (shape, plan arguments, the plan they must produce): every way the backward shares out rows
KERNEL_CASES = {
    "whole, one example a program": ((3, 5, 40), dict(target_programs=4), dict(whole=True, examples_per_program=1)),
    "whole, three examples a program": ((7, 3, 40), dict(target_programs=3), dict(whole=True, examples_per_program=3)),
    "split into chunks": ((2, 10, 40), dict(target_programs=8, min_rows_per_chunk=3),  # last chunk: 1 row
                          dict(whole=False, n_chunks=4, rows_per_chunk=3)),
    "looped, split": ((2, 6, 24), dict(target_programs=8, min_rows_per_chunk=2, max_block_d=16),
                      dict(looped=True, n_chunks=3)),
    "looped, whole examples": ((5, 2, 40), dict(target_programs=2, max_block_d=16),
                               dict(looped=True, n_chunks=1, examples_per_program=1)),
    "2-D, many examples": ((9, 24), dict(target_programs=4), dict(whole=True, examples_per_program=3)),
    # as on a GPU: the forward over several programs of 64 rows (the last one partial), the
    # backward over two tiles of rows
    "whole, many rows": ((2, 65, 40), dict(target_programs=2), dict(whole=True, examples_per_program=1)),
    "split, two column blocks": ((2, 10, 100), dict(target_programs=8, min_rows_per_chunk=3),
                                 dict(whole=False, n_chunks=4)),
    # as on a GPU, each example's chunks take more than one tile of the reduction (CHUNK_TILE 32)
    "split, more chunks than a tile": ((2, 40, 8), dict(target_programs=80, min_rows_per_chunk=1),
                                       dict(whole=False, n_chunks=40)),
}


@pytest.mark.parametrize("case", list(KERNEL_CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_kernels_every_plan(case, dtype):
    shape, plan_args, expected = KERNEL_CASES[case]
    B, D = shape[0], shape[-1]
    T = (torch.Size(shape).numel() // D) // B
    got = plan.plan_backward(B, T, D, plan_args["target_programs"],
                             plan_args.get("max_block_d", triton_kernels.MAX_BLOCK_D),
                             plan_args.get("min_rows_per_chunk", plan.MIN_ROWS_PER_CHUNK))
    assert {k: got[k] for k in expected} == expected
    run_kernels(shape, dtype, bias=True, **plan_args)


@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_triton_rms_kernels_every_plan(case):
    """RMSNorm: the same kernels without the mean, through every plan (float32; the half
    precisions on two plans below)."""
    shape, plan_args, _ = KERNEL_CASES[case]
    run_kernels(shape, torch.float32, bias=False, need_db=False, rms=True, **plan_args)


@pytest.mark.parametrize("case", ["whole, three examples a program", "looped, split"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_triton_rms_kernels_half_precision(case, dtype):
    shape, plan_args, _ = KERNEL_CASES[case]
    run_kernels(shape, dtype, bias=False, need_db=False, rms=True, **plan_args)


@pytest.mark.parametrize("needs", [(True, False), (False, True), (False, False)])
@pytest.mark.parametrize("case", ["whole, three examples a program", "split into chunks", "looped, split"])
def test_triton_kernels_some_parameters_frozen(case, needs):
    shape, plan_args, _ = KERNEL_CASES[case]
    run_kernels(shape, torch.float32, bias=True, need_dw=needs[0], need_db=needs[1], **plan_args)


@pytest.mark.parametrize("case", ["whole, three examples a program", "split into chunks"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_kernels_several_tiles_a_program(monkeypatch, case, dtype):
    """On a GPU a program walks its rows a few at a time (4 rows of 768 a tile, 32 rows a chunk);
    at these small shapes one tile would hold them all, so make tiles of two rows."""
    monkeypatch.setitem(triton_kernels.BACKWARD_TUNING, "max_tile", 128)
    shape, plan_args, _ = KERNEL_CASES[case]
    run_kernels(shape, dtype, bias=True, **plan_args)


@pytest.mark.parametrize("rms", [False, True], ids=["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("max_block_d", [triton_kernels.MAX_BLOCK_D, 16], ids=["in registers", "looped"])
def test_triton_kernels_rows_with_variance_near_eps(max_block_d, rms):
    # x's spread ~1e-3 (variance or mean square ~1e-6, eps 1e-5): eps sets most of rstd, so it must be there
    run_kernels((3, 4, 24), torch.float32, bias=not rms, x_scale=5e-4, rms=rms, target_programs=3,
                max_block_d=max_block_d)


@pytest.mark.parametrize("frozen", [False, True])
def test_triton_rms_kernels_several_tiles_a_program_or_frozen(monkeypatch, frozen):
    monkeypatch.setitem(triton_kernels.BACKWARD_TUNING, "max_tile", 128)
    shape, plan_args, _ = KERNEL_CASES["split into chunks"]
    run_kernels(shape, torch.bfloat16, bias=False, need_dw=not frozen, need_db=False, rms=True, **plan_args)


# (shape, plan arguments, the finishing plan they must produce): several groups of several units
FINISH_CASES = {
    "whole": ((40, 2, 70), dict(target_programs=40), dict(whole=True, units_per_group=6, n_groups=7)),
    "split": ((12, 6, 70), dict(target_programs=36, min_rows_per_chunk=2),
              dict(whole=False, n_chunks=3, units_per_group=2, n_groups=6)),
    "looped": ((4, 6, 24), dict(target_programs=12, min_rows_per_chunk=2, max_block_d=16),
               dict(looped=True, n_chunks=3, units_per_group=1, n_groups=4)),
}


@pytest.mark.parametrize("case", list(FINISH_CASES))
def test_triton_finishing_sums_over_many_groups_and_tiles(monkeypatch, case):
    """On a GPU the backward's last programs sum hundreds of partial rows, in groups, a tile of
    rows and columns at a time: here the tiles are tiny (one value a thread: one row of 32
    columns) and the groups several, so that every sum walks several tiles of rows and columns."""
    monkeypatch.setattr(triton_kernels, "FINISH_VALUES_PER_THREAD", 1)
    monkeypatch.setattr(triton_kernels, "_backward_plans", {})
    shape, plan_args, expected = FINISH_CASES[case]
    run_kernels(shape, torch.float32, bias=True, **plan_args)
    (plan,) = triton_kernels._backward_plans.values()
    assert {k: plan[k] for k in expected} == expected
    assert plan["launch"].meta["TILE"] == 1 and plan["launch"].meta["BLOCK_C"] == 32


@pytest.fixture
def scratch(monkeypatch):
    """Each backward launch's (scratch, counters), as _scratch made them."""
    made = []

    def recorded(device, floats, counters):
        made.append(real(device, floats, counters))
        return made[-1]
    real = triton_kernels._scratch
    monkeypatch.setattr(triton_kernels, "_scratch", recorded)
    return made


def test_triton_backward_puts_its_counters_back_to_zero(scratch):
    """The counters a launch counts with are zero again when it ends, in every mode."""
    for case in ["split into chunks", "whole, three examples a program", "looped, split"]:
        shape, plan_args, _ = KERNEL_CASES[case]
        run_kernels(shape, torch.float32, bias=True, **plan_args)
    assert len(scratch) == 3 and all(counters.count_nonzero() == 0 for _, counters in scratch)


@pytest.mark.parametrize("case", ["split into chunks", "whole, three examples a program", "looped, split"])
def test_triton_backward_leaves_nan_where_no_program_is_counted_last(monkeypatch, case):
    """Program 0 fills dγ, dβ with NaN and the last program writes them: with counters that never
    reach the count (no program is last), the gradients are NaN, whatever memory they were given."""
    real = triton_kernels._scratch
    monkeypatch.setattr(triton_kernels, "_scratch",
                        lambda device, floats, counters: (real(device, floats, counters)[0],
                                                          torch.full((counters,), 1000, dtype=torch.int32)))
    monkeypatch.setattr(torch, "empty_like", lambda t, **kw: torch.zeros_like(t, **kw))  # not NaN by chance
    shape, plan_args, _ = KERNEL_CASES[case]
    x, dy, weight, b = make_inputs(shape, torch.float32, True, seed=3)
    D = shape[-1]
    y, mean, rstd = triton_kernels.forward(x.reshape(-1, D), weight, b, EPS,
                                           **{k: v for k, v in plan_args.items() if k == "max_block_d"})
    bufs = [torch.zeros(()) for _ in range(3)]
    dx, dw, db = triton_kernels.backward(dy.reshape(-1, D), x.reshape(-1, D), weight, mean, rstd, shape[0], True, True,
                                         *bufs, **plan_args)
    assert dw.isnan().all() and db.isnan().all()
    assert bufs[0].item() == 0 and bufs[1].item() == 0  # the last program's sums never ran


def test_triton_kernels_no_bias_non_power_of_two():
    run_kernels((3, 6, 33), torch.bfloat16, bias=False, target_programs=6, min_rows_per_chunk=3)


@pytest.mark.parametrize("shape", ["3d", "2d", "1d"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_op_matches_oracles(no_torch_path, dtype, bias, shape):
    check_op(SHAPES[shape], dtype, bias, backend="triton")


@pytest.mark.parametrize("entry", ["PEGLayerNorm"])
@pytest.mark.parametrize("bias", [True, False])
def test_triton_other_entries_match_oracles(no_torch_path, bias, entry):
    """The reference-style PEGLayerNorm call reaches the same kernels as layer_norm's eager call above."""
    check_op(SHAPES["3d"], torch.bfloat16, bias, backend="triton", layer_norm=ENTRIES[entry])


def test_triton_eager_call_skips_the_custom_op(no_torch_path):
    x, _, weight, b = make_inputs((2, 3, 8), torch.float32, True, seed=2)
    x.requires_grad_()
    y = normgnorm.layer_norm(x, weight, b, torch.zeros(()), torch.zeros(()), torch.zeros(()), EPS, "triton")
    assert type(y.grad_fn).__name__ == "_NormFnBackward"  # ours, not the reference adapter


@pytest.mark.parametrize("layer", ["LayerNorm", "RMSNorm"])
def test_triton_layer_compiled_matches_its_eager_kernels(layer):
    """Compiled, a layer asking for Triton runs the compiled route (the torch path); eagerly, the
    kernels: the same gradients and buffers, and no graph break."""
    check_layer_compiled(LAYERS[layer], "triton")


@pytest.mark.parametrize("shape", ["3d", "2d", "1d"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_rms_op_matches_oracles(no_torch_path, dtype, shape):
    check_op(SHAPES[shape], dtype, False, backend="triton", layer_norm=RMS_ENTRIES["rms eager"])


def test_triton_peglayernorm_compiles_to_the_torch_path():
    """Called directly under torch.compile, PEGLayerNorm asking for Triton traces the torch path
    (the kernels, traced as they are, would run on fake tensors): as its eager call of the kernels."""
    check_peglayernorm_compiled((2, 4, 40), "triton")


