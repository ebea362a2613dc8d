"""
Any logged metric of a run as a terminal plot, read from out_dir/log.csv (also while it runs).

    python plot.py out-shakespeare-char                          # train/loss and val/loss
    python plot.py out lr 'train/gns/*ln_f*/pegn' --x iter_num
    python plot.py out --list                                    # every column in the log

Each COLUMN argument is a column name or a shell-style glob (* ? [...]) and gets its own plot;
the columns a glob matches share it. Steps where a column was not logged are skipped.
"""
import fnmatch
import re
import sys

import pandas as pd

from csv_tools import LogError, ToolParser, figure, load_log, log10_positive, run_main, x_axis

DEFAULT_COLUMNS = ["train/loss", "val/loss"]
MAX_LINES = 8  # lines per plot; more are hard to tell apart


def available(df, n=8):
    """A few of the log's columns for an error message, the many per-parameter GNS ones summarised."""
    cols = [c for c in df.columns if c != "step"]
    per_param = [c for c in cols if re.search(r"/(norm|pegn|batch_size)$", c)]
    others = [c for c in cols if c not in set(per_param)]
    shown = others[:n] + ([f"{len(per_param)} per-parameter columns like {per_param[0]}"] if per_param else [])
    return ", ".join(shown) + (f" ({len(cols)} columns; --list shows all)" if len(others) > n or per_param else "") or "none"


def main(argv=None):
    parser = ToolParser(
        prog="plot.py",
        description="Plot logged metrics of a run in the terminal, from OUT_DIR/log.csv.")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="the run's output directory (holding log.csv), or a log CSV file")
    parser.add_argument("columns", metavar="COLUMN", nargs="*",
                        help="column names or globs, one plot each (default: train/loss and val/loss, as logged)")
    parser.add_argument("--x", default=None,
                        help="x axis column, e.g. tokens_processed, iter_num or step "
                             "(default: tokens_processed if logged, else iter_num, else step)")
    parser.add_argument("--logy", action="store_true", help="plot log10 of the values (non-positive ones are skipped)")
    parser.add_argument("--width", type=int, default=72, help="plot width in characters (default: 72)")
    parser.add_argument("--height", type=int, default=16, help="plot height in lines (default: 16)")
    parser.add_argument("--list", action="store_true", help="list the log's columns and exit")
    args = parser.parse_intermixed_args(argv)  # options may come between the columns

    try:
        df, path = load_log(args.out_dir)
    except LogError as e:
        print(f"plot.py: error: {e}", file=sys.stderr)
        return 1
    if args.list:
        print("\n".join(df.columns))
        return 0
    if args.width < 10 or args.height < 3:
        print("plot.py: error: --width must be at least 10 and --height at least 3", file=sys.stderr)
        return 1

    if args.x is None:
        x_name, x = x_axis(df)
    elif args.x in df.columns:
        x_name, x = args.x, pd.to_numeric(df[args.x], errors="coerce").to_numpy(dtype=float)
    else:
        print(f"plot.py: error: no column {args.x!r} for --x; the log has: {available(df)}", file=sys.stderr)
        return 1

    patterns = args.columns or [c for c in DEFAULT_COLUMNS if c in df.columns]
    if not patterns:
        print(f"plot.py: error: the log has no {' or '.join(DEFAULT_COLUMNS)}; name columns to plot: {available(df)}",
              file=sys.stderr)
        return 1
    plots = []
    for pattern in patterns:
        matches = [c for c in df.columns if c != "step" and (c == pattern or fnmatch.fnmatchcase(c, pattern))]
        if not matches:
            print(f"plot.py: error: no column matches {pattern!r}; the log has: {available(df)}", file=sys.stderr)
            return 1
        plots.append((pattern, matches))

    print(f"{path}: {len(df)} rows, steps {df['step'].iloc[0]}..{df['step'].iloc[-1]}" if len(df) else f"{path}: no rows yet")
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


if __name__ == "__main__":
    run_main(main)
