"""`import hf_gns` (the name code written for this repository's earlier layout, or for the reference
implementation, imports) is nanogns.hf: the Hugging Face Trainer callback. This module makes itself that one."""
import sys

import nanogns.hf

sys.modules[__name__] = nanogns.hf
