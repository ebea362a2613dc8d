"""
The per-example-norm buffers of the measured layers, the arithmetic they share, and their common
base MeasuredLayer.

Buffer convention (read by nanogns.estimators.exact):
- a measured module has a non-persistent float32 0-dim buffer `example_count` (examples seen
  since the last zeroing, summed over gradient-accumulation micro-steps), and
- for each of its parameters `name`, a non-persistent float32 0-dim buffer `{name}_sqgradnorm`,
  the running sum over examples b of ||g_b / B||^2 (the per-example gradient as the layer sees it).
Non-persistent buffers stay out of state_dict, so checkpoints load into plain nanoGPT and back.
Buffers accumulate (add_) in backward, so gradient-accumulation micro-steps sum; only
parameters that require grad are measured. The buffers stay float32 through model.half() and
model.to(torch.bfloat16). A layer's weight_pegsqnorm() / bias_pegsqnorm() give the reference
implementation's number, sum * count = (1/B) sum_b ||g_b||^2. Under a float16 GradScaler the
loss is scaled by s, so the buffers hold s^2 times the true sums: the tracker divides by s^2,
the layers never see s.

The first dimension of a layer's input indexes the examples: [B, T, ...] (the rest are summed
over within an example), a 2-D [N, K] input is N examples of one row each.
"""
import sys
import warnings

import torch
from torch.nn.utils.parametrize import is_parametrized

from nanogns.normgnorm.torch_path import SINK_SLOTS
from nanogns.refusals import refuse_layer_attribute


def register_sqgradnorm_buffers(module):
    """Give `module` an example counter and one float32 running-sum buffer per own parameter."""
    for name, _ in module.named_parameters(recurse=False):
        module.register_buffer(f"{name}_sqgradnorm", torch.zeros((), dtype=torch.float32), persistent=False)
    module.register_buffer("example_count", torch.zeros((), dtype=torch.float32), persistent=False)


def find_sqgradnorm_buffers(model):
    """
    One (name, parameter, sqgradnorm buffer, count buffer) per measured trainable parameter,
    in model.named_parameters() order, each parameter once (tied ones under their first name).
    A parameter that more than one module holds is measured only when those are a token
    embedding and an output head linked by tie_weights (or measure()): any other sharing, and a
    measured module that sits in the model twice, would give a part of its gradient, so such a
    parameter is left out with a warning naming it.
    """
    holders, found = {}, {}
    for module in model.modules(remove_duplicate=False):  # a module held twice is counted twice
        for p in module.parameters(recurse=False):
            holders.setdefault(id(p), []).append(module)
    for module in model.modules():
        if "example_count" not in module._buffers:
            continue
        localise_buffers(module)
        for pname, p in module.named_parameters(recurse=False):
            buf = module._buffers.get(f"{pname}_sqgradnorm")
            if buf is not None and p.requires_grad:
                found.setdefault(id(p), []).append((buf, module._buffers["example_count"]))
    entries = []
    for name, p in model.named_parameters():
        if id(p) not in found:
            continue
        shared_by = holders[id(p)]
        if len(found[id(p)]) == 1 and (len(shared_by) == 1 or _linked_pair(shared_by)):
            entries.append((name, p, *found[id(p)][0]))
        else:
            classes = ", ".join(type(m).__name__ for m in shared_by)
            _warn_once(f"{name} is shared by {len(shared_by)} layers ({classes}): only a token embedding tied "
                       "to an output head is measured exactly when shared; it is not reported")
    return entries


def _linked_pair(modules):
    """Whether `modules` are one token embedding and one output head linked by tie_weights."""
    return (len(modules) == 2 and modules[0] is not modules[1]
            and getattr(modules[0], "_tie", None) is not None and modules[0]._tie is getattr(modules[1], "_tie", None))


def _is_norm_buffer(name):
    # expert_examples: a mixture-of-experts layer's examples per expert (nanogns/layers/experts.py)
    return name in ("example_count", "expert_examples") or name.endswith("_sqgradnorm")


def localise_buffers(module):
    """parallelize_module (torch.distributed.tensor) turns every buffer of a module it shards into a
    replicated DTensor: the per-example-norm buffers of `module` go back to plain tensors, their local
    memory, which the backwards add to and the estimators read (nanogns/layers/sharded.py). A dict
    read where no DTensor was ever made."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    if dtensor is None:
        return
    for name, buf in list(module._buffers.items()):
        if isinstance(buf, dtensor) and (_is_norm_buffer(name) or name.endswith("_sqgrad_coords")):
            module._buffers[name] = buf.to_local()


def coordinate_buffers(model):
    """(name, parameter, per-coordinate sum buffer) of each parameter that has one, in named_parameters order."""
    found = {}
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            buffer = module._buffers.get(f"{name}_sqgrad_coords")
            if buffer is not None:
                found.setdefault(id(p), buffer)
    return [(name, p, found[id(p)]) for name, p in model.named_parameters() if id(p) in found]


def all_sqgradnorm_buffers(model):
    """Every per-example-norm buffer of `model`, the running sums and the example counts, each
    once, in module order: what is zeroed after a step and summed over DDP ranks before it."""
    found = {}
    for module in model.modules():
        if "example_count" in module._buffers:
            localise_buffers(module)
            for name, buf in module._buffers.items():
                if buf is not None and _is_norm_buffer(name):
                    found.setdefault(id(buf), buf)
    return list(found.values())


@torch.no_grad()
def allreduce_sqgradnorm_buffers(model, group=None):
    """
    Sum every per-example-norm buffer (all_sqgradnorm_buffers) over the ranks of `group`,
    in place, with one all_reduce of all of them stacked into one tensor. Call it on every rank
    after the last micro-step's backward, before the tracker reads the buffers (and before they
    are zeroed).

    Afterwards each count is the global batch B = W * B_rank, and each sum is
    S = sum over ranks of sum_b ||g_b / B_rank||^2: every rank's layers saw the gradient of its
    own rank's mean loss, not of the global one. The mean per-example squared norm is then
        |G_1|^2 = (B_rank^2 / B) * S = B * S / W^2,
    so the tracker must know W (the naive B * S is W^2 times too large). Under a float16
    GradScaler S is still s^2 times too large, as on one process.
    Under tensor or sequence parallelism, call allreduce_sharded_buffers first (its layers' sums over
    their TP groups), and give this the data-parallel ranks' group alone: W counts those.
    """
    allreduce_buffers(all_sqgradnorm_buffers(model), group)


@torch.no_grad()
def allreduce_buffers(bufs, group=None):
    """Sum the float32 tensors `bufs` (any shapes) over the ranks of `group` in place, with one
    all_reduce of them all laid end to end: one collective per step, however many layers."""
    if not bufs:
        return
    flat = torch.cat([b.reshape(-1) for b in bufs])
    torch.distributed.all_reduce(flat, group=group)
    torch._foreach_copy_(bufs, [part.view_as(b) for part, b in zip(flat.split([b.numel() for b in bufs]), bufs)])


def keep_out_of_ddp_broadcast(model):
    """Name `model`'s per-example-norm buffers in the list DistributedDataParallel (and torch's composable
    replicate, which builds one) reads when it is built, _ddp_params_and_buffers_to_ignore: with
    broadcast_buffers=True, its default, it would copy rank 0's buffers into every rank at each forward and
    overwrite each rank's sums. measure() calls it, so a model measured before it is wrapped is safe."""
    ddp_class = torch.nn.parallel.DistributedDataParallel
    ours = {id(b) for b in all_sqgradnorm_buffers(model)}
    names = [name for name, b in model.named_buffers() if id(b) in ours]
    ignored = list(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
    ddp_class._set_params_and_buffers_to_ignore_for_model(model, ignored + [n for n in names if n not in ignored])
    return names


@torch.no_grad()
def zero_sqgradnorm_buffers(model):
    """Zero every per-example-norm buffer in place (after each optimizer step)."""
    bufs = all_sqgradnorm_buffers(model)
    if bufs:
        torch._foreach_zero_(bufs)  # one call for all of them


_warned = set()


def _warn_once(message):
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)


# ---------------------------------------------------------------------------------------------
# Arithmetic the layers share: sums of squares (float32 results), chunks of examples, casts

# A CPU BLAS dot accumulates each SIMD lane serially: over 7M float32 elements on one thread
# it is off by 1.6e-4 relative (6e-5 on two). Dots over pieces of this many elements, summed
# in float64, are off by ~1e-7 for 1.5x the time of one dot.
CPU_DOT_PIECE = 1 << 16


def sum_of_squares(t):
    """Sum of squares of t as float32, accumulated in at least float32. Dot products: faster
    than vector_norm and more precise (on CPU a float32 vector_norm is off by ~5e-4 relative at
    7M elements); on CPU in pieces (CPU_DOT_PIECE), float16/bfloat16 pieces taken to float64
    (a float32 dot of 65536 equal squares is off by 2e-5 on one thread)."""
    flat = t.reshape(-1)
    low = flat.dtype not in (torch.float32, torch.float64)
    if flat.device.type == "cpu" and flat.numel() > CPU_DOT_PIECE:
        if low:
            flat = flat.double()  # the copy is needed anyway
        # the whole pieces' dots in one batched call (a call per piece cost more than the arithmetic)
        whole = flat.numel() - flat.numel() % CPU_DOT_PIECE
        pieces = flat[:whole].view(-1, 1, CPU_DOT_PIECE)
        total = torch.bmm(pieces, pieces.mT).sum(dtype=torch.float64)
        if whole < flat.numel():
            rest = flat[whole:]
            total = total + torch.dot(rest, rest)
        return total.float()
    if low:
        return torch.linalg.vector_norm(flat, dtype=torch.float32).square()
    return _cast(torch.dot(flat, flat), torch.float32)


def _chunk(per_example_numel, B, max_chunk_numel):
    """How many examples to process at once so the temporaries stay under max_chunk_numel."""
    return max(1, min(B, max_chunk_numel // max(1, per_example_numel)))


def _cast(t, dtype):
    """t in dtype, without a call when it is already (a no-op .to() still costs a dispatch)."""
    return t if t.dtype == dtype else t.to(dtype)


def _examples(t, trailing):
    """Number of examples in t: its first dimension, or 1 when it has only `trailing` dims."""
    return t.shape[0] if t.dim() > trailing else 1


def _hand_out(ctx, device, weight_sq, bias_sq, examples):
    """A Linear's or an Embedding's backward's sums (float32 0-dim, None where not measured) and its
    example count: added to the buffers ctx.bufs (weight's, bias's, count; eager), or, where
    ctx.sink, returned as the sink's gradient laid out as SINK_SLOTS (compiled: nothing written
    inside the backward); None then."""
    if ctx.sink:
        zero = torch.zeros((), dtype=torch.float32, device=device)
        return torch.stack([zero if weight_sq is None else weight_sq, zero if bias_sq is None else bias_sq,
                            zero + examples])
    for buf, value in zip(ctx.bufs, (weight_sq, bias_sq)):
        if value is not None:
            buf.add_(value)
    if ctx.bufs[2] is not None:
        ctx.bufs[2].add_(examples)
    return None


def _autocast_dtype(x):
    """The autocast compute dtype for x's device if autocast is on, else None."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


class MeasuredLayer:
    """
    Mixin of every per-example-norm layer: moves keep the buffers'
    values and casts keep them float32; the reference implementation's accessors read them.

    Under torch.compile no measured layer's backward writes a buffer: it returns its per-example
    sums as the gradient of the layer's sink, a float32 leaf vector laid out as sink_layout()
    (SINK_SLOTS, then whatever a class adds), and autograd accumulates that gradient like any
    other. A hook run as it lands adds it to the buffers and clears it, so the buffers stay what
    the estimators read, over any number of micro-steps. (A buffer written inside a compiled
    backward costs copies, rules out CUDA graphs and has open correctness bugs in torch.) In eager
    mode the backward adds to the buffers itself, and the sink is not used.
    The sink is neither a parameter nor a buffer (nothing optimises, saves, broadcasts or
    all-reduces it). It lives where the weight does, made anew wherever the weight is moved or
    assigned (measure() builds its layers on the meta device and then hands them their Parameters),
    a buffer is registered, or the layer is copied or unpickled.
    """

    # set by measure(): the model's forward state its pre-hook keeps (batch size, sequence length,
    # forward count), this layer's name in the model, and the forward it last measured in
    _forward_state = None
    _measured_name = None
    _last_forward = None
    # the kind layer_kinds gives this layer's parameters where its class or place says it (a router, a
    # shared expert: nanogns/layers/hf_moe.py, set by measure()); None: its measured class's kind
    _gns_kind = None

    def _check_call(self, n):
        """
        Refuse, by raising, a call of a layer of a measured model (in a forward with grad) whose
        per-example norm would be wrong:
        - its input has n rows (its first dimension) where the model's input has B examples: the
          rows are tokens (a [B*T, K] flattened batch, a per-token index), so its norms would be
          per-token ones counted as examples (a frozen layer measures nothing and passes);
        - it is applied a second time in one forward: each example's gradient would need the cross
          terms between the two uses, which nothing computes (the count would also come out 2B).
          Eager only: under torch.compile this one is skipped.
        """
        state = self._forward_state
        if state is None or not torch.is_grad_enabled():
            return
        B = state["B"]
        if B is not None and n != B and any(p is not None and p.requires_grad for p in self._parameters.values()):
            raise RuntimeError(f"{self._measured_name}: sees {n} rows, the batch has {B} examples: per-token input, "
                               "not measured; leave its block out with measure(model, kinds={Block: None})")
        if torch.compiler.is_compiling():
            return
        forward = state["forward"]
        if forward is not None and forward == self._last_forward:
            names = ", ".join(f"{self._measured_name}.{n}" for n, p in self.named_parameters(recurse=False))
            raise RuntimeError(f"{names}: the measured {type(self).__name__} {self._measured_name} was applied twice "
                               "in one forward; its per-example norm would need the cross terms between the uses. "
                               "Leave that kind unmeasured (measure(model, ...=None)) or apply each layer once")
        self._last_forward = forward

    def _apply(self, fn, recurse=True):
        ours = {n: b for n, b in self._buffers.items()
                if b is not None and (_is_norm_buffer(n) or n.endswith("_sqgrad_coords"))}
        for n in ours:
            del self._buffers[n]
        super()._apply(fn, recurse)
        for n, b in ours.items():
            moved = fn(b)
            self._buffers[n] = moved if moved.dtype == torch.float32 else b.to(moved.device)
        self._new_sink()
        return self

    # -- the sink (see the class docstring) --

    def sink_layout(self):
        """(buffer name, size) of each part of the sink, in order: SINK_SLOTS (a part whose buffer the
        layer has not, a Linear's bias's without a bias, holds 0 and goes nowhere)."""
        return [(name, 1) for name in SINK_SLOTS]

    def _new_sink(self):
        """A fresh sink, with its hook, where the weight is; None while there is no weight, or no
        buffers yet, or the weight is on the meta device."""
        weight = self._parameters.get("weight")
        if weight is None or weight.device.type == "meta" or "example_count" not in self._buffers:
            self.__dict__["_sink"] = None
            return
        self._sink_parts = self.sink_layout()  # read once: the hook runs at every backward
        sink = torch.zeros(sum(size for _, size in self._sink_parts), dtype=torch.float32, device=weight.device,
                           requires_grad=True)
        sink.register_post_accumulate_grad_hook(self._add_sink_grad)
        self.__dict__["_sink"] = sink

    def _add_sink_grad(self, sink):
        """The hook: what the backward passes handed the sink, added to the buffers."""
        grad, sink.grad = sink.grad, None
        bufs, parts = [], []
        for (name, _), part in zip(self._sink_parts, grad.split([size for _, size in self._sink_parts])):
            buf = self._buffers.get(name)
            if buf is not None:
                bufs.append(buf)
                parts.append(part.view(buf.shape))
        with torch.no_grad():
            torch._foreach_add_(bufs, parts)

    def _measures(self):
        """Whether a call now measures: grad is on, and a parameter of the layer's own trains."""
        return torch.is_grad_enabled() and any(p is not None and p.requires_grad for p in self._parameters.values())

    def _compiled_sink(self):
        """The sink while compiling a call that measures; None in eager mode, where the backward adds
        to the buffers itself."""
        return self.__dict__.get("_sink") if torch.compiler.is_compiling() and self._measures() else None

    def register_parameter(self, name, param):
        super().register_parameter(name, param)
        if name == "weight" and "example_count" in self._buffers:
            self._new_sink()

    def register_buffer(self, name, tensor, persistent=True):
        super().register_buffer(name, tensor, persistent)
        self._new_sink()

    def __setstate__(self, state):
        super().__setstate__(state)
        self._new_sink()

    # The reference implementation's accessors and buffer names. Its layers keep a [sum, count]
    # pair per parameter and give the product; here the sum and the count are two buffers.

    def weight_pegsqnorm(self):
        """weight_sqgradnorm * example_count = B sum_b ||g_b / B||^2 = (1/B) sum_b ||g_b||^2 (float32
        0-dim), as the reference's accessor; an error where the weight is not measured."""
        return self._pegsqnorm("weight")

    def bias_pegsqnorm(self):
        """bias_sqgradnorm * example_count, as weight_pegsqnorm(); an error where there is no bias."""
        return self._pegsqnorm("bias")

    def _pegsqnorm(self, name):
        where = f"{type(self).__name__}.{name}_pegsqnorm()"
        p = self._parameters.get(name)
        if p is None and is_parametrized(self, name):
            raise RuntimeError(f"{where}: the {name} is parametrized (a computed tensor), so it is not measured")
        if p is None:
            raise RuntimeError(f"{where}: this layer has no {name}, so there is nothing to measure")
        if not p.requires_grad:
            raise RuntimeError(f"{where}: the {name} does not require grad, so it is not measured")
        buf = self._buffers.get(f"{name}_sqgradnorm")
        if buf is None and getattr(self, "_tie", None) is not None:
            raise RuntimeError(f"{where}: this head's weight is tied to a token embedding, which measures the "
                               "shared weight exactly: use the embedding's weight_pegsqnorm()")
        if buf is None:
            raise RuntimeError(f"{where}: this {name} is tied to a layer that does not measure per-example "
                               "norms, so it is not measured")
        return buf * self.example_count

    def __getattr__(self, name):
        # the reference implementation's names (refusals.LAYER_ATTRIBUTES) are refused when asked for,
        # and stay out of dir(); everything else is nn.Module's (parameters, buffers, submodules)
        refuse_layer_attribute(name)
        return super().__getattr__(name)
