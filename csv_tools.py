"""
Reading out_dir/log.csv robustly, for gns-analysis.py, plot.py and a resuming LogWrapper, and
the little those command-line tools share (one-line usage errors, terminal plots).

A log may be finished, still being written, or cut short by a kill in the middle of a write.
Every complete line ends in a newline, so a last line without one is a write cut short and is
dropped. Rows shorter than the header are padded with empty cells (older logs only ever grew
their header). The reference implementation's in-progress pair log_header.csv.tmp +
log_data.csv.tmp is read too when there is no log.csv.
"""
import argparse
import csv
import io
import os
import sys

import numpy as np
import pandas as pd

LOG_NAME = "log.csv"


class LogError(Exception):
    """A log that cannot be read; the message is one line for the user."""


def complete_lines(path):
    """The file's text lines, each ending in a newline; a last line without one is dropped."""
    with open(path, "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                return
            yield line.decode("utf-8")


def read_rows(path):
    """(header, iterator over the remaining rows as lists of strings) of a CSV, truncated last line dropped."""
    rows = csv.reader(complete_lines(path))
    return next(rows, None), rows


def find_log(out_dir):
    """(path to report, iterator over complete lines, header first) of the log in out_dir (or the file itself)."""
    if os.path.isfile(out_dir):
        return out_dir, complete_lines(out_dir)
    if not os.path.isdir(out_dir):
        raise LogError(f"{out_dir}: no such directory")
    path = os.path.join(out_dir, LOG_NAME)
    if os.path.isfile(path):
        return path, complete_lines(path)
    header, data = (os.path.join(out_dir, n) for n in ("log_header.csv.tmp", "log_data.csv.tmp"))
    if os.path.isfile(header) and os.path.isfile(data):
        return data, (line for p in (header, data) for line in complete_lines(p))
    raise LogError(f"{out_dir}: no {LOG_NAME} (has the run finished its first step?)")


def load_log(out_dir):
    """
    (DataFrame, path) of the log in out_dir: one row per logged step, sorted by step; where a
    step appears twice (an old run resumed by hand), the later row wins. Raises LogError.
    """
    path, lines = find_log(out_dir)
    try:
        text = "".join(lines)
    except UnicodeDecodeError:
        raise LogError(f"{path}: not a text CSV file") from None
    except OSError as e:
        raise LogError(f"{path}: cannot read ({e.strerror})") from None
    if not text.strip():
        raise LogError(f"{path}: empty (no complete line yet)")
    try:
        df = pd.read_csv(io.StringIO(text), low_memory=False)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, ValueError) as e:
        raise LogError(f"{path}: malformed CSV ({str(e).strip().splitlines()[-1]})") from None
    if df.columns[0] != "step":
        raise LogError(f"{path}: malformed log, the first column is {df.columns[0]!r}, not 'step'")
    steps = pd.to_numeric(df["step"], errors="coerce")
    if steps.isna().any():
        raise LogError(f"{path}: malformed log, a 'step' cell is not a number "
                       f"(data row {int(steps.isna().to_numpy().argmax()) + 1})")
    df["step"] = steps.astype("int64")
    df = df.drop_duplicates("step", keep="last").sort_values("step", kind="stable").reset_index(drop=True)
    return df, path


# -- shared by the command-line tools ----------------------------------------------------------

class ToolParser(argparse.ArgumentParser):
    """argparse for the command-line tools, with a usage error on one line."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def run_main(main):
    """sys.exit(main()), quietly when the output is piped into head & co. and the pipe closes."""
    try:
        sys.exit(main())
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)


def figure(series, x_label, y_label, scatter=False, width=72, height=16):
    """A plotille figure of [(xs, ys, label)], non-finite points dropped, at most ~2000 points each."""
    import plotille  # here, not at the top: LogWrapper imports this module during training
    fig = plotille.Figure()
    fig.width, fig.height, fig.x_label, fig.y_label = width, height, x_label, y_label
    fig.origin = False  # no axis lines through 0: they read as data
    fig.x_ticks_fkt = fig.y_ticks_fkt = lambda value, _: f"{value:.4g}"
    kept = []
    for xs, ys, label in series:
        ok = np.isfinite(xs) & np.isfinite(ys)
        xs, ys = xs[ok], ys[ok]
        stride = max(1, len(xs) // 2000)
        if len(xs):
            kept.append((xs[::stride], ys[::stride], label))
    if not kept:
        return "  (nothing to plot)"
    lo_x, hi_x = min(k[0].min() for k in kept), max(k[0].max() for k in kept)
    lo_y, hi_y = min(k[1].min() for k in kept), max(k[1].max() for k in kept)
    fig.set_x_limits(min_=lo_x, max_=hi_x if hi_x > lo_x else lo_x + 1)
    fig.set_y_limits(min_=lo_y, max_=hi_y if hi_y > lo_y else lo_y + 1)
    for xs, ys, label in kept:
        (fig.scatter if scatter else fig.plot)(list(xs), list(ys), label=label)
    return fig.show(legend=True)


def x_axis(frame):
    """(name, values) of tokens_processed if logged, else iter_num, else step."""
    for col in ("tokens_processed", "iter_num", "step"):
        if col in frame.columns:
            values = pd.to_numeric(frame[col], errors="coerce").to_numpy(dtype=float)
            if np.isfinite(values).any():
                return col, values
    return "step", frame["step"].to_numpy(dtype=float)


def log10_positive(v):
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(v > 0, np.log10(np.where(v > 0, v, 1.0)), np.nan)
