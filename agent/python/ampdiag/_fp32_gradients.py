"""The parameters whose gradient autocast computes in FP32: every operation in the graph that
hands a part of it to the parameter received a float32 (or float64) gradient in backward. A
Mamba mixer's A_log (the exp of its float32 value), an RMSNorm weight that multiplies float32
values, a float32 embedding table: their gradients are float32 results that fp16 neither
bounds at 65504 nor flushes below its normal range, however small the scale leaves them. A
Linear's weight is cast to fp16 first (its part arrives through that cast, in fp16).

Read once, from the graph under the first scaled loss, and only where the walk covers that
graph whole: a parameter with a part outside the walk could have an fp16 one. A part handed
on by a custom autograd.Function's backward (a compiled model's) counts as fp16: its code
may compute in fp16 whatever it receives. Event
"fp32-gradients", the parameters' names (up to _NAMED), which the analyzer's underflow,
headroom and overflow-origin rules read."""
from torch.autograd.function import BackwardCFunction

from ._loss_code import made_dtype

EVENT = "fp32-gradients"
_WALK_NODES = 20000  # a large LM's graph is a few thousand nodes
_NAMED = 256
_FP32 = ("float32", "float64")


def fp32_gradient_names(loss_nodes, names):
    """The names ({id(param): name}) of the parameters under `loss_nodes` (grad_fn nodes) whose
    every part arrives through a node that received a float32 or float64 gradient, sorted;
    None where the graph has more than _WALK_NODES nodes."""
    received = {}  # id(param) -> the dtypes its parts' nodes received
    stack, seen, held = list(loss_nodes), set(), []
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        if len(seen) >= _WALK_NODES:
            return None
        seen.add(id(node))
        held.append(node)  # a freed node's id() could be handed to another (see _loss_code.py)
        dtype = None
        for child, _ in node.next_functions:
            if child is None:
                continue
            param = getattr(child, "variable", None)  # an accumulator's
            if param is None:
                stack.append(child)
            elif id(param) in names:
                # A custom autograd.Function's backward (torch.compile's whole graph is one)
                # computes in whatever precision its code chooses, whatever it receives.
                dtype = dtype or ("?" if isinstance(node, BackwardCFunction) else made_dtype(node))
                received.setdefault(id(param), []).append(dtype)
    return sorted(names[key] for key, dtypes in received.items() if all(d in _FP32 for d in dtypes))


def record(handle, roots, model):
    """Writes the event for the graph under `roots` (the scaled losses), once a run: returns
    whether the graph was read (False: no loss with a graph yet)."""
    nodes = [t.grad_fn for t in roots if t.grad_fn is not None]
    if not nodes or model is None:
        return False
    names = {id(p): name for name, p in model.named_parameters() if p.requires_grad}
    found = fp32_gradient_names(nodes, names)
    if found:
        handle._event(EVENT, ", ".join(found[:_NAMED]))
    return True
