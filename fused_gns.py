"""
PEGradNormFusedLayerNorm: a drop-in for nn.LayerNorm(ndim, bias=...) (same parameters, same
state_dict keys, eps 1e-5) whose backward also accumulates the per-example squared gradient
norms of its gain and bias into float32 buffers, with the fused kernel of normgnorm/
(Triton or CUDA on GPU, pure PyTorch elsewhere). Buffers follow buffered.py's convention:
`weight_sqgradnorm`, `bias_sqgradnorm` (only with bias) and `example_count`.

    from fused_gns import PEGradNormFusedLayerNorm
    with set_contextual_config(LayerNorm=PEGradNormFusedLayerNorm):
        model = GPT(config)
"""
import torch
import torch.nn as nn

import normgnorm
from buffered import register_sqgradnorm_buffers


class PEGradNormFusedLayerNorm(nn.Module):

    def __init__(self, ndim, bias=True, eps=1e-5, backend=None):
        super().__init__()
        self.normalized_shape = (ndim,)
        self.eps = eps
        self.backend = backend  # None: NORMGNORM_BACKEND, else Triton on CUDA, PyTorch elsewhere
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None
        register_sqgradnorm_buffers(self)

    def forward(self, x):
        return normgnorm.layer_norm(x, self.weight, self.bias,
                                    self.weight_sqgradnorm, getattr(self, "bias_sqgradnorm", None),
                                    self.example_count, self.eps, self.backend)

    def _apply(self, fn, recurse=True):
        # .half() / .to(bfloat16) must not touch the running sums: keep them float32, moving
        # the original float32 values (not a rounded copy) to wherever fn sent the buffer.
        sums = {name: buf for name, buf in self._buffers.items()
                if buf is not None and (name == "example_count" or name.endswith("_sqgradnorm"))}
        super()._apply(fn, recurse)
        for name, before in sums.items():
            after = self._buffers[name]
            if after.dtype != torch.float32:
                self._buffers[name] = before.to(device=after.device, dtype=torch.float32)
        return self

    def extra_repr(self):
        return f"{self.normalized_shape}, eps={self.eps}, bias={self.bias is not None}"
