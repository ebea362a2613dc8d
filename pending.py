"""
The training loop's per-step values, kept on the device until the loop logs. On a GPU every read
of a tensor's value (.item(), .tolist(), float()) waits for all the work queued before it, so a
step that reads its loss, its gradient norm and its GNS sums waits for the device three times and
the host never runs ahead. PendingSteps holds each step's row with its device values in place and
reads the values of every pending step in one copy, when the loop asks for the rows:

    pending = PendingSteps()
    ... each step:
    pending.add({'iter_num': i, 'loss': loss.detach(), ...}, gnstracking.collect_all(...))
    if i % log_interval == 0:
        for row in pending.read():   # one device-to-host copy for all the steps since the last read
            logger.log(row)
"""
import torch


class PendingSteps:
    """Steps whose rows still hold device values. A row is a dict: its tensor values (0-dim, any
    dtype, or a replicated DTensor) become floats where they stand, and each (values, finish) pair collected by an
    estimator (Estimator.collect) adds finish(values read) after them, in the step's order."""

    LIMIT = 1000  # steps a loop keeps pending at most, whatever its log interval

    def __init__(self):
        self.steps = []

    def __len__(self):
        return len(self.steps)

    def add(self, row, collected=()):
        """Keep a step's row (the dict itself: values added to it before read() are kept too)."""
        self.steps.append((row, list(collected)))

    def read(self):
        """Every pending step's row, in order, with its values read in one copy; none is pending after."""
        steps, self.steps = self.steps, []
        parts = []
        for row, collected in steps:
            parts += [_local(value).detach().reshape(1) for value in row.values() if isinstance(value, torch.Tensor)]
            parts += [values.reshape(-1) for values, _ in collected if values is not None]
        if parts:
            device = parts[0].device
            host = torch.cat([part.to(device=device, dtype=torch.float32) for part in parts]).tolist()
        at = 0
        rows = []
        for row, collected in steps:
            for key, value in row.items():
                if isinstance(value, torch.Tensor):
                    row[key], at = host[at], at + 1
            for values, finish in collected:
                size = 0 if values is None else values.numel()
                row.update(finish(host[at:at + size] if size else []))
                at += size
            rows.append(row)
        return rows


def _local(value):
    """A replicated DTensor (FSDP's gradient norm) as its local value, which is the whole of it."""
    return value.to_local() if hasattr(value, "to_local") else value
