"""
The check the analysis tools make before loading what an extra installs (the `gns-analysis` command,
gns-analysis.py, plot.py, --figures): training needs none of pandas, plotille or matplotlib, so a
plain `pip install` lacks them, and a tool says in one line which extra to install rather than
raising an ImportError from deep inside.
"""
import importlib
import sys


def extra_missing(extra, modules, needs):
    """None when every module imports, else the one-line reason: the import's error, what needs the
    module (`needs`, e.g. "the analysis needs"), and the pip command that installs the extra."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as e:
            why = str(e).strip().splitlines()[0] if str(e).strip() else f"{module} cannot be imported"
            return f"{why}: {needs} {module}, in the '{extra}' extra: pip install 'nanogns[{extra}]'"
    return None


def need_extra(prog, extra, modules, needs):
    """extra_missing's line on stderr and exit 2 when a module is missing; for the tools' start."""
    missing = extra_missing(extra, modules, needs)
    if missing:
        print(f"{prog}: error: {missing}", file=sys.stderr)
        sys.exit(2)
