"""`import lightning_gns` (the name code written for this repository's earlier layout, or for the reference
implementation, imports) is nanogns.lightning: the Lightning callback. This module makes itself that one."""
import sys

import nanogns.lightning

sys.modules[__name__] = nanogns.lightning
