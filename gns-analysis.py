"""
Gradient noise scale of a run, offline, from the raw norms in log.csv: the package's `gns-analysis`
command, run from the clone (the analysis is nanogns/analysis.py; --help says what it does).

    python gns-analysis.py out-shakespeare-char
    python gns-analysis.py out --alpha 0.999 --no-plots
    python gns-analysis.py out --prefix train/microbatch_gns

Loaded as a module (bench/norm_vs_total.py, Replicating Figures.ipynb: the dash in its name keeps
it from `import`), it holds nanogns.analysis's names.

Exit status: 0 done; 2 bad input (usage, a missing, unreadable or invalid log, a --prefix that is
not in it, the analysis extra not installed), one line on stderr; 1 the result could not be
written, one line on stderr.
"""
if __name__ == "__main__":  # before pandas loads: without the analysis extra, one line, not a traceback
    from nanogns.extras import need_extra
    need_extra("gns-analysis.py", "analysis", ["pandas"], "the analysis needs")

from nanogns.analysis import *  # noqa: E402,F401,F403  the names the scripts loading this file use
from nanogns.analysis import main as analysis_main  # noqa: E402
from nanogns.logread import run_main  # noqa: E402
from nanogns.refusals import module_refusals  # noqa: E402


def main(argv=None):
    return analysis_main(argv, prog="gns-analysis.py")


# -- the reference implementation's names that are not kept (nanogns/refusals.py) -----------------

__getattr__ = module_refusals("gns_analysis")


if __name__ == "__main__":
    run_main(main)
