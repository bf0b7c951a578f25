"""The parameters whose gradient autocast computes in FP32: every operation in the graph that
hands a part of it to the parameter computes that part from a float32 (or float64) gradient. A
Mamba mixer's A_log (the exp of its float32 value), an RMSNorm weight that multiplies float32
values, a float32 embedding table: their gradients are float32 results that fp16 neither
bounds at 65504 nor flushes below its normal range, however small the scale leaves them. A
Linear's weight is cast to fp16 first (its part arrives through that cast, in fp16), and so
is a weight transposed before a matmul casts it (a view hands on the fp16 values it gets).

Read once, from the graph under the first scaled loss, and only where the walk covers that
graph whole: a parameter with a part outside the walk could have an fp16 one. A part handed
on by a custom autograd.Function's backward (a compiled model's) counts as fp16: its code
may compute in fp16 whatever it receives. Event
"fp32-gradients", the parameters' names (up to _NAMED), which the analyzer's underflow,
headroom and overflow-origin rules read."""
from torch.autograd.function import BackwardCFunction

from ._loss_code import made_dtype, op_name

EVENT = "fp32-gradients"
_WALK_NODES = 20000  # a large LM's graph is a few thousand nodes
_NAMED = 256
_FP32 = ("float32", "float64")
_HALF = ("float16", "bfloat16")
# Backward nodes that hand on the values they receive, reshaped or cast, computing none: the
# part a weight gets through its transpose, after autocast's cast of it (w.t() under a
# matmul: TBackward0 under ToCopyBackward0), holds the fp16 values that cast received.
_PASSES_ON = frozenset({"ToCopy", "T", "Transpose", "Permute", "View", "ReshapeAlias", "UnsafeView", "Expand",
                        "Clone", "Squeeze", "Unsqueeze", "Alias", "Slice", "Select", "AsStrided", "Split",
                        "SplitWithSizes", "Unbind", "Narrow"})


def fp32_gradient_names(loss_nodes, names):
    """The names ({id(param): name}) of the parameters under `loss_nodes` (grad_fn nodes)
    whose every part is computed from a float32 or float64 gradient, sorted; None where the
    graph has more than _WALK_NODES nodes. A part handed on unchanged (a view, a cast) holds
    what the node before it received: fp16 values where that was fp16."""
    nodes, children, parts = {}, {}, {}  # id(node) -> node; its non-accumulator children; id(param) -> nodes
    stack = list(loss_nodes)
    while stack:
        node = stack.pop()
        if node is None or id(node) in nodes:
            continue
        if len(nodes) >= _WALK_NODES:
            return None
        nodes[id(node)] = node  # held: a freed node's id() could be handed to another (see _loss_code.py)
        kids = []
        for child, _ in node.next_functions:
            if child is None:
                continue
            param = getattr(child, "variable", None)  # an accumulator's
            if param is None:
                kids.append(child)
                stack.append(child)
            elif id(param) in names:
                parts.setdefault(id(param), []).append(node)
        children[id(node)] = kids
    # Whether the gradient each node receives holds fp16 values: its dtype, or handed on from
    # one that did. Read from the loss down, every node after all that hand it a gradient.
    half = {key: made_dtype(node) in _HALF for key, node in nodes.items()}
    waiting = dict.fromkeys(nodes, 0)
    for kids in children.values():
        for kid in kids:
            waiting[id(kid)] += 1
    ready = [node for key, node in nodes.items() if waiting[key] == 0]
    while ready:
        node = ready.pop()
        passes = half[id(node)] and op_name(node) in _PASSES_ON
        for kid in children[id(node)]:
            half[id(kid)] = half[id(kid)] or passes
            waiting[id(kid)] -= 1
            if waiting[id(kid)] == 0:
                ready.append(kid)

    def computed_in_fp32(node):
        # A custom autograd.Function's backward (torch.compile's whole graph is one) computes
        # in whatever precision its code chooses, whatever it receives.
        if isinstance(node, BackwardCFunction) or made_dtype(node) not in _FP32:
            return False
        return not (half[id(node)] and op_name(node) in _PASSES_ON)

    return sorted(names[key] for key, nodes_of in parts.items() if all(computed_in_fp32(n) for n in nodes_of))


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
