"""The loss code: the operations between the model's outputs and the loss, as autograd's
graph recorded them. Read only in a step whose loss, or the gradient reaching the model's
output, went NaN/Inf while every module's output was finite: the NaN/Inf was made there,
where no module hook looks, and the analyzer names the operation that can make it (the
gradient of sqrt at 0, CTCLoss on a target that cannot be aligned, log of 0).

Each node is written with the dtype of the tensor it made in forward (autograd keeps it as
the node's input metadata): a loss code that ran in float32 throughout is not fp16's
overflow, and "compute the loss in FP32" would not help it."""
import re

# A graph reaching far from the outputs (a regulariser over every parameter, a loss on an
# inner activation) is cut off here: only nodes on a path to an output are named.
_MAX_NODES = 4096
_MAX_NAMED = 32

_SUFFIX = re.compile(r"Backward\d*$")


def _name(node) -> str:
    full = node.name()
    name = _SUFFIX.sub("", full.rsplit("::", 1)[-1]) or full
    if full == "PowBackward0":
        # x ** p: finite gradients at 0 for p = 2, infinite for p = 0.5; the analyzer needs p.
        try:
            return f"{name}({float(node._saved_exponent):g})"
        except (AttributeError, RuntimeError, TypeError, ValueError):
            pass
    return name


def _dtype(node) -> str:
    try:
        return str(node._input_metadata[0].dtype).replace("torch.", "")
    except (AttributeError, IndexError, RuntimeError):  # a torch without the metadata, or a node with no output
        return "?"


def loss_code(loss_nodes, output_nodes) -> "str | None":
    """'Name:dtype, ...' ('Pow(0.5):float32' for a power with a scalar exponent) for the graph nodes on a path from one of `output_nodes` (the
    grad_fn of the model's outputs) to one of `loss_nodes` (the loss's), in forward order
    (nearest the output first); None where no path joins them."""
    outputs = {id(n) for n in output_nodes if n is not None}
    if not outputs:
        return None
    on_path = {}  # id(node) -> whether an output is reached through it
    order = []
    stack = [(n, False) for n in loss_nodes if n is not None]
    visited = 0
    while stack:
        node, expanded = stack.pop()
        key = id(node)
        if expanded:
            reached = any(on_path.get(id(child), False) or id(child) in outputs
                          for child, _ in node.next_functions if child is not None)
            on_path[key] = reached
            if reached:
                order.append(node)  # children first: forward order
            continue
        if key in on_path or key in outputs:
            continue
        visited += 1
        if visited > _MAX_NODES:
            break
        on_path[key] = False  # in progress: a graph has no cycle, this only stops a revisit
        stack.append((node, True))
        stack.extend((child, False) for child, _ in node.next_functions
                     if child is not None and id(child) not in on_path and id(child) not in outputs)
    if not order:
        return None
    return ", ".join(f"{_name(n)}:{_dtype(n)}" for n in order[:_MAX_NAMED])
