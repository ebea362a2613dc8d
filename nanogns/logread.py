"""
Reading out_dir/log.csv robustly, for gns-analysis.py, plot.py and the bench scripts, and the
little those command-line tools share (one-line errors, terminal plots).

A log may be finished, still being written, or cut short by a kill in the middle of a write.
Every complete line ends in a newline, so a last line without one is a write cut short and is
dropped. Rows shorter than the header are padded with empty cells (older logs only ever grew
their header). The reference implementation's in-progress pair log_header.csv.tmp +
log_data.csv.tmp is read too when there is no log.csv.

Cells: an empty cell is a value not logged that step (NaN), and so, as pandas reads them, are
'nan', 'None', 'NA' and its other missing-value words. In the columns asked for as written
(load_log's as_written: the GNS columns, for gns-analysis.py) only an empty cell is missing and
every other keeps what it says, so a value that went wrong ('nan', text) is told from one that
was never logged. An old bug of the reference implementation wrote losses as 'tensor(4.2000)'
(or "tensor(4.2000, device='cuda:0')"): those cells are read as the number.

Memory: the file is streamed into pandas (never held as one string), and load_log(out_dir,
columns) parses only the columns asked for, so a tool needs about the size of what it reads.
"""
import argparse
import csv
import io
import os
import re
import sys
import warnings

import numpy as np
import pandas as pd

from nanogns.maths import LOG_NAME, X_COLUMNS
REFERENCE_PAIR = ("log_header.csv.tmp", "log_data.csv.tmp")  # the reference's log while its run lasts
TENSOR_CELL = re.compile(r"^\s*tensor\(\s*([^,()\s]+)\s*(?:,[^()]*)?\)\s*$")
_EXTRA = "\0cells beyond the header"  # a column no header has: catches rows longer than the header
# pandas' missing-value words (read_csv's documentation), for the columns not read as written
PANDAS_NA = ["", "#N/A", "#N/A N/A", "#NA", "-1.#IND", "-1.#QNAN", "-NaN", "-nan", "1.#IND", "1.#QNAN", "<NA>",
             "N/A", "NA", "NULL", "NaN", "None", "n/a", "nan", "null"]


class LogError(Exception):
    """A log that cannot be read; the message is one line for the user."""


def complete_size(f):
    """The bytes of an open binary file up to and including its last newline (0 if it has none)."""
    end = f.seek(0, os.SEEK_END)
    while end > 0:
        start = max(0, end - (1 << 16))
        f.seek(start)
        last = f.read(end - start).rfind(b"\n")
        if last >= 0:
            return start + last + 1
        end = start
    return 0


def _cut_rows(f, start, end, width):
    """
    Data rows (numbered from 0, blank lines not counted) of an open binary file's bytes start..end
    that have fewer cells than a row before them: a row cut short ('12,,', a disk fault, an
    edit). A header that grows leaves short rows too, but only before the longer ones (the
    reference implementation writes its logs so; this fork pads them), never after. A row longer
    than the header's `width` counts as `width` here (load_log refuses it).
    """
    f.seek(start)
    cut, longest, row = [], 0, 0
    while f.tell() < end:
        line = f.readline(end - f.tell()).rstrip(b"\r\n")
        if not line:
            continue
        # numbers only need no parser; a quoted cell may hold commas
        cells = len(next(csv.reader([line.decode("utf-8", "replace")]))) if b'"' in line else line.count(b",") + 1
        if cells < longest:
            cut.append(row)
        longest = max(longest, min(cells, width))
        row += 1
    return cut


class _Stream(io.RawIOBase):
    """`head`, then the bytes of an open binary file from its position up to `end`: what pandas parses."""

    def __init__(self, head, f, end):
        self.head, self.f, self.left = head, f, end - f.tell()

    def readable(self):
        return True

    def readinto(self, buffer):
        if self.head:
            n = min(len(buffer), len(self.head))
            buffer[:n], self.head = self.head[:n], self.head[n:]
            return n
        n = self.f.readinto(memoryview(buffer)[:self.left]) if self.left > 0 else 0
        self.left -= n
        return n


def find_log(out_dir):
    """(path to report, header file, data file) of the log in out_dir (or the file itself); for log.csv both are it."""
    if os.path.isfile(out_dir):
        return out_dir, out_dir, out_dir
    if not os.path.isdir(out_dir):
        raise LogError(f"{out_dir}: no such directory")
    path = os.path.join(out_dir, LOG_NAME)
    if os.path.isfile(path):
        return path, path, path
    header, data = (os.path.join(out_dir, n) for n in REFERENCE_PAIR)
    if os.path.isfile(header) and os.path.isfile(data):
        return data, header, data
    raise LogError(f"{out_dir}: no {LOG_NAME} (has the run finished its first step?)")


def _read_header(path, f):
    """(column names, offset of the next line) from the first non-blank complete line of an open binary file."""
    end = complete_size(f)
    f.seek(0)
    while f.tell() < end:
        line = f.readline()
        if line.strip():
            try:
                columns = next(csv.reader([line.decode("utf-8")]))
            except UnicodeDecodeError:
                raise LogError(f"{path}: not a text CSV file") from None
            if columns[0] != "step":
                raise LogError(f"{path}: malformed log, the first column is {columns[0]!r}, not 'step'")
            twice = [c for c in columns if columns.count(c) > 1]
            if twice:
                raise LogError(f"{path}: malformed log, the column {twice[0]!r} appears twice in the header")
            return columns, f.tell()
    raise LogError(f"{path}: empty (no complete line yet)")


def log_columns(out_dir):
    """(column names, path) of the log in out_dir, from its header alone. Raises LogError."""
    path, header_file, _ = find_log(out_dir)
    try:
        with open(header_file, "rb") as f:
            return _read_header(path, f)[0], path
    except OSError as e:
        raise LogError(f"{path}: cannot read ({e.strerror})") from None


def _tensor_cells_as_numbers(col):
    """A text column with 'tensor(x, ...)' cells (the reference's old loss bug): those cells as numbers,
    and the whole column numeric if nothing else in it is text."""
    number = col.astype(str).str.extract(TENSOR_CELL, expand=False)
    found = number.notna()
    if not found.any():
        return col
    col = col.astype(object)
    col[found] = pd.to_numeric(number[found], errors="coerce")
    numeric = pd.to_numeric(col, errors="coerce")
    return numeric if (numeric.notna() == col.notna()).all() else col


def load_log(out_dir, columns=None, as_written=()):
    """
    (DataFrame, path) of the log in out_dir: one row per logged step, sorted by step; where a
    step appears twice (an old run resumed by hand), the later row wins, with a warning naming the
    steps whose copies differ in the columns read. columns: the names to
    read ('step' always; names the log lacks are ignored), default all. as_written: columns
    where only an empty cell is missing ('nan' or 'None' stay text). Raises LogError.
    """
    path, header_file, data_file = find_log(out_dir)
    try:
        # header and rows from one open file: a LogWrapper swapping in a longer header meanwhile
        # replaces the file, not what is read here
        with open(data_file, "rb") as f, warnings.catch_warnings():
            if data_file == header_file:
                header, start = _read_header(path, f)
            else:
                with open(header_file, "rb") as h:
                    header, start = _read_header(path, h)[0], 0
            wanted = set(header) if columns is None else {"step", *columns}
            warnings.simplefilter("ignore", pd.errors.DtypeWarning)  # mixed columns are handled below
            end = complete_size(f)
            f.seek(start)
            # a first row of zeros one cell longer than the header: pandas takes the number of
            # cells from its first rows, so a later row longer than the header fills _EXTRA
            # (with usecols it would be cut silently); zeros keep integer columns integer
            zeros = ",".join(["0"] * (len(header) + 1)).encode() + b"\n"
            cut = _cut_rows(f, start, max(end, start), len(header))
            f.seek(start)
            df = pd.read_csv(io.BufferedReader(_Stream(zeros, f, max(end, start))), header=None,
                             names=header + [_EXTRA], usecols=lambda c: c in wanted or c == _EXTRA,
                             keep_default_na=False, na_values={c: [""] if c in as_written else PANDAS_NA
                                                               for c in wanted | {_EXTRA}},
                             encoding="utf-8")
            df = df.iloc[1:].reset_index(drop=True)
    except UnicodeDecodeError:
        raise LogError(f"{path}: not a text CSV file") from None
    except OSError as e:
        raise LogError(f"{path}: cannot read ({e.strerror})") from None
    except (pd.errors.ParserError, pd.errors.EmptyDataError, ValueError) as e:
        raise LogError(f"{path}: malformed CSV ({str(e).strip().splitlines()[-1]})") from None
    if cut:  # left out, never counted: their missing cells would read as values not logged
        steps = ", ".join(str(df["step"].iloc[i]) for i in cut[:5]) + (", ..." if len(cut) > 5 else "")
        warnings.warn(f"{path}: {len(cut)} row(s) with fewer cells than a row before them left out (cut short; "
                      f"step cells {steps})", stacklevel=2)
        df = df.drop(index=cut).reset_index(drop=True)
    extra = df.pop(_EXTRA).notna().to_numpy()
    if extra.any():
        raise LogError(f"{path}: malformed CSV (data row {int(extra.argmax()) + 1} has more cells than the "
                       f"header's {len(header)})")
    for c in df.columns:
        if not pd.api.types.is_numeric_dtype(df[c]):
            df[c] = _tensor_cells_as_numbers(df[c])
    steps = pd.to_numeric(df["step"], errors="coerce")
    if steps.isna().any():
        raise LogError(f"{path}: malformed log, a 'step' cell is not a number "
                       f"(data row {int(steps.isna().to_numpy().argmax()) + 1})")
    df["step"] = steps.astype("int64")
    if not (df["step"].is_monotonic_increasing and df["step"].is_unique):  # copies only when needed
        copies = df[df["step"].duplicated(keep=False)]
        distinct = copies.drop_duplicates()["step"]  # a copy that repeats its row to the cell says nothing new
        conflicts = np.unique(distinct[distinct.duplicated()].to_numpy())
        if len(conflicts):
            times = copies["step"].value_counts()[conflicts].max()
            appear = "appears" if len(conflicts) == 1 else "appear"
            say = (f"{appear} twice with different values: the later copy is kept" if times == 2 else
                   f"{appear} more than once with different values: the last copy of each is kept")
            warnings.warn(f"{path}: {step_ranges(conflicts)} {say}", stacklevel=2)
        df = df.drop_duplicates("step", keep="last").sort_values("step", kind="stable").reset_index(drop=True)
    return df, path


def step_ranges(steps, shown=8):
    """'step 4' or 'steps 3, 10-12, 40' of sorted distinct steps: the first `shown` runs of consecutive
    steps, then how many steps in all."""
    runs = []
    for step in map(int, steps):
        if runs and step == runs[-1][1] + 1:
            runs[-1][1] = step
        else:
            runs.append([step, step])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs[:shown])
    more = f", ... ({len(steps)} steps)" if len(runs) > shown else ""
    return f"{'step' if len(steps) == 1 else 'steps'} {text}{more}"


def load_csv(out_dir):
    """The reference implementation's name: the log's DataFrame, load_log(out_dir)[0]."""
    return load_log(out_dir)[0]


# -- shared by the command-line tools ----------------------------------------------------------

class ToolParser(argparse.ArgumentParser):
    """argparse for the command-line tools, with a usage error on one line."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def run_main(main):
    """
    sys.exit(main()), where main reports bad input itself (one line, 2). Output that cannot be
    written: quietly 1 when a pipe into head & co. closes, one line and 1 otherwise (a full disk).
    A warning (rows of the log left out, ...) is one line on stderr, named after the tool.
    """
    prog = os.path.basename(sys.argv[0])
    warnings.formatwarning = lambda message, *_: f"{prog}: warning: {message}\n"  # not Python's two lines
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:
        code = 1
    except OSError as e:  # everything read is checked by then: this is stdout
        print(f"{os.path.basename(sys.argv[0])}: error: cannot write the output ({e.strerror or e})", file=sys.stderr)
        code = 1
    if code:  # what is still buffered for stdout would fail again at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.exit(code)


# the curves' marks where there is no colour to tell them apart (a file, a pipe)
MARKERS = "ox+*#%@&"


def figure(series, x_label, y_label, scatter=False, width=72, height=16, colour=None):
    """
    A plotille figure of [(xs, ys, label)], non-finite points dropped, at most ~2000 points each.
    colour: None decides by whether stdout is a terminal. Without colour (written to a file or a
    pipe) each curve is drawn with its own character, which the legend shows.
    """
    import plotille  # here, not at the top: the tools' --help and errors need not load it
    colour = sys.stdout.isatty() if colour is None else colour
    fig = plotille.Figure()
    fig.with_colors = colour
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
    for i, (xs, ys, label) in enumerate(kept):
        marker = None if colour else MARKERS[i % len(MARKERS)]
        (fig.scatter if scatter else fig.plot)(list(xs), list(ys), label=label, marker=marker)
    return fig.show(legend=True)


def x_axis(frame):
    """(name, values) of the first of X_COLUMNS logged: tokens_processed, else iter_num, else step."""
    for col in X_COLUMNS:
        if col in frame.columns:
            values = pd.to_numeric(frame[col], errors="coerce").to_numpy(dtype=float)
            if np.isfinite(values).any():
                return col, values
    return "step", frame["step"].to_numpy(dtype=float)


def log10_positive(v):
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(v > 0, np.log10(np.where(v > 0, v, 1.0)), np.nan)
