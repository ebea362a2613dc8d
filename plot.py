"""
Any logged metric of a run as a terminal plot, read from out_dir/log.csv (also while it runs).

    python plot.py out-shakespeare-char                          # train/loss and val/loss
    python plot.py out lr 'train/gns/*ln_f*/pegn' --x iter_num
    python plot.py out --list                                    # every column in the log

Each COLUMN argument is a column name or a shell-style glob (* ? [...]) and gets its own plot;
the columns a glob matches share it. Steps where a column was not logged are skipped. Only the
columns plotted are read, so a long log costs little memory.

The reference implementation's command line works too, with the same meaning:
`plot.py log_dir metric [--x-axis COL] [--log-y] [--log-x] [--max-tokens N] [--width W] [--height H]`
(--x-axis is --x, --log-y is --logy, --log-x plots log10 of x, --max-tokens keeps the rows with
tokens_processed <= N). Its default plot size was 80 x 20 characters, ours is 72 x 16.

Exit status: 0 done; 2 bad input (usage, a missing, unreadable or invalid log, a column that is
not there, the analysis extra not installed), one line on stderr; 1 the plot could not be written, one line on stderr.
"""
import fnmatch
import sys

if __name__ == "__main__":  # before pandas loads: without the analysis extra, one line, not a traceback
    from nanogns.extras import need_extra
    need_extra("plot.py", "analysis", ["pandas", "plotille"], "plot.py needs")

import pandas as pd  # noqa: E402

from nanogns.logread import LogError, ToolParser, figure, load_log, log10_positive, log_columns, run_main, x_axis  # noqa: E402
from nanogns.maths import X_COLUMNS, parse_column  # noqa: E402
from nanogns.refusals import module_refusals  # noqa: E402

DEFAULT_COLUMNS = ["train/loss", "val/loss"]
MAX_LINES = 8  # lines per plot; more are hard to tell apart


def available(columns, n=8):
    """A few of the log's columns for an error message, the many per-parameter GNS ones summarised."""
    cols = [c for c in columns if c != "step"]
    per_param = [c for c in cols if parse_column(c)]
    others = [c for c in cols if c not in set(per_param)]
    shown = others[:n] + ([f"{len(per_param)} per-parameter columns like {per_param[0]}"] if per_param else [])
    return ", ".join(shown) + (f" ({len(cols)} columns; --list shows all)" if len(others) > n or per_param else "") or "none"


def main(argv=None):
    parser = ToolParser(
        prog="plot.py",
        description="Plot logged metrics of a run in the terminal, from OUT_DIR/log.csv. The reference "
                    "implementation's flags work too: --x-axis (= --x), --log-y (= --logy), --log-x, "
                    "--max-tokens. Exit status: 0 done, 2 bad input, 1 the plot could not be written.")
    parser.add_argument("out_dir", metavar="OUT_DIR", nargs="?", help="the run's output directory (holding log.csv), or a log CSV file")
    parser.add_argument("columns", metavar="COLUMN", nargs="*",
                        help="column names or globs, one plot each (default: train/loss and val/loss, as logged)")
    parser.add_argument("--x", "--x-axis", default=None,
                        help=f"x axis column, e.g. {', '.join(X_COLUMNS)} (default: the first of them logged)")
    parser.add_argument("--logy", "--log-y", action="store_true",
                        help="plot log10 of the values (non-positive ones are skipped)")
    parser.add_argument("--log-x", action="store_true", help="plot over log10 of x (non-positive x are skipped)")
    parser.add_argument("--max-tokens", type=float, default=None, metavar="N",
                        help="only the rows with tokens_processed <= N (default: all)")
    parser.add_argument("--width", type=int, default=72, help="plot width in characters (default: 72)")
    parser.add_argument("--height", type=int, default=16, help="plot height in lines (default: 16)")
    parser.add_argument("--list", action="store_true", help="list the log's columns and exit")
    args = parser.parse_intermixed_args(argv)  # options may come between the columns
    if args.out_dir is None:  # argparse would call the optional COLUMNs required too
        parser.error("the following argument is required: OUT_DIR")
    if args.width < 10 or args.height < 3:
        parser.error("--width must be at least 10 and --height at least 3")

    def bad_input(message):
        print(f"plot.py: error: {message}", file=sys.stderr)
        return 2

    try:
        columns, path = log_columns(args.out_dir)
    except LogError as e:
        return bad_input(e)
    if args.list:
        print("\n".join(columns))
        return 0
    if args.x is not None and args.x not in columns:
        return bad_input(f"no column {args.x!r} for --x; the log has: {available(columns)}")
    if args.max_tokens is not None and "tokens_processed" not in columns:
        return bad_input(f"--max-tokens needs a tokens_processed column; the log has: {available(columns)}")

    patterns = args.columns or [c for c in DEFAULT_COLUMNS if c in columns]
    if not patterns:
        return bad_input(f"the log has no {' or '.join(DEFAULT_COLUMNS)}; name columns to plot: {available(columns)}")
    plots = []
    for pattern in patterns:
        matches = [c for c in columns if c != "step" and (c == pattern or fnmatch.fnmatchcase(c, pattern))]
        if not matches:
            return bad_input(f"no column matches {pattern!r}; the log has: {available(columns)}")
        plots.append((pattern, matches))

    # read only what is plotted: the lines, the x axis, and what --max-tokens looks at
    wanted = {c for _, matches in plots for c in matches[:MAX_LINES]}
    wanted |= {args.x} if args.x is not None else set(X_COLUMNS)
    if args.max_tokens is not None:
        wanted.add("tokens_processed")
    try:
        df, path = load_log(args.out_dir, wanted)
    except LogError as e:
        return bad_input(e)
    if args.max_tokens is not None:
        df = df[pd.to_numeric(df["tokens_processed"], errors="coerce") <= args.max_tokens]

    if args.x is None:
        x_name, x = x_axis(df)
    else:
        x_name, x = args.x, pd.to_numeric(df[args.x], errors="coerce").to_numpy(dtype=float)
    if args.log_x:
        x_name, x = f"log10 {x_name}", log10_positive(x)

    kept = f" with tokens_processed <= {args.max_tokens:g}" if args.max_tokens is not None else ""
    if len(df):
        print(f"{path}: {len(df)} rows{kept}, steps {df['step'].iloc[0]}..{df['step'].iloc[-1]}")
    else:
        print(f"{path}: no rows{kept or ' yet'}")
    for pattern, matches in plots:
        series = []
        for col in matches[:MAX_LINES]:
            y = pd.to_numeric(df[col], errors="coerce").to_numpy(dtype=float)
            series.append((x, log10_positive(y) if args.logy else y, col))
        more = f" (first {MAX_LINES} of {len(matches)} columns)" if len(matches) > MAX_LINES else ""
        last = [f"{col}={pd.to_numeric(df[col], errors='coerce').dropna().iloc[-1]:.6g}"
                for col in matches[:3] if pd.to_numeric(df[col], errors="coerce").notna().any()]
        print(f"\n{pattern}{more}" + (f"; last: {', '.join(last)}" if last else "; no numbers logged"))
        print(figure(series, x_name, f"log10 {pattern}" if args.logy else pattern,
                     width=args.width, height=args.height))
    return 0


# -- the reference implementation's names that are not kept (nanogns/refusals.py) -----------------

__getattr__ = module_refusals("plot")


if __name__ == "__main__":
    run_main(main)
