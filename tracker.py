"""`import tracker` (the name code written for this repository's earlier layout, or for the reference
implementation, imports) is nanogns.runlog: the run's log. This module makes itself that one."""
import sys

import nanogns.runlog

sys.modules[__name__] = nanogns.runlog
