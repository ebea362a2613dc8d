"""
The CPU backward as one native pass: csrc/normgnorm_cpu.c (plain C and OpenMP, no torch
headers), compiled with the system's C compiler ($CC, else cc) on first use, in well under a
second, into torch's extension cache, once per version of the source, compiler and CPU, and
called through ctypes. It computes dx, each example's dγ_b, dβ_b, their sums and the squared
norms reading x and dy once; the PyTorch path (torch_path.py) reads them three times and pays a
dozen op dispatches, which cost as much as a small LayerNorm. The output (forward) is torch's own.
The separated layers (nanogns.layers.norms), whose dx, dγ, dβ are torch's, take the per-example part
alone (per_example_grads).

What it does not take goes to the PyTorch path, with the same results: other dtypes than
float32, a frozen gain, a backward that records a graph (create_graph=True). Where no compiler
works, the PyTorch path runs everything, after one warning that says why. The extension shares
torch's OpenMP runtime (the same libgomp, loaded once), so its threads are torch's. It splits
the work by example, each thread owning whole examples (no atomics, and each dγ_b, dβ_b summed
in one order whatever the thread count), so it runs on min(torch's threads, examples) threads:
a batch smaller than the thread pool runs on fewer threads rather than not at all.
"""
import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import warnings

import torch
from torch.utils import cpp_extension

from . import torch_path

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "normgnorm_cpu.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
BUILD_TIMEOUT_S = 120
_kernel = None  # the loaded function, or the reason it could not be had (a str)


def compiler():
    return os.environ.get("CC") or shutil.which("cc") or "gcc"


def compiler_command():
    """The compiler as a command: $CC may carry arguments ("ccache gcc")."""
    return shlex.split(compiler()) or ["gcc"]


def library_path(build_dir=None):
    """Where build() keeps the library: named by a hash of the source, the compiler and the CPU,
    so that an edit recompiles and a home directory shared by unlike machines (-march=native)
    keeps one library per kind of CPU."""
    with open(SOURCE, "rb") as f:
        key = f.read() + " ".join([compiler(), *FLAGS, platform.machine(), _cpu_flags()]).encode()
    build_dir = build_dir or os.path.join(cpp_extension.get_default_build_root(), "normgnorm_cpu")
    return os.path.join(build_dir, f"normgnorm_cpu_{hashlib.sha1(key).hexdigest()[:16]}.so")


def _cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def build(build_dir=None):
    """Compile (unless built before) and load the kernel; returns the C function. Raises
    RuntimeError saying what failed."""
    path = library_path(build_dir)
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        # a name of its own for each build (threads and containers that share the cache can have
        # equal PIDs), in the same folder, renamed into place whole; removed if the build fails
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=os.path.basename(path) + ".", suffix=".tmp")
        os.close(fd)
        cmd = [*compiler_command(), *FLAGS, SOURCE, "-o", tmp]
        try:
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            except (OSError, subprocess.TimeoutExpired) as e:
                raise RuntimeError(f"{' '.join(cmd)}: {e}") from None
            if done.returncode != 0:
                first = (done.stderr.strip().splitlines() or ["no output"])[0]
                raise RuntimeError(f"{' '.join(cmd)} exited with {done.returncode}: {first}")
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    fn = ctypes.CDLL(path).normgnorm_cpu_backward
    fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 8 + [ctypes.c_int]
    fn.restype = None
    return fn


def kernel():
    """The C function, built on the first call; None (after one warning) if it cannot be built."""
    global _kernel
    if _kernel is None:
        try:
            _kernel = build()
        except (RuntimeError, OSError) as e:
            _kernel = str(e)
            warnings.warn(f"normgnorm: the CPU kernel could not be built ({e}); the PyTorch path runs instead "
                          "(slower; backend='torch' chooses it without trying)", stacklevel=2)
    return None if isinstance(_kernel, str) else _kernel


def _dense(t):
    """A tensor whose memory is its values, as the C code reads them: not a subclass (a DTensor, a
    functorch or fake tensor holds no such memory), strided. The rest goes to the PyTorch path."""
    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided


def _takes(tensors, buffers):
    """Whether the kernel takes these float32 inputs and 0-dim float32 buffers (None: not given).
    Any number of examples: fewer than torch's threads run on one thread each (_threads)."""
    return (not torch.is_grad_enabled()
            and all(t is None or (t.dtype == torch.float32 and _dense(t)) for t in (*tensors, *buffers))
            and all(b is None or (b.dtype == torch.float32 and b.device.type == "cpu" and b.dim() == 0) for b in buffers))


def _check_sizes(x, dy, mean, rstd, weight, num_examples):
    """The C code reads x, dy [N, D], mean and rstd [N] and weight [D] on trust: any other size
    would read past them. Refused here, in one line, before any call reaches it."""
    D = x.shape[-1] if x.dim() else 0
    N = x.numel() // D if D else 0
    problems = []
    if D == 0 or num_examples < 1 or N % num_examples:
        problems.append(f"x {tuple(x.shape)} is not {num_examples} examples of rows of features")
    if dy.shape != x.shape:
        problems.append(f"dy {tuple(dy.shape)} is not x's shape {tuple(x.shape)}")
    for name, t, n in (("mean", mean, N), ("rstd", rstd, N), ("weight", weight, D)):
        if t is not None and t.numel() != n:
            problems.append(f"{name} has {t.numel()} elements, not {n}")
    off_cpu = [name for name, t in (("x", x), ("dy", dy), ("mean", mean), ("rstd", rstd), ("weight", weight))
               if t is not None and t.device.type != "cpu"]
    if off_cpu:
        problems.append(f"{', '.join(off_cpu)} not on the CPU")
    if problems:
        raise ValueError(f"normgnorm's CPU kernel: {'; '.join(problems)}")


def _threads(num_examples):
    """The kernel's team: one thread per example at most (it splits examples, not rows), at least
    one (OpenMP's num_threads must be positive)."""
    return max(1, min(torch.get_num_threads(), num_examples))


def backward(dy, x, weight, mean, rstd, num_examples, need_dw, need_db, weight_sq, bias_sq, count):
    """torch_path.backward's call and results (dx, dw, db; the buffers added to), by the kernel
    where it takes the inputs (see above), else by the PyTorch path."""
    fn = kernel() if need_dw and _takes((dy, x, weight, mean, rstd), (weight_sq, bias_sq, count)) else None
    if fn is None:
        return torch_path.backward(dy, x, weight, mean, rstd, num_examples, need_dw, need_db,
                                   weight_sq, bias_sq, count)
    _check_sizes(x, dy, mean, rstd, weight, num_examples)
    D = x.shape[-1]
    B, T = num_examples, x.numel() // D // num_examples
    x, dy, weight = x.contiguous(), dy.contiguous(), weight.contiguous()
    mean = None if mean is None else mean.contiguous()
    rstd = rstd.contiguous()
    dx = torch.empty_like(x)
    dw_b, dw = x.new_empty(B, D), x.new_empty(D)
    db_b, db = (x.new_empty(B, D), x.new_empty(D)) if need_db else (None, None)
    fn(_ptr(x), _ptr(dy), _ptr(mean), _ptr(rstd), _ptr(weight), B, T, D, _ptr(dx), _ptr(dw_b), _ptr(db_b), _ptr(dw),
       _ptr(db), _ptr(weight_sq), _ptr(bias_sq if need_db else None), _ptr(count), _threads(B))
    return dx, dw, db


def per_example_grads(dy3, x3, mean3, rstd3, need_dw, need_db, weight_sq, bias_sq):
    """
    For the separated layers, whose dx, dγ, dβ are torch's own: the per-example dγ_b, dβ_b
    (None where not needed) as [B, D] from dy3, x3 [B, T, D] and the row statistics mean3
    (None: RMSNorm), rstd3 [B, T, 1], with weight_sq += Σ_b ||dγ_b||² and bias_sq += Σ_b ||dβ_b||²
    for those needed. By the kernel on CPU where it takes them, else by the PyTorch path.
    """
    B, T, D = x3.shape
    buffers = (weight_sq, bias_sq if need_db else None)
    fn = None
    if need_dw and x3.device.type == "cpu" and not torch.compiler.is_compiling() and _takes((dy3, x3, mean3, rstd3), buffers):
        fn = kernel()  # (traced, the PyTorch path fuses with the model's ops; a ctypes call cannot be traced)
    if fn is None:
        dw_b, db_b = torch_path.per_example_affine_grads(dy3, x3, mean3, rstd3, need_dw, need_db, reuse_scratch=True)
        measured = [(sq, g) for sq, g in ((weight_sq, dw_b), (bias_sq, db_b)) if g is not None]
        if measured:
            torch_path.add_squared_norms(*map(list, zip(*measured)))
        return dw_b, db_b
    _check_sizes(x3, dy3, mean3, rstd3, None, B)
    x3, dy3, rstd3 = x3.contiguous(), dy3.contiguous(), rstd3.contiguous()
    mean3 = None if mean3 is None else mean3.contiguous()
    dw_b = x3.new_empty(B, D)
    db_b = x3.new_empty(B, D) if need_db else None
    fn(_ptr(x3), _ptr(dy3), _ptr(mean3), _ptr(rstd3), None, B, T, D, None, _ptr(dw_b), _ptr(db_b), None, None,
       _ptr(weight_sq), _ptr(buffers[1]), None, _threads(B))
    return dw_b, db_b


def _ptr(t):
    return None if t is None else t.data_ptr()
