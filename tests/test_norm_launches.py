"""
What one eager normalisation call costs the host on a GPU, counted on the CPU: the GPU route's
Python runs with Triton's kernels swapped for stand-ins that record each launch instead of
running it (the Triton kernels' arithmetic is checked in normgnorm_triton_interpreted.py).
Counted per forward+backward after the first: launches, and through which door (Triton's JIT
launcher, which binds and specialises every argument, or the compiled kernel's own launcher),
and the tensors made (factory ops and every other op whose result is a new tensor).
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

import nanogns.normgnorm as normgnorm  # noqa: E402
from nanogns.normgnorm import triton_kernels  # noqa: E402


class _Compiled:
    """Stands in for Triton's CompiledKernel: what a JIT launch returns, with the launcher (run)
    and what it is handed (function, packed_metadata)."""

    def __init__(self, name, log):
        self.name, self.log = name, log
        self.function, self.packed_metadata = f"function of {name}", f"metadata of {name}"

    def run(self, grid_x, grid_y, grid_z, stream, function, packed_metadata, launch_metadata, enter_hook,
            exit_hook, *args):
        assert (function, packed_metadata) == (self.function, self.packed_metadata)
        self.log.append(("direct", self.name, (grid_x, grid_y, grid_z), args))


class _Jit:
    """Stands in for a triton.jit kernel: kernel[grid](*args, **meta) records the launch and
    returns a _Compiled."""

    def __init__(self, kernel, log):
        self.kernel, self.log = kernel, log
        self.arg_names, self.fn = kernel.arg_names, kernel.fn

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.log.append(("jit", self.kernel.fn.__name__, tuple(grid), args, meta))
            return _Compiled(self.kernel.fn.__name__, self.log)
        return launch


@pytest.fixture
def launches(monkeypatch):
    """Every kernel of triton_kernels recorded instead of run, on CPU tensors as if on a GPU
    (TRITON_INTERPRET=1 lets the "triton" backend take them), with the module's caches empty
    before and after (a recorded kernel must never be launched by another test)."""
    log = []
    for name, value in list(vars(triton_kernels).items()):
        if isinstance(value, triton.runtime.JITFunction) and "_kernel" in name:
            monkeypatch.setattr(triton_kernels, name, _Jit(value, log))
    for cache in ("_launches", "_workspaces", "_forward_plans", "_backward_plans", "_compiled"):
        if hasattr(triton_kernels, cache):
            monkeypatch.setattr(triton_kernels, cache, {})
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("NORMGNORM_BACKEND", raising=False)
    return log


class _NewTensors(TorchDispatchMode):
    """Records each op whose result is a new tensor: not a view, not in place (neither aliases an input)."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        if returns and all(r.alias_info is None for r in returns):
            outs = out if isinstance(out, (tuple, list)) else (out,)
            self.made += [(str(func), tuple(t.shape)) for t in outs if isinstance(t, torch.Tensor)]
        return out


def _layer_call(D, bias, rms, dtype=torch.bfloat16):
    weight = torch.randn(D, dtype=dtype, requires_grad=True)
    b = torch.randn(D, dtype=dtype, requires_grad=True) if bias and not rms else None
    bufs = [torch.zeros(()), torch.zeros(()) if b is not None else None, torch.zeros(())]
    if rms:
        def call(x):
            return normgnorm.rms_norm(x, weight, bufs[0], bufs[2], 1e-6, backend="triton")
    else:
        def call(x):
            return normgnorm.layer_norm(x, weight, b, *bufs, 1e-5, backend="triton")
    return call, [weight] + ([b] if b is not None else [])


def _forward_backward(call, params, x, dy, log):
    """(launches, tensors made) of the forward, then of the backward."""
    counted = []
    for step in ("forward", "backward"):
        del log[:]
        with _NewTensors() as made:
            if step == "forward":
                y = call(x)
            else:
                torch.autograd.grad(y, [x] + params, dy)
        counted.append((list(log), made.made))
    return counted


CASES = {  # shape, bias, rms: whole examples a program, split examples, wide rows (looped kernels)
    "LayerNorm, split": ((8, 64, 48), True, False),
    "LayerNorm, whole, no bias": ((16, 4, 48), False, False),
    "LayerNorm, looped": ((2, 8, 16384), True, False),
    "RMSNorm, split": ((8, 64, 48), False, True),
    "RMSNorm, looped": ((2, 8, 16384), False, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_one_call_launches_at_most_twice_through_the_compiled_kernel_and_makes_only_its_outputs_and_scratch(
        launches, case, monkeypatch):
    shape, bias, rms = CASES[case]
    # as on a GPU: many programs (an H100's 132 multiprocessors), so that split mode splits
    monkeypatch.setattr(triton_kernels, "_target_programs", lambda device: 4 * 132)
    x = torch.randn(shape, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    call, params = _layer_call(shape[-1], bias, rms)
    _forward_backward(call, params, x, dy, launches)  # the first call compiles (Triton's launcher)
    (fwd_launches, fwd_made), (bwd_launches, bwd_made) = _forward_backward(call, params, x, dy, launches)

    every = fwd_launches + bwd_launches
    assert [entry[0] for entry in every] == ["direct"] * len(every), every
    assert len(fwd_launches) == 1 and 1 <= len(bwd_launches) and len(every) <= 2, [e[:3] for e in every]
    N, D = x.numel() // shape[-1], shape[-1]
    sizes = lambda made: sorted(torch.Size(shape).numel() for _, shape in made)  # noqa: E731
    # the forward's outputs: y and the saved statistics torch saves (mean and rstd; RMSNorm: rstd)
    assert sizes(fwd_made) == sorted([x.numel()] + [N] * (1 if rms else 2)), fwd_made
    # the backward's: dx, the parameters' gradients, and the launch's own scratch and counters
    (plan,) = triton_kernels._backward_plans.values()
    assert sizes(bwd_made) == sorted([x.numel()] + [D] * len(params) + [plan["workspace"], plan["counters"]]), bwd_made


def test_the_direct_launch_hands_the_compiled_kernel_what_triton_would(launches):
    """The compiled kernel's launcher takes every parameter in order, the constexprs last, and
    a 3-D grid: the same call that Triton's own launcher ends with."""
    x = torch.randn(4, 8, 48, requires_grad=True)
    call, params = _layer_call(48, True, False, torch.float32)
    y = call(x)
    y = call(x)
    jit, direct = [entry for entry in launches if entry[1] == "_forward_kernel"]
    _, name, grid, args, meta = jit
    assert direct[:2] == ("direct", name)
    assert direct[2] == tuple(grid) + (1,) * (3 - len(grid))
    constexprs = tuple(meta[n] for n in triton_kernels._forward_kernel.arg_names[len(args):])
    assert len(direct[3]) == len(args) + len(constexprs) and direct[3][len(args):] == constexprs
    for direct_arg, arg in zip(direct[3], args):  # the same tensors' kinds, the same integers and eps
        if isinstance(arg, torch.Tensor):
            assert (direct_arg.shape, direct_arg.dtype) == (arg.shape, arg.dtype)
        else:
            assert direct_arg == arg
    assert direct[3][0] is x.detach() or direct[3][0].data_ptr() == x.data_ptr()
    del y


def test_each_backward_launch_gets_scratch_and_zero_counters_of_its_own(launches, monkeypatch):
    """No workspace is kept between launches (two streams or two CUDA graphs would share it): each
    launch is handed new float32 scratch and new zero int32 counters, sized by its plan, that
    nothing else holds."""
    monkeypatch.setattr(triton_kernels, "_target_programs", lambda device: 4 * 132)
    call, params = _layer_call(48, True, False, torch.float32)
    names = triton_kernels._backward_kernel.arg_names
    held = []
    for shape in [(8, 64, 48), (8, 64, 48), (4, 32, 48)]:
        x = torch.randn(shape, requires_grad=True)
        triton_kernels._backward_plans.clear()
        torch.autograd.grad(call(x), [x] + params, torch.randn(shape))
        (plan,) = triton_kernels._backward_plans.values()
        args = [entry for entry in launches if entry[1] == "_backward_kernel"][-1][3]
        work, counters = args[names.index("Work")], args[names.index("Counters")]
        assert work.dtype == torch.float32 and work.numel() == plan["workspace"]
        assert counters.dtype == torch.int32 and counters.numel() == plan["counters"]
        assert counters.count_nonzero() == 0
        held.append((work, counters))
    # while held, no two launches' scratch or counters are one memory
    pointers = [t.data_ptr() for pair in held for t in pair if t.numel()]
    assert len(set(pointers)) == len(pointers)


def test_a_launch_runs_on_its_tensors_device_whichever_is_current(monkeypatch):
    """Triton launches on the current CUDA device: a tensor on another needs the device switched
    for its launch, and only then (off GPU, and on the current device, nothing is made)."""
    current = [0]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    switched = []
    monkeypatch.setattr(torch.cuda, "device", lambda index: switched.append(index) or "guard")
    assert triton_kernels._on_device(-1) is triton_kernels._NO_GUARD
    assert triton_kernels._on_device(0) is triton_kernels._NO_GUARD and switched == []
    assert triton_kernels._on_device(1) == "guard" and switched == [1]
    current[0] = 1
    assert triton_kernels._on_device(1) is triton_kernels._NO_GUARD and switched == [1]


def test_forward_and_backward_launch_inside_their_tensors_device_guard(launches, monkeypatch):
    """Each launch, the forward's and the backward's, happens inside _on_device of its tensors'
    device (here CPU tensors said to be on device 1)."""
    entered = []

    class Guard:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            entered.append(("enter", self.index, len(launches)))

        def __exit__(self, *exc):
            entered.append(("exit", self.index, len(launches)))

    monkeypatch.setattr(triton_kernels, "_on_device", Guard)
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 1)
    monkeypatch.setattr(triton_kernels, "_current_stream", lambda index: 0)
    monkeypatch.setattr(triton_kernels, "_target_programs", lambda index: 8)
    x = torch.randn(2, 8, 48, requires_grad=True)
    call, params = _layer_call(48, True, False, torch.float32)
    torch.autograd.grad(call(x), [x] + params, torch.randn_like(x))
    assert [entry[1] for entry in launches] == ["_forward_kernel", "_backward_kernel"]
    # each launch between an enter and an exit of device 1's guard
    assert entered == [("enter", 1, 0), ("exit", 1, 1), ("enter", 1, 1), ("exit", 1, 2)]


def test_NORMGNORM_TRITON_LAUNCH_decides_nothing(launches, monkeypatch):
    monkeypatch.setenv("NORMGNORM_TRITON_LAUNCH", "jit")
    x = torch.randn(2, 8, 48, requires_grad=True)
    call, params = _layer_call(48, True, False, torch.float32)
    for _ in range(2):
        del launches[:]
        torch.autograd.grad(call(x), [x] + params, torch.randn_like(x))
    assert launches and all(entry[0] == "direct" for entry in launches), launches


def test_unaligned_tensors_go_through_tritons_launcher_every_time(launches):
    """Triton compiles a kernel for its pointers' 16-byte alignment: a tensor that starts 4 bytes
    into its storage needs another compiled kernel, which Triton's launcher picks."""
    x = torch.randn(2, 8, 48, requires_grad=True)
    weight = torch.randn(49)[1:].requires_grad_()
    bufs = [torch.zeros(()), None, torch.zeros(())]
    for _ in range(3):
        del launches[:]
        y = normgnorm.layer_norm(x, weight, None, *bufs, 1e-5, backend="triton")
        torch.autograd.grad(y, [x, weight], torch.randn_like(x))
        assert launches and all(entry[0] == "jit" for entry in launches), launches


def test_a_launch_hook_sends_launches_through_tritons_launcher(launches, monkeypatch):
    """A profiler that hooks Triton's launches (triton.knobs.runtime.launch_enter_hook) still sees ours."""
    x = torch.randn(2, 8, 48, requires_grad=True)
    call, params = _layer_call(48, True, False, torch.float32)
    call(x)
    hooks = triton.knobs.runtime
    hook = hooks.launch_enter_hook
    if hasattr(hook, "calls"):  # Triton >= 3.7: a chain of hooks
        monkeypatch.setattr(hook, "calls", [print])
    else:
        monkeypatch.setattr(hooks, "launch_enter_hook", print)
    del launches[:]
    call(x)
    assert [entry[0] for entry in launches] == ["jit"]


def test_alignment_is_every_pointer_on_16_bytes():
    t = torch.zeros(8)
    assert triton_kernels._aligned(t, None, t[4:])       # 16 bytes in
    assert not triton_kernels._aligned(t, t[1:])          # 4 bytes in


@pytest.mark.parametrize("shape,target,max_block_d", [((8, 1024, 768), 528, 8192), ((600, 4, 1000), 528, 8192),
                                                      ((2, 10, 40), 8, 8192), ((2, 6, 24), 8, 16)])
@pytest.mark.parametrize("need", [(True, True), (True, False), (False, True)])
def test_backward_workspace_arrays_are_aligned_and_apart(shape, target, max_block_d, need, monkeypatch):
    monkeypatch.setattr(triton_kernels, "_backward_plans", {})
    B, D = shape[0], shape[-1]
    T = torch.Size(shape[1:-1]).numel()
    plan = triton_kernels._backward_plan(None, B, T, D, *need, False, target, max_block_d, 3)
    n_programs, n_groups = plan["n_programs"], plan["n_groups"]
    sizes = [n_programs * D * need[0], n_programs * D * need[1],
             n_programs * plan["whole"] * need[0], n_programs * plan["whole"] * need[1],
             n_groups * D * need[0], n_groups * D * need[1], n_groups * need[0], n_groups * need[1]]
    names = triton_kernels._backward_kernel.arg_names
    starts = plan["ints"][names.index("part_w_at") - names.index("num_examples"):][:len(sizes)]
    spans = sorted((start, start + size) for start, size in zip(starts, sizes) if size)
    assert all(start % 4 == 0 for start, _ in spans)  # 16 bytes of float32
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    assert spans[-1][1] <= plan["workspace"] and plan["counters"] == n_groups + 1
    # every program in one group or another, each group's units within the launch
    units = n_programs if plan["whole"] else B
    assert plan["units_per_group"] * (n_groups - 1) < units <= plan["units_per_group"] * n_groups
