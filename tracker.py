"""
Logging for the training loop: a CSV that survives a crash, optional wandb, and a compact print.

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

Crash safety: every step() flushes and fsyncs its row, so all completed steps are on disk even
after a SIGKILL; a kill in the middle of a write leaves at most a last line without its newline,
which csv_tools drops. When a new key appears the whole file is rewritten with the longer header
into log.csv.tmp, fsynced, and swapped in with os.replace, so log.csv is always either the old
or the new complete file.

Resume: LogWrapper(..., resume_step=k) keeps the rows of steps before k, drops the rows at or
after k (written before the crash, they are about to be redone), and numbers the next step() k.
Without resume_step a new run starts a new log.csv (an old one is replaced at the first step()).

out_dir/config.json holds the run's configuration (rewritten by a resumed run).
"""
import csv
import json
import os
import string
import warnings

from csv_tools import LOG_NAME, read_rows


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


def _write_atomically(path, write):
    """Write a file through path.tmp + fsync + os.replace, so readers never see half of it."""
    tmp = path + ".tmp"
    with open(tmp, "w", newline="") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def _plain(value):
    # 0-dim tensors and numpy scalars become Python numbers (CSV cells, wandb, format specs)
    item = getattr(value, "item", None)
    return item() if callable(item) else value


class LogWrapper:
    """
    logf: optional callable that also receives every row as a dict ({"step": step, **values}).
    config: dict written to out_dir/config.json and given to wandb.
    out_dir: where log.csv and config.json go; None logs nowhere on disk.
    resume_step: the iteration a resumed run restarts from (see the module docstring).
    wandb_log, wandb_project, wandb_run_name: also log to wandb (imported only when asked for;
        honours WANDB_MODE, WANDB_DIR etc.).
    """

    def __init__(self, logf=None, config=None, out_dir=None, resume_step=None,
                 wandb_log=False, wandb_project="nanogns", wandb_run_name=None):
        self.logf = logf
        self.step_count = 0 if resume_step is None else int(resume_step)
        self.pending = {}   # this step's values, written by step()
        self.latest = {}    # the most recent value of every key ever logged, for print()
        self.columns = []   # CSV columns after `step`, in order of first appearance
        self._known = set()
        self._owns_file = False  # log.csv holds this run's rows (or the kept rows of a resumed one)
        self.path = None
        self._file = self._writer = None
        self._missing_warned = set()
        if out_dir is not None:
            os.makedirs(out_dir, exist_ok=True)
            self.path = os.path.join(out_dir, LOG_NAME)
            if config is not None:
                _write_atomically(os.path.join(out_dir, "config.json"),
                                  lambda f: json.dump(dict(config), f, indent=2, default=str))
            if resume_step is not None and os.path.isfile(self.path):
                self._resume(self.step_count)
        self.wandb_run = None
        if wandb_log:
            import wandb  # optional dependency: only needed when asked for
            self.wandb_run = wandb.init(project=wandb_project, name=wandb_run_name,
                                        config=dict(config) if config is not None else None)

    # -- logging --------------------------------------------------------------------------------

    def log(self, values):
        """Add values (a dict of name -> number or string) to this step's row; later values win."""
        for key, value in values.items():
            if key == "step":
                raise ValueError("'step' is the CSV's own first column; log the iteration as e.g. 'iter_num'")
            value = _plain(value)
            self.pending[key] = value
            self.latest[key] = value

    def step(self):
        """Write this step's row (if anything was logged) to the CSV, logf and wandb; next step."""
        step, self.step_count = self.step_count, self.step_count + 1
        if not self.pending:
            return
        row, self.pending = self.pending, {}
        if self.path is not None:
            self._write_row(step, row)  # the file first: it is what must survive a crash
        if self.logf is not None:
            self.logf({"step": step, **row})
        if self.wandb_run is not None:
            self.wandb_run.log(row, step=step)

    def close(self):
        """Close the CSV and finish the wandb run. Values logged after the last step() are not written."""
        if self.pending:
            warnings.warn(f"LogWrapper.close(): {len(self.pending)} value(s) logged after the last step() were not written")
            self.pending = {}
        if self._file is not None:
            self._file.close()
            self._file = self._writer = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- the CSV --------------------------------------------------------------------------------

    def _write_row(self, step, row):
        new_keys = [k for k in row if k not in self._known]
        self.columns += new_keys
        self._known.update(new_keys)
        cells = [step] + [row.get(k, "") for k in self.columns]
        if new_keys or self._file is None:
            self._rewrite(self._rows_on_disk(), [cells])
        else:
            self._writer.writerow(cells)
            self._file.flush()
            os.fsync(self._file.fileno())

    def _rows_on_disk(self):
        """The rows this run owns in log.csv (none before its first write, the old file is not ours)."""
        if self._file is not None:
            self._file.close()
            self._file = self._writer = None
        if not self._owns_file:
            return iter(())
        _, rows = read_rows(self.path)
        return rows

    def _rewrite(self, old_rows, new_rows):
        """Replace log.csv by the current header, old_rows padded to it, then new_rows."""
        width = 1 + len(self.columns)

        def write(f):
            writer = csv.writer(f)
            writer.writerow(["step"] + self.columns)
            for r in old_rows:
                writer.writerow(r + [""] * (width - len(r)))
            writer.writerows(new_rows)

        _write_atomically(self.path, write)
        self._owns_file = True
        self._file = open(self.path, "a", newline="")
        self._writer = csv.writer(self._file)

    def _resume(self, resume_step):
        header, rows = read_rows(self.path)
        if header is None:
            return  # an empty file: start afresh
        if header[0] != "step":
            raise ValueError(f"{self.path}: the first column is {header[0]!r}, not 'step'; not a log to resume")
        self.columns = header[1:]
        self._known = set(self.columns)

        def kept():
            for r in rows:
                try:
                    step = int(r[0])
                except (ValueError, IndexError):
                    raise ValueError(f"{self.path}: a row's step is {r[:1]!r}, not an integer; cannot resume") from None
                if step < resume_step:
                    yield r
        self._rewrite(kept(), [])

    # -- printing -------------------------------------------------------------------------------

    def print(self, fmt, prefix=""):
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

    def format(self, fmt, prefix=""):
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
