"""`import gnsmeter` (the name code written for this repository's earlier layout, or for the reference
implementation, imports) is nanogns.meter: GNSMeter, the gradient noise scale of any training loop. This module makes itself that one."""
import sys

import nanogns.meter

sys.modules[__name__] = nanogns.meter
