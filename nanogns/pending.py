"""
The training loop's per-step values, kept on the device until the loop logs. On a GPU every read
of a tensor's value (.item(), .tolist(), float()) waits for all the work queued before it, so a
step that reads its loss, its gradient norm and its GNS sums waits for the device three times and
the host never runs ahead. PendingSteps holds each step's row with its device values in place and
reads the values of every pending step in one copy, when the loop asks for the rows:

    pending = PendingSteps()
    ... each step:
    pending.add({'iter_num': i, 'loss': loss.detach(), ...}, nanogns.estimators.exact.collect_all(...))
    if i % log_interval == 0:
        for row in pending.read():   # one device-to-host copy for all the steps since the last read
            logger.log(row)
"""
import numpy as np
import torch


class PendingSteps:
    """Steps whose rows still hold device values. A row is a dict: its tensor values (0-dim, any
    dtype, or a replicated DTensor) become Python numbers of their own dtype where they stand (an
    int64 stays an exact int), and each (values, finish) pair collected by an estimator
    (Estimator.collect) adds finish(values read) after them, in the step's order."""

    LIMIT = 1000  # steps a loop keeps pending at most, whatever its log interval

    def __init__(self):
        self.steps = []

    def __len__(self):
        return len(self.steps)

    def add(self, row, collected=()):
        """Keep a step's row (the dict itself: values added to it before read() are kept too)."""
        self.steps.append((row, list(collected)))

    def read(self):
        """Every pending step's row, in order, as an iterator, the values of them all read now in one
        copy; none is pending after. A finish that raises does so as its row comes: the rows before
        it have come out whole (a loop that logs each as it comes keeps them); the rest are dropped."""
        steps, self.steps = self.steps, []
        parts = []
        for row, collected in steps:
            parts += [_local(value).detach() for value in row.values() if isinstance(value, torch.Tensor)]
            parts += [values for values, _ in collected if values is not None]
        host = iter(_read_in_one_copy(parts))
        return self._rows(steps, host)

    @staticmethod
    def _rows(steps, host):
        for row, collected in steps:
            for key, value in row.items():
                if isinstance(value, torch.Tensor):
                    row[key] = next(host)[0]
            for values, finish in collected:
                row.update(finish(next(host) if values is not None else []))
            yield row


# numpy's reading of torch's dtypes, by the bytes; bfloat16 (which numpy lacks) is float32's upper half
NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
                torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16, torch.int8: np.int8,
                torch.uint8: np.uint8, torch.bool: np.bool_}


def _read_in_one_copy(tensors):
    """Each tensor's values as a list of Python numbers of its dtype, all of them brought to the host
    in one copy of their bytes laid end to end."""
    if not tensors:
        return []
    device = tensors[0].device
    flat = [t.to(device).reshape(-1).contiguous() for t in tensors]
    flat = [t if t.dtype in NUMPY_DTYPES or t.dtype == torch.bfloat16 else t.float() for t in flat]
    data = torch.cat([t.view(torch.uint8) for t in flat]).cpu().numpy()  # the one copy
    values, at = [], 0
    for t in flat:
        size = t.numel() * t.element_size()
        chunk = data[at:at + size]
        at += size
        if t.dtype == torch.bfloat16:
            numbers = (chunk.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            numbers = chunk.view(NUMPY_DTYPES[t.dtype])
        values.append(numbers.tolist())
    return values


def _local(value):
    """A replicated DTensor (FSDP's gradient norm) as its local value, which is the whole of it."""
    return value.to_local() if hasattr(value, "to_local") else value
