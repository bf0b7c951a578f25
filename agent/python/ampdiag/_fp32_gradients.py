"""The Python agent's walk for the fp32-gradients decision (agent/core/fp32_gradients.h, where
it is explained; the C++ agent's is agent/src/gradient_graph.cpp): the parameters whose
gradient autocast computes in FP32 (a Mamba mixer's A_log, an RMSNorm weight multiplying
float32 values, a float32 embedding table), which fp16 neither bounds nor flushes. Read once
a run, from the graph under the first scaled loss, where it has at most FP32_WALK_NODES nodes;
event "fp32-gradients", the names, which the analyzer's underflow, headroom and
overflow-origin rules read."""
from torch.autograd.function import BackwardCFunction

from . import _ampdiag
from ._loss_code import made_dtype, op_name
from ._names import named_parameters


def gradient_graph(loss_nodes, names):
    """(ops, received, edges, parts) of the graph under `loss_nodes` (grad_fn nodes), its parts
    handed to the parameters in `names` ({id(param): name}), as the core takes them; None where
    it has more than FP32_WALK_NODES nodes."""
    index, held = {}, []  # id(node) -> its index; the nodes, held (a freed node's id() could be reused)
    ops, received, edges, parts = [], [], [], []

    def index_of(node):
        at = index.get(id(node))
        if at is None:
            at = index[id(node)] = len(held)
            held.append(node)
            # A custom autograd.Function's backward (torch.compile's whole graph is one)
            # computes in whatever precision its code chooses: no operation of torch's.
            ops.append("" if isinstance(node, BackwardCFunction) else op_name(node))
            received.append(made_dtype(node))
        return at

    walked = set()
    stack = [n for n in loss_nodes if n is not None]
    while stack:
        node = stack.pop()
        at = index_of(node)
        if at in walked:
            continue
        walked.add(at)
        if len(held) > _ampdiag.FP32_WALK_NODES:
            return None
        for child, _ in node.next_functions:
            if child is None:
                continue
            param = getattr(child, "variable", None)  # an accumulator's
            if param is None:
                edges.append((at, index_of(child)))
                stack.append(child)
            elif id(param) in names:
                parts.append((at, names[id(param)]))
    return ops, received, edges, parts


def record(handle, roots, model):
    """Writes the event for the graph under `roots` (the scaled losses), once a run: returns
    whether the graph was read (False: no loss with a graph yet)."""
    nodes = [t.grad_fn for t in roots if t.grad_fn is not None]
    if not nodes or model is None:
        return False
    graph = gradient_graph(nodes, {id(p): name for name, p in named_parameters(model) if p.requires_grad})
    detail = _ampdiag.fp32_gradients(*graph) if graph is not None else ""
    if detail:
        handle._event(_ampdiag.FP32_GRADIENTS, detail)
    return True
