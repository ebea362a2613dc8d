"""
Schedules over tokens: the learning rate, the gradient-accumulation (batch-size) schedule that a
user may edit while the run goes on, and the batch-size controller that follows the measured GNS.

Training is denominated in tokens, not iterations, so that runs with different or changing
batch sizes follow the same schedule.
"""
import math
import os

from nanogns.runlog import atomic_write, read_text_file

# A schedule is a few lines. A bigger file is a mistake (a log or a dataset copied over it):
# refused unread, so it can neither stall a step nor fill the log.
MAX_SCHEDULE_BYTES = 64 * 1024
# The per-example-norm layers count examples in float32 buffers (nanogns/layers), exact up to 2**24:
# past that the GNS tracker finds the count wrong and fails the step, after all its micro-steps.
MAX_STEP_EXAMPLES = 2 ** 24


LR_DECAY_SHAPES = ('linear', 'cosine')


def lr_at(tokens, learning_rate, min_lr, warmup_tokens, lr_decay_tokens, decay_lr=True, shape='linear'):
    """Linear warmup from 0 to learning_rate over warmup_tokens, then decay to min_lr at
    lr_decay_tokens, then min_lr. The decay is linear (the Cerebras-GPT recipe the paper trains
    with) or, shape='cosine', half a cosine (nanoGPT's). `tokens` counts the tokens of the step
    being taken, so the first step gets a small positive rate rather than zero."""
    if not decay_lr:
        return learning_rate
    if tokens < warmup_tokens:
        return learning_rate * tokens / warmup_tokens
    if tokens >= lr_decay_tokens:
        return min_lr
    frac = (tokens - warmup_tokens) / max(lr_decay_tokens - warmup_tokens, 1)
    if shape == 'cosine':
        frac = 0.5 * (1.0 - math.cos(math.pi * frac))
    return learning_rate + frac * (min_lr - learning_rate)


def max_accumulation_steps(max_tokens, batch_size, block_size, world_size=1):
    """The most (global) accumulation steps a schedule may ask for: as many as one step needs to
    reach max_tokens, ceil(max_tokens / tokens of one micro-step on all ranks) on each rank, since
    a larger step only overshoots the whole run (and its count is fixed when it starts: `0, 1e12`
    would never log again), and at most MAX_STEP_EXAMPLES examples a step. A multiple of
    world_size, because steps_at divides the count across ranks, rounding up."""
    per_rank = math.ceil(max_tokens / (world_size * batch_size * block_size))
    per_rank = min(per_rank, MAX_STEP_EXAMPLES // (world_size * batch_size))
    return world_size * max(per_rank, 1)


def quote(line, limit=80):
    """A bad line for a one-line message: at most `limit` characters of it, control characters
    escaped, so that no file can make a long or multi-line warning."""
    return repr(line[:limit]) + ('...' if len(line) > limit else '')


def parse_schedule(text, max_steps=None):
    """'tokens, accumulation_steps' pairs, one per line ('#' comments and blank lines allowed,
    '_' separators in numbers: '1_000_000, 4'). Returns a sorted list of (tokens, steps).
    Raises ValueError saying which line is wrong, steps over max_steps (if given) included."""
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
            raise ValueError(f"line {lineno}: expected 'tokens, accumulation_steps', got {quote(line)}")
        if tokens < 0 or steps <= 0 or not math.isfinite(tokens) or not math.isfinite(steps):
            raise ValueError(f"line {lineno}: tokens must be >= 0 and steps > 0, got {quote(line)}")
        if max_steps is not None and steps > max_steps:
            raise ValueError(f"line {lineno}: {steps:g} accumulation steps is over the bound of {max_steps:_} "
                             f"(see schedules.max_accumulation_steps), got {quote(line)}")
        points.append((tokens, steps))
    if not points:
        raise ValueError("no 'tokens, accumulation_steps' lines")
    return sorted(points)


def _number(x):
    # whole numbers exactly and with '_' separators; parse_schedule reads back the same value
    return f"{int(x):_}" if float(x).is_integer() else repr(float(x))


def format_schedule(points):
    return "".join(f"{_number(t)}, {_number(s)}\n" for t, s in points)


def describe_schedule(points):
    """One short line for the log, however many points: the first two and the last of a long one."""
    shown = points if len(points) <= 4 else [*points[:2], None, points[-1]]
    text = "; ".join("..." if p is None else f"{_number(p[0])}: {_number(p[1])}" for p in shown)
    return f"{text} ({len(points)} point{'s' if len(points) > 1 else ''})"


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


def read_schedule_file(path, max_bytes=MAX_SCHEDULE_BYTES):
    """The text of the schedule file: nanogns.runlog.read_text_file's, a regular file of at most max_bytes,
    read without ever blocking. Raises OSError or ValueError (one line)."""
    return read_text_file(path, max_bytes)


def rank0s(value, ddp_device):
    """Rank 0's whole number on every rank under DDP (ddp_device set); the value itself without.
    What sizes a step must be the same everywhere, whatever each rank read or computed."""
    if ddp_device is None:
        return value
    import torch  # here: only DDP runs need torch in this module
    value = torch.tensor([value], device=ddp_device)
    torch.distributed.broadcast(value, 0)
    return int(value.item())


class GradAccumSchedule:
    """The schedule file in out_dir, re-read at the start of every step (it is small, and an
    edit must be seen even where it leaves the size and mtime as they were). An edit that does
    not parse or asks for more than max_steps (global accumulation steps; see
    max_accumulation_steps) keeps the last good schedule and warns once per bad edit; a file
    that cannot be read (gone, not a regular file, too big) does too. It never stops the run."""

    def __init__(self, path, default_points=None, *, max_steps, log=print, ddp_device=None):
        self.path = path
        self.ddp_device = ddp_device
        self.max_steps = max_steps
        self.log = log
        self._unreadable = None  # the warning about a file that could not be read, given once
        if not os.path.exists(path):
            if default_points is None:
                raise FileNotFoundError(f"batch-size schedule {path} not found")
            text = (f"# tokens, gradient_accumulation_steps (global, at most {max_steps:_}): "
                    "piecewise linear, edit me mid-run\n" + format_schedule(default_points))
            try:  # what the run writes must be what it accepts
                parse_schedule(text, max_steps)
            except ValueError as e:
                raise ValueError(f"batch-size schedule for {path}: {e}") from None
            atomic_write(path, lambda f: f.write(text), mode='w')
        try:  # a run does not start on a file it would refuse
            self._text = read_schedule_file(path)
            self.points = parse_schedule(self._text, max_steps)
        except (OSError, ValueError) as e:
            raise ValueError(f"batch-size schedule {path}: {e}") from None

    def reload(self):
        try:
            text = read_schedule_file(self.path)
        except (OSError, ValueError) as e:
            problem = f"warning: cannot read {self.path} ({e}); keeping the last good schedule"
            if problem != self._unreadable:
                self.log(problem)
                self._unreadable = problem
            self._text = None
            return self.points
        self._unreadable = None
        if text == self._text:
            return self.points
        self._text = text
        try:
            points = parse_schedule(text, self.max_steps)
        except ValueError as e:
            self.log(f"warning: {self.path}: {e}; keeping the last good schedule")
            return self.points
        if points != self.points:
            self.log(f"batch-size schedule reloaded from {self.path}: {describe_schedule(points)}")
        self.points = points
        return points

    def steps_at(self, tokens, world_size=1):
        """Accumulation steps per rank for the step starting now (call it at every step start);
        under DDP, rank 0's on every rank."""
        self.reload()
        return rank0s(steps_at(self.points, tokens, world_size), self.ddp_device)

    def row(self):
        return {}

    def status(self):
        return ""


def schedule_for_run(config, world_size, master_process, ddp_device=None):
    """
    train.py's --bs_schedule=True: the GradAccumSchedule in out_dir/grad_accum_schedule.txt, which
    the master writes first if there is none (bs_schedule_points, or by default 2 steps at 0 tokens
    to the configured accumulation at max_tokens); every rank then reads it, and under DDP
    (ddp_device set) every rank takes rank 0's count: the ranks may read the file either side of an
    edit. A step never takes more micro-steps than reach max_tokens: a larger count in the file is
    refused. Raises ValueError.
    """
    batch_size, block_size = config['batch_size'], config['block_size']
    max_steps = max_accumulation_steps(config['max_tokens'], batch_size, block_size, world_size)
    end = min(config['gradient_accumulation_steps'], max_steps)  # the configured (global) accumulation
    points = config['bs_schedule_points'] or [(0, min(2, end)), (config['max_tokens'], end)]
    path = os.path.join(config['out_dir'], 'grad_accum_schedule.txt')
    try:
        if master_process:
            GradAccumSchedule(path, points, max_steps=max_steps)
        if ddp_device is not None:
            import torch.distributed
            torch.distributed.barrier()
        return GradAccumSchedule(path, max_steps=max_steps, log=print if master_process else (lambda *a: None),
                                 ddp_device=ddp_device)
    except FileNotFoundError as e:
        raise ValueError(str(e)) from None


# ---------------------------------------------------------------------------------------------
# The batch size from the measured GNS (--bs_controller=gns). McCandlish et al. (2018, sec. 2.2,
# App. D): B_noise = tr(S)/|G|^2 approximates the critical batch size, at which a run takes about
# twice the minimum steps and twice the minimum examples; a batch f * B_noise moves along that
# trade-off. B_noise grows as the loss falls, so the batch follows it up.

def target_accumulation(target_examples, batch_size, floor, ceiling, world_size=1, powers_of_two=False):
    """Global accumulation steps for a batch of target_examples: rounded up to whole micro-batches
    of batch_size examples, then to a multiple of world_size (each rank takes its share), or with
    powers_of_two to a power of two (OLMo-core changes its batch by whole factors only), clamped to
    [floor, ceiling] (both multiples of world_size, or powers of two)."""
    steps = math.ceil(target_examples / batch_size) if math.isfinite(target_examples) else floor
    steps = 1 << max(steps - 1, 0).bit_length() if powers_of_two else world_size * math.ceil(steps / world_size)
    return min(max(steps, floor), ceiling)


class GNSBatchController:
    """
    Sets the global accumulation steps from a live GNS, read through gns_source() -> (GNS in
    examples, steps its EMA has averaged), before every step (so after the last optimizer step):
    - target = fraction * GNS examples, made whole steps by target_accumulation();
    - until the EMA has averaged warmup_steps measured steps (its debiased average then rests on
      that many estimates; one step's is too noisy to size a batch) and whenever the GNS is not
      finite or not measured, the count stays where it is: at the floor before the first change;
    - a change comes at most once per update_tokens tokens, and a decrease only if allow_decrease
      (batch-growth schedules, like the reference's, only grow).
    Under DDP every rank takes rank 0's decision (rank0s). Its state (the count, the tokens at the
    last change, the target) goes into the checkpoint, so a resumed run continues it.
    """

    def __init__(self, gns_source, *, fraction, batch_size, floor, ceiling, warmup_steps, update_tokens,
                 allow_decrease=False, world_size=1, ddp_device=None, powers_of_two=False):
        self.gns_source = gns_source
        self.powers_of_two = powers_of_two  # the count a power of two (target_accumulation)
        self.fraction, self.batch_size = fraction, batch_size
        self.floor, self.ceiling, self.world_size = floor, ceiling, world_size
        self.warmup_steps, self.update_tokens, self.allow_decrease = warmup_steps, update_tokens, allow_decrease
        self.ddp_device = ddp_device
        self.accumulation = floor  # global
        self.changed_at = None  # tokens at the last change
        self.target = float('nan')  # examples

    def decide(self, gns, averaged_steps, tokens):
        """The global accumulation steps for the step starting at `tokens` (and the new state)."""
        if averaged_steps < self.warmup_steps or not math.isfinite(gns):
            self.target = float('nan')
            return self.accumulation
        self.target = self.fraction * gns
        steps = target_accumulation(self.target, self.batch_size, self.floor, self.ceiling, self.world_size,
                                    self.powers_of_two)
        too_soon = self.changed_at is not None and tokens - self.changed_at < self.update_tokens
        if steps == self.accumulation or too_soon or (steps < self.accumulation and not self.allow_decrease):
            return self.accumulation
        self.accumulation, self.changed_at = steps, tokens
        return steps

    def steps_at(self, tokens, world_size=1):
        """Accumulation steps per rank for the step starting now (GradAccumSchedule's interface)."""
        before, changed_at = self.accumulation, self.changed_at
        steps = rank0s(self.decide(*self.gns_source(), tokens), self.ddp_device)
        # every rank's state follows rank 0's decision, whatever it had decided itself
        self.accumulation, self.changed_at = steps, (tokens if steps != before else changed_at)
        return steps // world_size

    def row(self):
        """log.csv columns: the target batch in examples (NaN while warming up) and the global
        accumulation steps chosen."""
        return {'bs_controller/target_examples': self.target, 'bs_controller/accumulation_steps': self.accumulation}

    def status(self):
        target = "warming up" if math.isnan(self.target) else f"target {self.target:.4g}"
        return f"bs {target}, accum {self.accumulation}"

    def state_dict(self):
        return {'accumulation': self.accumulation, 'changed_at': self.changed_at, 'target': self.target}

    def load_state_dict(self, state):
        self.accumulation = min(max(int(state['accumulation']), self.floor), self.ceiling)
        self.changed_at, self.target = state['changed_at'], float(state['target'])


def controller_for_run(config, estimators, world_size, ddp_device=None, checkpoint=None):
    """
    train.py's --bs_controller=gns: a GNSBatchController on the exact estimator's live GNS of
    bs_gns_group (default: the group measured, LayerNorm when the LayerNorms alone are), resumed
    from a checkpoint's state. Without a measured GNS the batch stays at bs_min_accum (said once).
    Raises ValueError for a group that is not measured.
    """
    import nanogns.estimators.exact as exact
    measured = exact.measured_groups(estimators)
    group = config['bs_gns_group'] or (measured[0] if measured else 'total')
    if measured and group not in measured:
        raise ValueError(f"--bs_gns_group={group} but this run measures the GNS of {' and '.join(measured)} only "
                         f"(choose the layer classes with --linearclass, --embeddingclass, --lnclass)")
    if not measured:
        print(f"warning: --bs_controller=gns but no layer measures per-example gradient norms (--linearclass, "
              f"--embeddingclass, --lnclass): the batch stays at --bs_min_accum={config['bs_min_accum']}")
    update_tokens = config['bs_update_tokens']
    controller = GNSBatchController(
        lambda: exact.live_gns(estimators, group), fraction=config['bs_gns_fraction'],
        batch_size=config['batch_size'], floor=config['bs_min_accum'], ceiling=config['gradient_accumulation_steps'],
        warmup_steps=config['bs_warmup_steps'], allow_decrease=config['bs_allow_decrease'],
        update_tokens=config['max_tokens'] // 100 if update_tokens is None else update_tokens,
        world_size=world_size, ddp_device=ddp_device)
    if checkpoint is not None and 'bs_controller' in checkpoint:
        controller.load_state_dict(checkpoint['bs_controller'])
    return controller


def step_sizes_for_run(config, estimators, world_size, master_process, ddp_device=None, checkpoint=None):
    """What sets train.py's accumulation steps at every step, if not the config: the editable
    schedule (--bs_schedule=True), the controller on the live GNS (--bs_controller=gns), or None.
    Both answer steps_at(tokens, world_size), row() and status(). Raises ValueError."""
    if config['bs_schedule']:
        return schedule_for_run(config, world_size, master_process, ddp_device)
    if config['bs_controller'] == 'gns':
        return controller_for_run(config, estimators, world_size, ddp_device, checkpoint)
    return None
