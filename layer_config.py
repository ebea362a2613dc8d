"""`import layer_config` (the name code written for this repository's earlier layout, or for the reference
implementation, imports) is nanogns.layers.config: which layer classes model.py builds. This module makes itself that one."""
import sys

import nanogns.layers.config

sys.modules[__name__] = nanogns.layers.config
