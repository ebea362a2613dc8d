"""
Schedules over tokens: the learning rate, and the gradient-accumulation (batch-size) schedule
that a user may edit while the run goes on.

Training is denominated in tokens, not iterations, so that runs with different or changing
batch sizes follow the same schedule.
"""
import math
import os


def lr_at(tokens, learning_rate, min_lr, warmup_tokens, lr_decay_tokens, decay_lr=True):
    """Linear warmup from 0 to learning_rate over warmup_tokens, then linear decay to min_lr at
    lr_decay_tokens, then min_lr. `tokens` counts the tokens of the step being taken, so the
    first step gets a small positive rate rather than zero."""
    if not decay_lr:
        return learning_rate
    if tokens < warmup_tokens:
        return learning_rate * tokens / warmup_tokens
    if tokens >= lr_decay_tokens:
        return min_lr
    frac = (tokens - warmup_tokens) / max(lr_decay_tokens - warmup_tokens, 1)
    return learning_rate + frac * (min_lr - learning_rate)


def parse_schedule(text):
    """'tokens, accumulation_steps' pairs, one per line ('#' comments and blank lines allowed,
    '_' separators in numbers: '1_000_000, 4'). Returns a sorted list of (tokens, steps).
    Raises ValueError saying which line is wrong."""
    points = []
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.split('#', 1)[0].strip()
        if not line:
            continue
        parts = [p.strip().replace('_', '') for p in line.split(',')]
        try:
            if len(parts) != 2:
                raise ValueError
            tokens, steps = float(parts[0]), float(parts[1])
        except ValueError:
            raise ValueError(f"line {lineno}: expected 'tokens, accumulation_steps', got {line!r}")
        if tokens < 0 or steps <= 0 or not math.isfinite(tokens) or not math.isfinite(steps):
            raise ValueError(f"line {lineno}: tokens must be >= 0 and steps > 0, got {line!r}")
        points.append((tokens, steps))
    if not points:
        raise ValueError("no 'tokens, accumulation_steps' lines")
    return sorted(points)


def format_schedule(points):
    return "".join(f"{int(t):_}, {s:g}\n" for t, s in points)


def steps_at(points, tokens, world_size=1):
    """Accumulation steps per rank at `tokens`: piecewise-linear interpolation between the
    points (constant outside them), rounded up to whole steps, then divided across ranks
    (rounded up again, so the global batch is never smaller than scheduled)."""
    if tokens <= points[0][0]:
        steps = points[0][1]
    elif tokens >= points[-1][0]:
        steps = points[-1][1]
    else:
        for (t0, s0), (t1, s1) in zip(points, points[1:]):
            if t0 <= tokens <= t1:
                steps = s0 + (s1 - s0) * (tokens - t0) / (t1 - t0) if t1 > t0 else s1
                break
    return max(1, math.ceil(math.ceil(steps - 1e-9) / world_size))


class GradAccumSchedule:
    """The schedule file in out_dir, re-read whenever it changes on disk. An edit that does
    not parse keeps the last good schedule and warns once per bad edit; it never stops the run."""

    def __init__(self, path, default_points=None, log=print):
        self.path = path
        self.log = log
        self.points = None
        self._seen = None  # (mtime_ns, size) of the file version last read
        if not os.path.exists(path):
            if default_points is None:
                raise FileNotFoundError(f"batch-size schedule {path} not found")
            tmp = path + '.tmp'
            with open(tmp, 'w') as f:
                f.write("# tokens, gradient_accumulation_steps (global): piecewise linear, edit me mid-run\n")
                f.write(format_schedule(default_points))
            os.replace(tmp, path)
        self.reload()
        if self.points is None:
            raise ValueError(f"batch-size schedule {path} does not parse")

    def reload(self):
        try:
            st = os.stat(self.path)
        except OSError as e:
            if self._seen != 'missing':
                self.log(f"warning: cannot read {self.path} ({e}); keeping the last good schedule")
                self._seen = 'missing'
            return self.points
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self._seen:
            return self.points
        self._seen = stamp
        try:
            with open(self.path) as f:
                points = parse_schedule(f.read())
        except (OSError, ValueError) as e:
            self.log(f"warning: {self.path}: {e}; keeping the last good schedule")
            return self.points
        if self.points is not None and points != self.points:
            self.log(f"batch-size schedule reloaded from {self.path}: {points}")
        self.points = points
        return points

    def steps_at(self, tokens, world_size=1):
        self.reload()
        return steps_at(self.points, tokens, world_size)
