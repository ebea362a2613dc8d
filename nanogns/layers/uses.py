"""
A measured parameter used outside its layer: found in the autograd graph of a measured model's first
forward with grad, and refused.

A layer measures the gradient that reaches its parameter through the layer itself. If the forward
also uses the parameter elsewhere (F.linear(h, block.fc.weight) beside block.fc(x), a weight read for
a penalty in the forward, a head computed as x @ wte.weight.T), the parameter's gradient has a second
part that no layer sees, and its per-example norm would come out wrong with no sign of it.

The check: the graph from the forward's output down to the parameter (its AccumulateGrad node). The
nodes that a measured layer's own forward made are its inner nodes: those reachable from its output's
node without passing the nodes of its inputs. Every path from the parameter up to the output must
leave it through inner nodes of a layer that holds it (two, for a tied embedding and head) until it
reaches that layer's output. A path that reaches any other node first is a use outside. It runs on the
first forward with grad of the model, in eager mode, since a model's forward uses its parameters the
same way at every step; a use after the forward (in the loss code) is not in this graph.
"""
import torch


def _tensors(value, found):
    """The tensors in a forward's output: a tensor, or tuples, lists and dicts of them (a Hugging Face
    ModelOutput is a dict); anything else (a cache object) holds none we follow."""
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, (tuple, list)):
        for v in value:
            _tensors(v, found)
    elif isinstance(value, dict):
        for v in value.values():
            _tensors(v, found)
    return found


def _graph(roots):
    """Every node below `roots`: (parents, the nodes whose input each node is; accumulators, the
    AccumulateGrad node of each leaf by id)."""
    parents, accumulators, seen, stack = {}, {}, set(roots), list(roots)
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents.setdefault(child, []).append(node)
            if child not in seen:
                seen.add(child)
                stack.append(child)
                leaf = getattr(child, "variable", None)
                if leaf is not None:
                    accumulators[id(leaf)] = child
    return parents, accumulators


def _inner_nodes(output_node, input_nodes):
    """The nodes a layer's forward made: below its output's node, above its inputs' nodes."""
    inner, stack = {output_node}, [output_node]
    while stack:
        for child, _ in stack.pop().next_functions:
            if child is not None and child not in inner and child not in input_nodes:
                inner.add(child)
                stack.append(child)
    return inner


class LayerCalls:
    """What each measured layer's forward was handed and gave, recorded by forward hooks that live for
    one forward: (its measured name, its trainable parameters' names by id, the ids of those it measures,
    its output's node, its inputs' nodes)."""

    def __init__(self, layers):
        self.calls = []
        self.handles = [layer.register_forward_hook(self._record, with_kwargs=True) for layer in layers]

    def _record(self, layer, args, kwargs, output):
        if isinstance(output, torch.Tensor) and output.grad_fn is not None:
            inputs = {t.grad_fn for t in _tensors([args, kwargs], []) if t.grad_fn is not None}
            params = {id(p): name for name, p in layer._parameters.items() if p is not None and p.requires_grad}
            measured = {id(p) for name, p in layer._parameters.items()
                        if id(p) in params and f"{name}_sqgradnorm" in layer._buffers}
            self.calls.append((layer._measured_name, params, measured, output.grad_fn, inputs))

    def remove(self):
        for handle in self.handles:
            handle.remove()
        self.handles = []


def _user(node, parents):
    """The op that used the parameter, for the message: above the casts, views and transposes (one
    input, one user) that lead from the parameter to it."""
    for _ in range(8):
        ups = parents.get(node, ())
        if len(ups) != 1 or sum(child is not None for child, _ in node.next_functions) != 1:
            break
        node = ups[0]
    return node


def refuse_outside_uses(output, calls):
    """Raise a RuntimeError, one line, naming the first measured parameter that the forward giving
    `output` used outside the layers holding it (LayerCalls.calls)."""
    roots = [t.grad_fn for t in _tensors(output, []) if t.grad_fn is not None]
    if not roots or not calls:
        return
    parents, accumulators = _graph(roots)
    holders, measured = {}, set()  # parameter id -> [(layer name, parameter name, output node, inner nodes)]
    for name, params, measures, output_node, input_nodes in calls:
        measured |= measures
        inner = None
        for pid, pname in params.items():
            if pid in accumulators:
                inner = inner if inner is not None else _inner_nodes(output_node, input_nodes)
                holders.setdefault(pid, []).append((name, pname, output_node, inner))
    for pid, held in holders.items():
        if pid not in measured:  # left out already (a weight shared with an unmeasured layer)
            continue
        outputs = {output_node for _, _, output_node, _ in held}
        inner = set().union(*(nodes for _, _, _, nodes in held))
        start = accumulators[pid]
        seen, stack = {start}, [start]
        while stack:
            node = stack.pop()
            if node in outputs:
                continue
            if node is not start and node not in inner:
                layer_name, pname = held[0][0], held[0][1]
                raise RuntimeError(
                    f"{layer_name}.{pname} is used outside its measured layer {layer_name} in the forward "
                    f"(by {_user(node, parents).name()}): its per-example norm would miss that use's part of the gradient. "
                    f"Use it only through {layer_name}, or leave its kind unmeasured (measure(model, ...=None))")
            for parent in parents.get(node, ()):
                if parent not in seen:
                    seen.add(parent)
                    stack.append(parent)
