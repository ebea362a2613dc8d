"""`import ddpgns` (the name code written for this repository's earlier layout, or for the reference
implementation, imports) is nanogns.estimators.ddp: the DDP estimator. This module makes itself that one."""
import sys

import nanogns.estimators.ddp

sys.modules[__name__] = nanogns.estimators.ddp
