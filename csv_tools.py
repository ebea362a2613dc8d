"""
Reading out_dir/log.csv robustly, for gns-analysis.py, plot.py and a resuming LogWrapper.

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

import pandas as pd

LOG_NAME = "log.csv"


class ToolParser(argparse.ArgumentParser):
    """argparse for the command-line tools, with a usage error on one line."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


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
