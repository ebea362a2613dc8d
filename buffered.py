"""`import buffered` (the name code written for this repository's earlier layout, or for the reference
implementation, imports) is nanogns.layers: the measured layers and measure(). This module makes itself that one."""
import sys

import nanogns.layers

sys.modules[__name__] = nanogns.layers
