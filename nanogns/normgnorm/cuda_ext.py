"""
The CUDA C++ backend: kernels in csrc/normgnorm_cuda.cu (no torch headers), compiled with nvcc
into an object, and a plain C++ torch binding, csrc/normgnorm_cuda.cpp, JIT-built with
torch.utils.cpp_extension and linked against that object and libcudart. Built on first use
(a few seconds to a minute) into torch's extension cache, once per GPU architecture and
version of the .cu file.

Same semantics as the other backends (normgnorm/__init__.py), RMSNorm included: the kernels
take an empty mean for it (no centring). Rows wider than the kernels take (32768 features) go
to the pure-PyTorch path.
"""
import hashlib
import os
import shutil
import subprocess

import torch
from torch.utils import cpp_extension

from . import torch_path
from .plan import MIN_ROWS_PER_CHUNK, cdiv, plan_backward

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
MAX_D = 32 * 1024  # normgnorm_max_d() of the .cu
_extensions = {}


def find_cuda_home():
    """
    The CUDA toolkit's root (with bin/nvcc and libcudart): $CUDA_HOME, $CUDA_PATH, /usr/local/cuda
    or where nvcc on PATH lives; None if there is none. (torch's cpp_extension.CUDA_HOME is
    None in a CPU-only torch build, and cannot serve.)
    """
    nvcc = shutil.which("nvcc")
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda",
                  nvcc and os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))]
    for home in candidates:
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")) and _cudart_dir(home):
            return home
    return None


def _cudart_dir(home):
    for lib in ("lib64", "lib"):
        if os.path.exists(os.path.join(home, lib, "libcudart.so")):
            return os.path.join(home, lib)
    return None


def nvcc_command(arch, output):
    """The nvcc call that compiles the kernels (no torch headers) into a relocatable object."""
    nvcc = os.path.join(find_cuda_home(), "bin", "nvcc")
    return [nvcc, "-c", "-O3", "-Xcompiler", "-fPIC", f"-arch={arch}", os.path.join(CSRC, "normgnorm_cuda.cu"), "-o", output]


def kernel_object(arch, build_dir):
    """Where build() keeps the compiled kernels: the name carries the source's hash, so an edited
    .cu is recompiled and the binding relinked."""
    with open(os.path.join(CSRC, "normgnorm_cuda.cu"), "rb") as f:
        version = hashlib.sha1(f.read()).hexdigest()[:12]
    return os.path.join(build_dir, f"normgnorm_kernels_{arch}_{version}.o")


def build(arch=None, build_dir=None, verbose=False):
    """
    Compile the kernels for `arch` (e.g. "sm_90"; default: the current GPU's) and build and load
    the binding; returns its ops (torch.ops.normgnorm_cuda_<arch>). Needs nvcc and a C++
    compiler, no GPU. Built once per architecture into build_dir (default: torch's extension
    cache), reused afterwards.
    """
    if arch is None:
        major, minor = torch.cuda.get_device_capability()
        arch = f"sm_{major}{minor}"
    if arch in _extensions:
        return _extensions[arch]
    cuda_home = find_cuda_home()
    if cuda_home is None:
        raise RuntimeError("normgnorm: the 'cuda' backend needs the CUDA toolkit (nvcc; set CUDA_HOME)")
    name = f"normgnorm_cuda_{arch}"
    build_dir = build_dir or os.path.join(cpp_extension.get_default_build_root(), name)
    os.makedirs(build_dir, exist_ok=True)
    obj = kernel_object(arch, build_dir)
    if not os.path.exists(obj):
        tmp = f"{obj}.{os.getpid()}.tmp"
        cmd = nvcc_command(arch, tmp)
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"normgnorm: nvcc failed:\n{' '.join(cmd)}\n{done.stderr}")
        os.replace(tmp, obj)
    lib = _cudart_dir(cuda_home)
    cpp_extension.load(
        name=name, sources=[os.path.join(CSRC, "normgnorm_cuda.cpp")], build_directory=build_dir,
        extra_ldflags=[obj, f"-L{lib}", "-lcudart", f"-Wl,-rpath,{lib}"], is_python_module=False, verbose=verbose)
    _extensions[arch] = getattr(torch.ops, name)  # the ops it registered
    return _extensions[arch]


def _stream(device):
    return torch.cuda.current_stream(device).cuda_stream


_sm_counts = {}


def _target_blocks(device):
    if device not in _sm_counts:
        _sm_counts[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return 4 * _sm_counts[device]


def _check_cuda(**tensors):
    """The binding checks its tensors too, but an error raised inside it crashed the process
    under some torch versions: refuse here, in Python, what it would refuse."""
    for name, t in tensors.items():
        if t is not None and not (t.is_cuda and t.is_contiguous()):
            raise ValueError(f"normgnorm's CUDA backend takes contiguous CUDA tensors; {name} is "
                             f"{'on ' + t.device.type if not t.is_cuda else 'not contiguous'}")


def forward(x2d, weight, bias, eps, rms=False):
    """y (x's dtype), float32 mean (None with rms: RMSNorm) and rstd [N], for contiguous x2d [N, D]
    on a CUDA device."""
    _check_cuda(x=x2d, weight=weight, bias=bias)
    N, D = x2d.shape
    if D > MAX_D:
        return torch_path.forward(x2d, weight, bias, eps, rms)
    with torch.cuda.device(x2d.device):
        ext = build()
        y = torch.empty_like(x2d)
        rstd = torch.empty(N, dtype=torch.float32, device=x2d.device)
        mean = rstd.new_empty(0 if rms else N)  # empty: no centring
        bias32 = bias.float() if bias is not None else rstd.new_empty(0)
        ext.forward(x2d, y, weight.float(), bias32, mean, rstd, eps, _stream(x2d.device))
    return y, None if rms else mean, rstd


def backward(dy2d, x2d, weight, mean, rstd, num_examples, need_dw, need_db, weight_sq, bias_sq, count,
             target_blocks=None, min_rows_per_chunk=MIN_ROWS_PER_CHUNK):
    """As triton_kernels.backward: dx, dw, db (None where not needed), buffers updated on the GPU;
    mean None: RMSNorm."""
    _check_cuda(dy=dy2d, x=x2d, weight=weight, mean=mean, rstd=rstd, weight_sqgradnorm=weight_sq,
                bias_sqgradnorm=bias_sq, example_count=count)
    N, D = x2d.shape
    if D > MAX_D:
        return torch_path.backward(dy2d, x2d, weight, mean, rstd, num_examples, need_dw, need_db,
                                   weight_sq, bias_sq, count)
    B, T = num_examples, N // num_examples
    device = x2d.device
    with torch.cuda.device(device):
        ext = build()
        plan = plan_backward(B, T, D, target_blocks or _target_blocks(device), None, min_rows_per_chunk)
        split = plan["n_chunks"] > 1
        n_blocks = plan["n_blocks"] = plan["n_programs"]
        n_sq = B * cdiv(D, ext.column_block()) if split else n_blocks

        def scratch(needed, *shape):
            return torch.empty(shape if needed else (0,), dtype=torch.float32, device=device)
        dx = torch.empty_like(x2d)
        part_w, part_b = scratch(need_dw, n_blocks, D), scratch(need_db, n_blocks, D)
        ex_w, ex_b = scratch(need_dw and split, B, D), scratch(need_db and split, B, D)
        sq_w, sq_b = scratch(need_dw, n_sq), scratch(need_db, n_sq)
        dw, db = scratch(need_dw, D), scratch(need_db, D)
        empty = scratch(False)
        ext.backward(dy2d, x2d, dx, weight.float(), empty if mean is None else mean, rstd, B,
                     plan["examples_per_program"], plan["n_chunks"], plan["rows_per_chunk"], n_blocks,
                     need_dw, need_db, part_w, part_b, ex_w, ex_b, sq_w, sq_b, dw, db,
                     weight_sq if need_dw else empty, bias_sq if need_db else empty, count,
                     _stream(device))
    return dx, dw.to(weight.dtype) if need_dw else None, db.to(weight.dtype) if need_db else None
