"""
Logging for the training loop: a CSV that survives a crash or a full disk, optional wandb, and a
compact print.

    logger = LogWrapper(config=config, out_dir=out_dir, resume_step=iter_num if resuming else None)
    ...  # every iteration:
    logger.log({"iter_num": iter_num, "train/lossf": lossf, **gns_logs.pop()})
    logger.print("{iter_num=}: {train_lossf=:.4f}")      # iter_num=3: train/lossf=1.2345
    logger.step()                                        # one row of out_dir/log.csv
    ...
    logger.close()

out_dir/log.csv: one row per step() that had something logged, first column `step` (the number
of step() calls before it, plus resume_step), then the keys in order of first appearance, with
empty cells where a key was not logged that step. Nothing reaches the file before step().

Crash safety: every row is appended with a single os.write of the whole line (a buffered writer
may split a long row over several) and fsynced before step() returns, so all completed steps
are on disk after a SIGKILL, and a kill mid-write can at most leave a last line without its
newline, which readers (nanogns.logread) and a resume drop. When a new key appears the whole file is
rewritten with the longer header into log.csv.tmp, fsynced and swapped in with os.replace, so
log.csv is always either the old or the new complete file.

A write that fails (a full disk, ...) raises LogWriteError, one line naming the file, and
leaves the file as it was: a failed append is cut back to the previous complete row, a failed
rewrite removes its .tmp. log.csv, log.csv.rejected and config.json are all written this way,
through atomic_write(), the one helper every file we write whole goes through (checkpoints, the
batch-size schedule, the analysis's CSV, the prepared datasets too).

Resume: LogWrapper(..., resume_step=k) keeps the rows of steps before k and cuts the file in
place before the first row of a step at or after k (written before the crash, they are about to
be redone: no second copy of the file is needed; they are appended under their header to
log.csv.rejected, never deleted, said in one note), then numbers the next step() k. It checks
what it keeps: a malformed row (more cells than the header, text that is not CSV, a step that is
not an integer or not greater than the one before, with numbers_only a cell that is not a
number) is moved to log.csv.rejected, and missing steps (a gap, a log that starts late or ends
before k, an empty or missing log) are reported, each with a warning of one line. A file that
is not such a log at all (no `step` first column, binary, not UTF-8) raises NotALogError.
Rows shorter than the header are kept (logs whose header grew, as the reference implementation
writes them; readers pad them, and leave out with a warning a row shorter than one before it,
which was cut: nanogns.logread.load_log). Without resume_step a new run starts a new log.csv (an old one
is replaced at the first step()).

out_dir/config.json holds the run's configuration (rewritten by a resumed run);
out_dir/layer_kinds.json, where record_kinds() writes it, the kind of each measured parameter.
out_dir/linear_norm_methods.json, where record_norm_methods() writes it, each measured Linear's
ghost/materialise method.
"""
import atexit
import csv
import errno
import io
import json
import os
import stat
import re
import string
import time
import warnings

from nanogns.maths import LOG_NAME, WRITER, WRITER_KEY
from nanogns.refusals import module_refusals, refuse_attributes

REJECTED_SUFFIX = ".rejected"  # malformed rows a resume took out of log.csv, appended to log.csv.rejected
MAX_REPORTED = 5  # problems a resume reports one line each; the rest as a count


class LogWriteError(OSError):
    """A write of log.csv, log.csv.rejected or config.json failed; str() is one line naming the file,
    and the file is as it was before the write. errno and filename are the failed call's."""

    def __str__(self):
        return self.strerror


class NotALogError(ValueError):
    """out_dir/log.csv is not a log to resume (no `step` first column, binary, not UTF-8); it is left alone."""


def _write_failed(path, error, what):
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        reason = "the disk is full"
    else:
        reason = error.strerror or str(error)
    return LogWriteError(error.errno, f"{path}: {what} failed, {reason}; the file is left as it was", path)


def _fsync_dir(path):
    # an os.replace is only durable once the directory entry is
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _remove_quietly(path):
    try:
        os.remove(path)
    except OSError:
        pass


def _write_all(fd, data):
    # A regular file takes the whole buffer in one write unless it runs out of room; then the
    # next write reports why (ENOSPC, EDQUOT, EFBIG).
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def read_text_file(path, max_bytes):
    """The UTF-8 text of the regular file at path, of at most max_bytes. A FIFO (whose open waits for
    a writer), a device (/dev/zero never ends) or a directory is refused from its stat, before any
    open; the open does not block and the opened file is checked again, in case the path was replaced
    in between; at most max_bytes + 1 bytes are read. Raises OSError or ValueError, one line."""
    def check(st):
        if not stat.S_ISREG(st.st_mode):
            kind = {stat.S_IFIFO: "a FIFO", stat.S_IFDIR: "a directory", stat.S_IFCHR: "a device",
                    stat.S_IFBLK: "a device", stat.S_IFSOCK: "a socket"}.get(stat.S_IFMT(st.st_mode), "a special file")
            raise ValueError(f"not a regular file but {kind}")
        if st.st_size > max_bytes:
            raise ValueError(f"larger than {max_bytes:,} bytes")
    check(os.stat(path))
    fd = os.open(path, os.O_RDONLY | getattr(os, 'O_NONBLOCK', 0) | getattr(os, 'O_NOCTTY', 0))
    try:
        check(os.fstat(fd))
        data = b''
        while len(data) <= max_bytes:  # the size stat gave may be stale: a file that grows is cut here
            chunk = os.read(fd, max_bytes + 1 - len(data))
            if not chunk:
                break
            data += chunk
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise ValueError(f"larger than {max_bytes:,} bytes")
    try:
        return data.decode('utf-8')
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 text (byte {e.start})") from None


def atomic_write(path, write, mode="wb"):
    """
    Every file we write whole goes through here: write(f) fills path.tmp (opened with `mode`, "wb"
    or "w" for UTF-8 text), which is fsynced, renamed over path with os.replace, and the directory
    fsynced, so readers (and a machine that loses power) see the old file or the new one, whole.
    On any failure path.tmp is removed and the error raised as it was.
    """
    tmp = path + ".tmp"
    try:
        with open(tmp, mode, **({} if "b" in mode else dict(encoding="utf-8", newline=""))) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _remove_quietly(tmp)
        raise
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def _replace_file(path, write, what):
    """atomic_write, its OSError a LogWriteError saying what failed."""
    try:
        atomic_write(path, write)
    except OSError as e:
        raise _write_failed(path, e, what) from None


def _append_file(fd, size, data, path, what):
    """Append data to fd (O_APPEND, holding `size` bytes) and fsync; on failure cut it back to `size`."""
    try:
        _write_all(fd, data)
        os.fsync(fd)
    except OSError as e:
        try:
            os.ftruncate(fd, size)
        except OSError:
            pass
        raise _write_failed(path, e, what) from None
    return size + len(data)


def _append_to_path(path, data, what):
    """Append data to the file at path (created if need be); returns its size before."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    except OSError as e:
        raise _write_failed(path, e, what) from None
    try:
        size = os.fstat(fd).st_size
        _append_file(fd, size, data, path, what)
    finally:
        os.close(fd)
    return size


def _csv_line(cells):
    out = io.StringIO()
    csv.writer(out).writerow(cells)  # csv's "\r\n" line ends, like every log so far
    return out.getvalue().encode("utf-8")


def _records(f, line_number=2):
    """
    (line number, byte offset, raw bytes, complete) of each CSV record of the binary file f from
    its position on (after the header: line 2); a record spans lines while its quotes are
    unbalanced. The last one is not complete when it lacks its newline (a write cut short) or
    never closes its quotes.
    """
    offset = f.tell()
    record, lines = b"", 0
    for line in f:
        record += line
        lines += 1
        if line.endswith(b"\n") and record.count(b'"') % 2 == 0:
            yield line_number, offset, record, True
            line_number, offset = line_number + lines, offset + len(record)
            record, lines = b"", 0
    if record:
        yield line_number, offset, record, False


def _cells(raw):
    """The cells of one raw record, or None if it is not one CSV row of UTF-8 text (_not_cells says why)."""
    return None if _not_cells(raw) else next(csv.reader(io.StringIO(raw.decode("utf-8"), newline="")))


def _not_cells(raw):
    """Why a raw record is not one CSV row of UTF-8 text, in words; None if it is one."""
    if b"\x00" in raw:
        return "binary (a NUL byte)"
    try:
        rows = list(csv.reader(io.StringIO(raw.decode("utf-8"), newline="")))
    except UnicodeDecodeError as e:
        return f"not UTF-8 text (byte {e.start})"
    except csv.Error as e:
        return f"not CSV ({e})"
    return None if len(rows) == 1 else f"{len(rows)} rows in one line (a stray carriage return?)"


def _steps(first, last):
    return f"step {first} is" if first == last else f"steps {first} to {last} are"


def _is_number(cell):
    try:
        float(cell)
    except ValueError:
        return cell == ""
    return True


def _plain(value):
    # 0-dim tensors and numpy scalars become Python numbers (CSV cells, wandb, format specs)
    item = getattr(value, "item", None)
    return item() if callable(item) else value


@refuse_attributes  # the reference's CSV machinery, not kept (refusals.ATTRIBUTES)
class LogWrapper:
    """
    logf: optional callable that also receives every row as a dict of the values logged that
        step (no "step" key), keys containing no_sync_keyword ("no_sync") left out.
    config: dict written to out_dir/config.json and given to wandb.
    out_dir: where log.csv and config.json go; None logs nowhere on disk.
    resume_step: the iteration a resumed run restarts from (see the module docstring).
    numbers_only: every value logged is a number (train.py's), so a resume moves a row with any
        other cell aside as malformed.
    wandb_log, wandb_project, wandb_run_name: also log to wandb (imported only when asked for;
        honours WANDB_MODE, WANDB_DIR etc.), with the same filter as logf.

    log_dict: the values logged since the last step(); ordered_keys: every key logged so far (and
    the columns of a resumed log), in order of first appearance; step_count: the next row's step.
    """

    def __init__(self, logf=None, config=None, out_dir=None, resume_step=None,
                 wandb_log=False, wandb_project="nanogns", wandb_run_name=None, numbers_only=False):
        self.logf = logf
        self.config = config
        self.out_dir = out_dir
        self.no_sync_keyword = "no_sync"
        self.step_count = 0 if resume_step is None else int(resume_step)
        self.numbers_only = numbers_only  # a resume takes a row with a cell that is not a number for malformed
        self.log_dict = {}  # this step's values, written by step()
        self.latest = {}    # the most recent value of every key ever logged, for print()
        self.ordered_keys = []
        self._known = set()
        self.path = None
        self._owns_file = False  # log.csv holds this run's rows (or the kept rows of a resumed one)
        self._fd = None          # log.csv opened O_APPEND once it is ours
        self._size = 0           # bytes of complete rows in log.csv: a failed append is cut back to it
        self._header_keys = 0    # columns after `step` in log.csv's header
        self._last_line = None   # the last row written, and how many keys it had columns for: last_row()
        self._missing_warned = set()
        if out_dir is not None:
            os.makedirs(out_dir, exist_ok=True)
            self.path = os.path.join(out_dir, LOG_NAME)
            if resume_step is not None and os.path.isfile(self.path):
                self._resume(self.step_count)  # first: a log it refuses is left as it was, and config.json too
            elif resume_step:
                self._report([f"{self.path} is missing: {_steps(0, resume_step - 1)} missing "
                              f"(the run resumes at step {resume_step})"])
            if config is not None:
                text = json.dumps({**dict(config), WRITER_KEY: WRITER}, indent=2, default=str).encode("utf-8")
                _replace_file(os.path.join(out_dir, "config.json"), lambda f: f.write(text), "writing the configuration")
        self.wandb_run = None
        if wandb_log:
            import wandb  # optional dependency: only needed when asked for
            self.wandb_run = wandb.init(project=wandb_project, name=wandb_run_name,
                                        config=dict(config) if config is not None else None)

    # -- logging --------------------------------------------------------------------------------

    def record_kinds(self, kinds):
        """Write out_dir/layer_kinds.json: {parameter name: kind} of the measured layers
        (nanogns.layers.layer_kinds(model)), by which gns-analysis.py groups the parameters. Nothing
        without out_dir."""
        from nanogns.maths import KINDS_NAME  # here: nanogns.maths imports numpy, which the log does not need
        self._record(KINDS_NAME, kinds, "writing the layer kinds")

    def record_norm_methods(self, methods):
        """Write out_dir/linear_norm_methods.json: {layer name: 'ghost' or 'materialise'}, the method
        each measured Linear measures its weight with (nanogns.layers.linear_norm_methods(model), chosen
        in the first step). Nothing without out_dir."""
        from nanogns.maths import METHODS_NAME
        self._record(METHODS_NAME, methods, "writing the Linears' methods")

    def _record(self, name, mapping, doing):
        if self.out_dir is not None:
            text = json.dumps(dict(mapping), indent=1).encode("utf-8")
            _replace_file(os.path.join(self.out_dir, name), lambda f: f.write(text), doing)

    def log(self, values):
        """Add values (a dict of name -> number or string) to this step's row; later values win."""
        for key, value in values.items():
            if key == "step":
                raise ValueError("'step' is the CSV's own first column; log the iteration as e.g. 'iter_num'")
            value = _plain(value)
            self.log_dict[key] = value
            self.latest[key] = value
            if key not in self._known:
                self._known.add(key)
                self.ordered_keys.append(key)

    def step(self):
        """
        Write this step's row (if anything was logged) to the CSV, logf and wandb; next step. If
        the CSV write raises (LogWriteError), the row stays in log_dict and the step number is
        not used up, so step() may be called again once there is room.
        """
        step = self.step_count
        if self.log_dict:
            row = dict(self.log_dict)
            if self.path is not None:
                self._write_row(step, row)  # the file first: it is what must survive a crash
            self.log_dict.clear()
            synced = {k: v for k, v in row.items() if self.no_sync_keyword not in k}
            if self.logf is not None:
                self.logf(synced)
            if self.wandb_run is not None:
                self.wandb_run.log(synced, step=step)
        self.step_count = step + 1

    def close(self):
        """Close the CSV and finish the wandb run. Values logged after the last step() are not written."""
        if self.log_dict:
            warnings.warn(f"LogWrapper.close(): {len(self.log_dict)} value(s) logged after the last step() were not written")
            self.log_dict.clear()
        self._close_file()
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- the CSV --------------------------------------------------------------------------------

    def last_row(self):
        """(step, {column: cell}) of the last row written to log.csv, its non-empty cells as the file holds
        them; None before the first. A checkpoint keeps it, so that a resume can tell whether the log
        in its out_dir is the one its run wrote (logged_row)."""
        if self._last_line is None:
            return None
        line, width = self._last_line
        cells = _cells(line)
        return int(cells[0]), {k: c for k, c in zip(self.ordered_keys[:width], cells[1:]) if c != ""}

    def _write_row(self, step, row):
        line = _csv_line([step] + [row.get(k, "") for k in self.ordered_keys])
        if not self._owns_file or len(self.ordered_keys) > self._header_keys:
            self._rewrite(line)
        else:
            if self._fd is None:  # after close()
                self._open_for_append()
            self._size = _append_file(self._fd, self._size, line, self.path, f"appending the row of step {step}")
        self._last_line = (line, len(self.ordered_keys))

    def _open_for_append(self):
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        except OSError as e:
            raise _write_failed(self.path, e, "opening it to append rows") from None
        self._size = os.fstat(self._fd).st_size

    def _close_file(self):
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _rewrite(self, line):
        """Replace log.csv by the current header, this run's rows so far padded to it, then line."""
        width = 1 + len(self.ordered_keys)
        self._close_file()

        def write(f):
            f.write(_csv_line(["step"] + self.ordered_keys))
            if self._owns_file:
                with open(self.path, "rb") as old:
                    old.readline()  # the old header
                    for _, _, raw, complete in _records(old):
                        if not complete:
                            continue  # the rest of an append that failed and could not be cut back
                        cells = _cells(raw)
                        missing = width - len(cells) if cells is not None else 0
                        body = raw.rstrip(b"\r\n")
                        f.write(body + b"," * max(missing, 0) + raw[len(body):])
            f.write(line)

        _replace_file(self.path, write, "rewriting it with a new column")
        self._owns_file = True
        self._header_keys = len(self.ordered_keys)
        self._open_for_append()

    def _resume(self, resume_step):
        """Keep the valid rows of steps before resume_step (see the module docstring)."""
        with open(self.path, "rb") as f:
            header_line = f.readline()
            if not header_line:  # an empty file: start afresh
                if resume_step:
                    self._report([f"{self.path} is empty: {_steps(0, resume_step - 1)} missing "
                                  f"(the run resumes at step {resume_step})"])
                return
            header = _cells(header_line) if header_line.endswith(b"\n") else None
            if not header or header[0] != "step":
                found = (f"the first column is {header[0]!r}, not 'step'" if header else
                         "the first line is not a CSV header (binary, or not UTF-8 text)")
                raise NotALogError(f"{self.path}: {found}: not a log this program wrote; "
                                   f"move it away or use another out_dir")
            problems = []  # one line each
            rejected = {}  # byte offset -> raw row, to move to log.csv.rejected
            previous = None  # the step of the last row kept
            cut = None  # where the kept rows end: the first row at or after resume_step, or a torn last row
            for line_number, offset, raw, complete in _records(f):
                where = f"{self.path} line {line_number}"
                moved = f"moved to {LOG_NAME}{REJECTED_SUFFIX}"
                if not complete:  # a write cut short: a row to be redone, or one lost
                    cut = offset
                    first = raw.split(b",", 1)[0]
                    if not (first.isdigit() and int(first) >= resume_step):
                        problems.append(f"{where}: a row cut short by a kill or a full disk; {moved}")
                        rejected[offset] = raw + b"\r\n"
                    break
                cells = _cells(raw)
                step = int(cells[0]) if cells and re.fullmatch(r"-?[0-9]+", cells[0]) else None
                if cells is None:
                    problem = _not_cells(raw)
                elif len(cells) > len(header):
                    problem = f"{len(cells)} cells for {len(header)} columns"
                elif step is None:
                    problem = f"the step {cells[0][:20]!r} is not an integer" if cells else "an empty line"
                elif step >= resume_step:
                    cut = offset
                    break
                elif previous is not None and step <= previous:
                    problem = f"step {step} after step {previous}"
                elif self.numbers_only and not all(_is_number(c) for c in cells[1:]):
                    problem = f"the cell {next(c for c in cells[1:] if not _is_number(c))[:20]!r} is not a number"
                else:
                    if step > (-1 if previous is None else previous) + 1:
                        problems.append(f"{where}: {_steps(previous + 1 if previous is not None else 0, step - 1)} missing")
                    previous = step
                    continue
                problems.append(f"{where}: {problem}; {moved}")
                rejected[offset] = raw
            if cut is None:
                cut = f.tell()
        if (-1 if previous is None else previous) < resume_step - 1:
            problems.append(f"{self.path}: {_steps(0 if previous is None else previous + 1, resume_step - 1)} missing "
                            f"(the log ends before step {resume_step}, where the run resumes)")
        self._report(problems)
        self._keep(header_line, cut, rejected, resume_step)
        self.ordered_keys = header[1:]
        self._known = set(self.ordered_keys)
        self._header_keys = len(self.ordered_keys)

    def _report(self, problems):
        for problem in problems[:MAX_REPORTED]:
            warnings.warn(problem, stacklevel=4)
        if len(problems) > MAX_REPORTED:
            warnings.warn(f"{self.path}: {len(problems) - MAX_REPORTED} more problems like these", stacklevel=4)

    def _keep(self, header_line, cut, rejected, resume_step):
        """Cut log.csv at byte `cut`, moving the rows in `rejected` and those from `cut` on (the steps the
        run redoes, under the header they had) to log.csv.rejected; leaves log.csv open for appends."""
        rejected_path = self.path + REJECTED_SUFFIX
        with open(self.path, "rb") as f:
            f.seek(cut)
            redone = f.read()
        if redone and cut not in rejected:  # (a torn row before resume_step is reported as one)
            rows = redone.count(b"\n") + (not redone.endswith(b"\n"))
            rejected = {**rejected, cut: header_line + redone + (b"" if redone.endswith(b"\n") else b"\r\n")}
            print(f"note: {self.path}: {rows} row{'s' if rows > 1 else ''} from step {resume_step} on, which the run "
                  f"redoes, moved to {LOG_NAME}{REJECTED_SUFFIX}")
        if rejected:
            rejected_size = _append_to_path(rejected_path, b"".join(rejected.values()),
                                            f"saving the malformed rows of {self.path}")
        try:
            if all(offset >= cut for offset in rejected):
                # the usual case: nothing to take out before the cut, so no second copy of the file
                self._open_for_append()
                if self._size > cut:
                    try:
                        os.ftruncate(self._fd, cut)
                        os.fsync(self._fd)
                    except OSError as e:
                        self._close_file()
                        raise _write_failed(self.path, e, f"cutting it before step {resume_step} to resume") from None
                    self._size = cut
            else:
                def write(out):
                    out.write(header_line)
                    with open(self.path, "rb") as f:
                        f.readline()
                        for _, offset, raw, _ in _records(f):
                            if offset >= cut:
                                break
                            if offset not in rejected:
                                out.write(raw)

                _replace_file(self.path, write, "taking its malformed rows out")
                self._open_for_append()
        except LogWriteError:
            if rejected:  # log.csv still has them: do not save them twice
                try:
                    os.truncate(rejected_path, rejected_size)
                except OSError:
                    pass
            raise
        self._owns_file = True

    # -- printing -------------------------------------------------------------------------------

    def print(self, fmt, prefix=None):
        """
        Print (and return) fmt filled from the most recent logged values. "{name}" and
        "{name:spec}" give the value, "{name=}" and "{name=:spec}" give "key=value", like an
        f-string. A name is looked up as a logged key: first exactly, then as the one key that
        reads the same with every '/' turned into '_' (so train_lossf finds train/lossf); with
        prefix, only keys starting with it are searched, and without it. Two keys that match the
        same name are an error; a name not logged yet prints as n/a, with a warning once.
        """
        text = self.format(fmt, prefix)
        print(text)
        return text

    def format(self, fmt, prefix=None):
        prefix = prefix or ""
        out = []
        for literal, field, spec, conversion in string.Formatter().parse(fmt):
            out.append(literal)
            if field is None:
                continue
            show_name = field.endswith("=")
            name = field[:-1] if show_name else field
            key = self._resolve(name, prefix)
            if key is None:
                if name not in self._missing_warned:
                    self._missing_warned.add(name)
                    warnings.warn(f"LogWrapper.print: nothing logged under {prefix + name!r} yet")
                label, text = name, "n/a"
            else:
                value = self.latest[key]
                if conversion:
                    value = {"r": repr, "s": str, "a": ascii}[conversion](value)
                label, text = key[len(prefix):], format(value, spec)
            out.append(f"{label}={text}" if show_name else text)
        return "".join(out)

    def _resolve(self, name, prefix):
        if prefix + name in self.latest:
            return prefix + name
        matches = [k for k in self.latest if k.startswith(prefix) and k[len(prefix):].replace("/", "_") == name]
        if len(matches) > 1:
            raise ValueError(f"LogWrapper.print: {name!r} matches several logged keys {matches}; write the key exactly")
        return matches[0] if matches else None


def logged_row(path, step):
    """{column: cell} of the first complete row of `step` in the log at path (cells as the file holds
    them, empty ones left out), or None where it has no such row or cannot be read. Reads, never writes."""
    prefix = f"{step},".encode()
    try:
        with open(path, "rb") as f:
            header = _cells(f.readline())
            for _, _, raw, complete in _records(f):
                if complete and raw.startswith(prefix):
                    cells = _cells(raw)
                    if not header or cells is None:
                        return None
                    return {k: c for k, c in zip(header[1:], cells[1:]) if c != ""}
    except OSError:
        return None
    return None


# ---------------------------------------------------------------------------------------------
# The reference implementation's names (exact/tracker.py)

def log_for_run(config, resume_step, kinds):
    """
    train.py's log, from its config: out_dir/log.csv (numbers only, a row per iteration), config.json
    and layer_kinds.json (`kinds`: the measured layers', see record_kinds), none of them with
    eval_only; wandb with wandb_log. resume_step: the iteration a resumed run restarts from, else
    None. Raises ValueError (a log.csv a resume refuses) or OSError.
    """
    logger = LogWrapper(config=config, out_dir=None if config['eval_only'] else config['out_dir'],
                        resume_step=resume_step, numbers_only=True, wandb_log=config['wandb_log'],
                        wandb_project=config['wandb_project'], wandb_run_name=config['wandb_run_name'])
    logger.record_kinds(kinds)
    return logger


class OutDirInUse(Exception):
    """out_dir cannot be this run's: a live holder has its lock (another process, or an earlier
    GNSMeter of this process not closed), it holds another run's log (OutDirTaken), or it cannot
    be created or written. The message, one line, names the holder and the way out."""


class OutDirTaken(OutDirInUse, FileExistsError):
    """out_dir holds another run's log, which a fresh GNSMeter does not write over: an OutDirInUse,
    and a FileExistsError for callers that catch that."""


class OutDirNotWritable(OutDirInUse, PermissionError):
    """out_dir cannot be written (its permissions, a read-only file system): an OutDirInUse, and a
    PermissionError for callers that catch that."""


def not_writable(out_dir, error=None):
    """OutDirNotWritable for out_dir: a read-only file system, or permissions (error: the OSError met)."""
    if error is not None:
        read_only = error.errno == errno.EROFS
    else:
        read_only = os.statvfs(out_dir).f_flag & os.ST_RDONLY
    reason = "a read-only file system" if read_only else "permission denied"
    return OutDirNotWritable(f"{out_dir} cannot be written ({reason}): make it writable, or use another out_dir")


# what a run of train.py leaves in its out_dir (grad_accum_schedule.txt stays: the user edits it)
RUN_FILES = ("log.csv", "log.csv.rejected", "ckpt.pt", "config.json", "layer_kinds.json", "linear_norm_methods.json")


def lock_out_dir(out_dir, set_aside=False, holder="train.py"):
    """
    Hold out_dir/train.lock while the run lives, so that a second run on the same out_dir (a
    relaunch while this one still runs, a typo in a sweep) stops at once instead of writing over
    this one's log and checkpoints. flock is released by the kernel when a process dies, however it
    dies, so a lock left by a killed run is simply taken over (the file names its last holder; a
    process that exits by itself, a torchrun rank through stopping.leave too, empties it at exit).
    Creates out_dir if need be. Returns the open lock file (keep it: closing it releases the lock),
    saying which holder it takes over, or raises OutDirInUse, whose message is one line
    (OutDirNotWritable where out_dir cannot be written).
    set_aside (a fresh run): an earlier run's files are moved into out_dir/previous-run-<time>/
    first, with a note, rather than written over (set_aside_previous_run).
    holder: what holds the lock, named to whoever finds it taken ("train.py", "GNSMeter"). The
    lock is per open file, so a second lock in one process is refused too: that message names
    the earlier holder in this process, which must release it (a GNSMeter's close()).
    """
    import fcntl
    import socket
    problem = directory_problem(out_dir)
    if problem:  # makedirs would say only "File exists"
        raise OutDirInUse(f"{out_dir} cannot be made: {problem}")
    try:
        os.makedirs(out_dir, exist_ok=True)
        f = open(os.path.join(out_dir, "train.lock"), "a+")
    except PermissionError as e:
        raise not_writable(out_dir, e) from None
    except OSError as e:
        if e.errno == errno.EROFS:
            raise not_writable(out_dir, e) from None
        raise OutDirInUse(f"{out_dir}: cannot write there ({e.strerror or e})") from None
    if not os.access(out_dir, os.W_OK | os.X_OK):  # train.lock, left by a run, may be writable where out_dir is not
        f.close()
        raise not_writable(out_dir)
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        where, kind = _lock_holder(f.read())
        f.close()
        if where == f"pid {os.getpid()} on {socket.gethostname()}":  # flock is per open file: ours, not closed
            raise OutDirInUse(f"{out_dir} is held by an earlier {kind} in this process ({where}), not released: "
                              f"{'close() that meter' if kind == 'GNSMeter' else 'release its lock'} first "
                              f"(an interrupted run leaves it open), or use another out_dir") from None
        raise OutDirInUse(f"{out_dir} is in use by another {kind} ({where or 'process unknown'}); wait for it to "
                          f"end, or use another out_dir") from None
    f.seek(0)
    where, kind = _lock_holder(f.read())
    if where:  # a clean end empties the file: this holder was killed
        print(f"note: taking over {out_dir}/train.lock from {where} ({kind}), which is no longer running")
    try:
        f.truncate(0)
        f.write(f"pid {os.getpid()} on {socket.gethostname()}\n{holder}\n")
        f.flush()
    except OSError as e:  # a full disk: the name of its holder cannot be written
        try:
            f.close()  # (its flush fails again, and it closes all the same, releasing the lock)
        except OSError:
            pass
        reason = "the disk is full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else (e.strerror or str(e))
        raise OutDirInUse(f"{out_dir}: cannot write {os.path.join(out_dir, 'train.lock')} ({reason})") from None
    atexit.register(release_out_dir, f)  # an exit the process makes itself (an end, a stop, an error) empties it
    if set_aside:
        try:
            set_aside_previous_run(out_dir)
        except OSError as e:
            release_out_dir(f)
            raise OutDirInUse(f"{out_dir} holds an earlier run that could not be moved aside "
                              f"({e.strerror or e}); resume it with --init_from=resume, or use another out_dir") from None
    return f


def _lock_holder(text):
    """(where, what) of a lock file's holder: 'pid N on host' and what it is ('train.py' for a file
    that names no kind); where is '' for an empty file (no live holder)."""
    lines = text.strip().splitlines()
    return (lines[0] if lines else ""), (lines[1] if len(lines) > 1 else "train.py")


def directory_problem(path):
    """Why os.makedirs(path) cannot make the directory path, in words, where a part of it is in the
    way: a symbolic link to nothing, or something that is not a directory. None otherwise."""
    parts = os.path.normpath(path).split(os.sep)
    for i in range(1, len(parts) + 1):
        here = os.sep.join(parts[:i]) or os.sep  # each part in turn, from the first
        if os.path.islink(here) and not os.path.exists(here):
            return f"{here} is a symbolic link to {os.readlink(here)!r}, which does not exist"
        if os.path.lexists(here) and not os.path.isdir(here):
            return f"{here} is not a directory"
    return None


def set_aside_previous_run(out_dir):
    """
    A fresh run into an out_dir that holds an earlier run (its log.csv or ckpt.pt) would write over
    that run's log and checkpoint, which may be hours of training: its files (RUN_FILES) are moved
    into out_dir/previous-run-<time>/ instead, and a note says where and how to resume it. Returns
    that folder, or None when there was nothing to move. Raises OSError where a move fails.
    """
    found = [name for name in RUN_FILES if os.path.isfile(os.path.join(out_dir, name))]
    if not any(name in found for name in ("log.csv", "ckpt.pt")):
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(os.path.getmtime(os.path.join(out_dir, found[0]))))
    folder, n = os.path.join(out_dir, f"previous-run-{stamp}"), 1
    while os.path.exists(folder):
        n += 1
        folder = os.path.join(out_dir, f"previous-run-{stamp}-{n}")
    os.makedirs(folder)
    for name in found:  # a rename within the folder: whole or not at all, each file
        os.replace(os.path.join(out_dir, name), os.path.join(folder, name))
    print(f"note: {out_dir} held an earlier run ({', '.join(found)}); moved into {folder}/ "
          f"(to continue that run instead, move its files back and use --init_from=resume)")
    return folder


def release_out_dir(lock):
    """Give up lock_out_dir's lock: its file emptied (no holder named) and closed."""
    if not lock.closed:
        lock.truncate(0)
        lock.close()


def transform_format_string(s):
    """
    '{x=}' -> 'x={x}' and '{x=:.2f}' -> 'x={x:.2f}': f-string '=' fields made fit for str.format.
    (LogWrapper.print understands them itself, and '_' for '/' in names.)
    """
    def expand(match):
        name, spec = match.group(1), match.group(2) or ""
        return name + "={" + name + spec + "}"
    return re.sub(r"\{(\w+)=(:[^{}]*)?\}", expand, s)


__getattr__ = module_refusals("tracker")  # the reference's names not kept (tracker.<name>)

