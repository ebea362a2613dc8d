"""The package's commands, pyproject.toml's [project.scripts]: each checks its extra is installed
(nanogns.extras) before it loads pandas."""
from nanogns.extras import need_extra


def gns_analysis():
    """`gns-analysis OUT_DIR [...]`: nanogns.analysis, the GNS of a run from its log.csv."""
    need_extra("gns-analysis", "analysis", ["pandas"], "the analysis needs")
    from nanogns.analysis import main
    from nanogns.logread import run_main
    run_main(main)
