"""
The Triton kernels compiled for a GPU that is not here: every launch that
triton_kernels.forward/backward would make for a given input, compiled by Triton's own
compiler (to PTX, then ptxas to a cubin) for a chosen architecture, with the resources
ptxas gave each kernel. This catches what the CPU interpreter cannot (code that does not
lower to GPU code, register spills at wide rows) on a machine with no GPU and no driver.

Launches are recorded, not run: the launchers are called on meta tensors of the right shapes
and dtypes with the kernels swapped for recorders, and each recorded call is specialised the
way a real launch is (Triton's own argument binder: dtypes, 16-byte alignment, divisibility).

    from nanogns.normgnorm import triton_aot
    for launch in triton_aot.backward_launches((8, 2048, 768), torch.bfloat16, sm_count=132):
        print(triton_aot.compile_launch(launch, arch=90))
"""
import os
import subprocess
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from . import triton_kernels

KERNELS = ("_forward_kernel", "_forward_kernel_looped", "_backward_kernel", "_backward_kernel_looped")


@dataclass
class Launch:
    kernel: object   # the triton.jit function
    grid: tuple
    args: tuple
    kwargs: dict     # constexprs and launch options (num_warps)

    @property
    def name(self):
        return self.kernel.fn.__name__


class _Recorder:
    """Stands in for a kernel: `kernel[grid](*args, **kwargs)` appends a Launch instead of running."""

    def __init__(self, kernel, launches):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append(Launch(self.kernel, tuple(grid), args, kwargs))


@contextmanager
def _recording():
    launches = []
    originals = {name: getattr(triton_kernels, name) for name in KERNELS}
    try:
        for name, kernel in originals.items():
            setattr(triton_kernels, name, _Recorder(kernel, launches))
        yield launches
    finally:
        for name, kernel in originals.items():
            setattr(triton_kernels, name, kernel)


def _inputs(shape, dtype, bias):
    # meta tensors: shapes and dtypes without memory (their address, 0, is aligned as a GPU
    # allocation's is, so the launch is specialised the same way)
    D = shape[-1]
    meta = dict(dtype=dtype, device="meta")
    x2d = torch.empty(shape, **meta).reshape(-1, D)
    return x2d, torch.empty(D, **meta), (torch.empty(D, **meta) if bias else None)


def forward_launches(shape, dtype, bias=True, rms=False, **kwargs):
    """The launches of triton_kernels.forward for an input of this shape (rms: RMSNorm, which has
    no bias; kwargs: max_block_d)."""
    x2d, weight, b = _inputs(shape, dtype, bias and not rms)
    with _recording() as launches:
        triton_kernels.forward(x2d, weight, b, 1e-5, rms=rms, **kwargs)
    return launches


def backward_launches(shape, dtype, bias=True, need_dw=True, need_db=True, sm_count=132, rms=False, **kwargs):
    """
    The launches of triton_kernels.backward for an input of this shape, work shared out as on a
    GPU with sm_count multiprocessors (132: H100 SXM; 108: A100); rms: RMSNorm's (no bias, no
    mean). kwargs go to the launcher.
    """
    bias = bias and not rms
    x2d, weight, b = _inputs(shape, dtype, bias)
    N = x2d.shape[0]
    f32 = dict(dtype=torch.float32, device="meta")
    mean, rstd = None if rms else torch.empty(N, **f32), torch.empty(N, **f32)
    kwargs.setdefault("target_programs", triton_kernels.BACKWARD_TUNING["programs_per_sm"] * sm_count)
    with _recording() as launches:
        triton_kernels.backward(x2d.clone(), x2d, weight, mean, rstd, shape[0] if len(shape) >= 2 else 1,
                                need_dw, need_db and bias, torch.empty((), **f32),
                                torch.empty((), **f32) if bias else None, torch.empty((), **f32), **kwargs)
    return launches


# Per multiprocessor, sm_80 (A100) and sm_90 (H100): registers, shared memory a program may
# use, resident warps and programs (CUDA C Programming Guide, "Compute Capabilities").
SM_LIMITS = {80: dict(registers=65536, shared=163 * 1024, warps=64, programs=32),
             90: dict(registers=65536, shared=227 * 1024, warps=64, programs=32)}


def programs_per_sm(arch, registers, num_warps, shared_bytes):
    """How many programs of this kernel fit on one multiprocessor at once (its occupancy is
    this times num_warps over 64 warps). Registers are allocated per warp in units of 256."""
    limits = SM_LIMITS[arch]
    registers_per_warp = -(-registers * 32 // 256) * 256
    by_registers = limits["registers"] // registers_per_warp // num_warps
    by_shared = limits["shared"] // shared_bytes if shared_bytes else limits["programs"]
    return min(by_registers, by_shared, limits["warps"] // num_warps, limits["programs"])


@dataclass
class Compiled:
    name: str
    grid: tuple
    num_warps: int
    registers: int     # per thread
    stack_bytes: int   # per thread: these kernels have no local arrays, so this is ptxas's register spills
    shared_bytes: int  # per program (static, as Triton reports it)
    arch: int
    asm: dict = field(default=None, repr=False)  # the compiler's stages' text by name ("ttir", "ptx", ...)

    @property
    def programs_per_sm(self):
        return programs_per_sm(self.arch, self.registers, self.num_warps, self.shared_bytes)

    def __str__(self):
        return (f"{self.name} sm_{self.arch} grid {self.grid} warps {self.num_warps}: {self.registers} registers, "
                f"{self.stack_bytes} B stack (spills), {self.shared_bytes} B shared, "
                f"{self.programs_per_sm} programs per SM")


def _resource_usage(cubin):
    """Registers and stack frame (spills) of the cubin's one function, from the cuobjdump that ships with Triton."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    fields = dict(item.split(":", 1) for line in text.splitlines() if "REG:" in line for item in line.split())
    return int(fields["REG"]), int(fields["STACK"]) + int(fields["LOCAL"])


def compile_launch(launch, arch=90):
    """Compile one recorded launch for sm_<arch> (80: A100, 90: H100) exactly as a GPU launch would."""
    kernel = launch.kernel
    backend = make_backend(GPUTarget("cuda", arch, 32))
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, options, bound, specialization, options)
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=backend.target,
                              options=options.__dict__)
    registers, stack_bytes = _resource_usage(compiled.asm["cubin"])
    return Compiled(launch.name, launch.grid, compiled.metadata.num_warps, registers, stack_bytes,
                    compiled.metadata.shared, arch, compiled.asm)
