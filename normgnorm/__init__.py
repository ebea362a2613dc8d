"""`import normgnorm` (the reference implementation's name) is nanogns.normgnorm, the fused
normalisation kernels; its submodules (normgnorm.torch_path, ...) are that package's. This package
makes itself that one."""
import sys

import nanogns.normgnorm

sys.modules[__name__] = nanogns.normgnorm
