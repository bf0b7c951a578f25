"""The loss code: the operations between the model's outputs and the loss, as autograd's
graph recorded them. Read only in a step whose loss, or the gradient reaching the model's
output, went NaN/Inf while every module's output was finite: the NaN/Inf was made there,
where no module hook looks, and the analyzer names the operation that can make it (the
gradient of sqrt at 0, CTCLoss on a target that cannot be aligned, log of 0).

Each node is written with the dtype of the tensor it made in forward (autograd keeps it as
the node's input metadata): a loss code that ran in float32 throughout is not fp16's
overflow, and "compute the loss in FP32" would not help it. Read before backward, the
tensors the operations saved are looked at too: a target holding NaN (a missing value in
the data) makes a NaN loss whatever the code does."""
import re

import torch

# A graph reaching far from the outputs (a regulariser over every parameter, a loss on an
# inner activation) is cut off here: only nodes on a path to an output are named.
_MAX_NODES = 4096
_MAX_NAMED = 32
_MAX_CHECKED = 1 << 24  # elements of a saved tensor looked at for NaN/Inf

_SUFFIX = re.compile(r"Backward\d*$")


_REDUCTIONS = ("none", "mean", "sum")  # at::Reduction's values, in order


def op_name(node) -> str:
    full = node.name()
    name = _SUFFIX.sub("", full.rsplit("::", 1)[-1]) or full
    if full == "PowBackward0":
        # x ** p: finite gradients at 0 for p = 2, infinite for p = 0.5; the analyzer needs p.
        try:
            return f"{name}({float(node._saved_exponent):g})"
        except (AttributeError, RuntimeError, TypeError, ValueError):
            pass
    if name in ("NllLoss", "NllLoss2D"):
        return _nll_name(node, name)
    if full in ("DivBackward0", "MulBackward0"):
        # x / tau, x * 1e4: a constant other than 0 makes no NaN from finite values, yet in
        # float16 it passes the range above 65504 * tau; the analyzer needs it to tell which.
        constant = _scalar(node, "_saved_other")
        if constant is not None:
            return f"{name}({constant:g})"
    return name


def _scalar(node, attr):
    """The value of a one-element host tensor `node` saved as `attr` (a Python number becomes
    one); None for a tensor of more values, a device tensor (its read would wait for the
    device), one backward freed, or none saved."""
    try:
        value = getattr(node, attr)
    except (AttributeError, RuntimeError):
        return None
    if isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_cpu and not value.is_complex():
        return float(value.detach())
    return None


def _nll_name(node, name) -> str:
    """'NllLoss(none)', 'NllLoss(mean of 0)': nll_loss makes NaN from finite values only
    as a mean over a total target weight of 0 (every target ignore_index), so the analyzer
    needs the reduction and, while backward has not freed it, that weight."""
    try:
        reduction = _REDUCTIONS[int(node._saved_reduction)]
    except (AttributeError, RuntimeError, TypeError, ValueError, IndexError):
        return name
    if reduction != "mean":
        return f"{name}({reduction})"
    try:
        total = node._saved_total_weight
        if isinstance(total, torch.Tensor) and total.is_cpu and total.numel() == 1:  # a device read would wait
            return f"{name}(mean of {float(total):g})"
    except (AttributeError, RuntimeError, TypeError, ValueError):  # freed by a backward
        pass
    return f"{name}(mean)"


def made_dtype(node) -> str:
    """The dtype of the tensor `node` made in forward ("float32"); "?" where torch does not say."""
    try:
        return str(node._input_metadata[0].dtype).replace("torch.", "")
    except (AttributeError, IndexError, RuntimeError):  # a torch without the metadata, or a node with no output
        return "?"


def path_nodes(loss_nodes, output_nodes) -> list:
    """The graph nodes on a path from one of `output_nodes` (the grad_fn of the model's
    outputs) to one of `loss_nodes` (the loss's), in forward order (nearest the output
    first); empty where no path joins them."""
    # A model that returns its loss with its logits (as Hugging Face models do): the loss
    # code is inside its forward, between the other outputs and that one.
    outputs = {id(n) for n in output_nodes if n is not None} - {id(n) for n in loss_nodes}
    if not outputs:
        return []
    on_path = {}  # id(node) -> whether an output is reached through it
    # Every node seen is held until the walk ends: next_functions hands out a new Python
    # object for a node whose last one was freed, and a freed object's id() can be given
    # to another node's (seen on Python 3.12: the path was cut there and came out empty).
    seen = []
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
        seen.append(node)
        stack.append((node, True))
        stack.extend((child, False) for child, _ in node.next_functions
                     if child is not None and id(child) not in on_path and id(child) not in outputs)
    return order


def loss_code(nodes, names=op_name) -> "str | None":
    """'Name:dtype, ...' ('Pow(0.5):float32' for a power with a scalar exponent,
    'Div(0.07):float16' for a division or a product by one number, 'NllLoss(mean of
    0):float32' for nll_loss) for path_nodes()'s nodes; None for none. `names`: each node's
    name, where it was read before a backward freed the numbers."""
    if not nodes:
        return None
    return ", ".join(f"{names(n)}:{made_dtype(n)}" for n in nodes[:_MAX_NAMED])


def read_first_loss_code(handle):
    """The loss code as the run's first backward is about to start, its saved values alive,
    kept as handle._first_loss_code: a look during a backward finds a Mul's or Div's number
    freed (with_numbers). Written once as event "loss-code-first": a run whose gradients are
    too large for the scale without a NaN/Inf loss has no other reading of its loss code,
    which says whether the loss is over class indices or holds a factor."""
    if handle._first_loss_code is None and handle._loss_code_outputs and handle._loss_nodes:
        handle._first_loss_code = loss_code(path_nodes(handle._loss_nodes, handle._loss_code_outputs)) or ""
        if handle._first_loss_code:
            handle._event("loss-code-first", handle._first_loss_code)


def with_numbers(code, read_before) -> "str | None":
    """`code` with the numbers of its divisions and products by one number taken from
    `read_before`, the loss code read while its saved values were alive (as the first
    backward was about to start), where both are the same operations: a look during a
    backward (the gradient reaching the model's output overflowed) finds those values freed,
    'Mul:float32' where the code says 'Mul(1e+06)'. A divisor the batch makes (a token count)
    is then the first batch's. Other details stay this step's ('NllLoss(mean)', its count of
    targets freed too, is no other batch's count)."""
    if not code or not read_before:
        return code
    now, before = code.split(", "), read_before.split(", ")
    if len(now) != len(before):
        return code
    merged = []
    for op, known in zip(now, before):
        name, _, dtype = op.rpartition(":")
        known_name, _, known_dtype = known.rpartition(":")
        base, _, detail = name.partition("(")
        known_base, _, known_detail = known_name.partition("(")
        if dtype != known_dtype or base != known_base or not known_detail.startswith(detail.rstrip(")")):
            return code
        merged.append(known if base in ("Div", "Mul") and not detail else op)
    return ", ".join(merged)


def nonfinite_constants(nodes) -> "str | None":
    """'MseLoss target: 1 NaN, 0 Inf of 32 values, float32' for the first tensor an operation of the
    loss code saved that holds NaN/Inf and that nothing differentiable made (a target, a
    mask, another model's output under no_grad): a NaN/Inf loss then comes from what the
    loss was given, not from its code. Only before backward, which frees saved tensors."""
    for node in nodes:
        for attr in dir(node):
            if not attr.startswith("_saved_") or attr.startswith("_saved_result"):
                continue  # an operation's own results (CTC's log-alphas) are what it made, not what it was given
            try:
                value = getattr(node, attr)
            except RuntimeError:  # freed by a backward, or not readable
                continue
            if (isinstance(value, torch.Tensor) and value.is_floating_point() and not value.requires_grad
                    and value.numel() <= _MAX_CHECKED):
                nan, inf = int(torch.isnan(value).sum()), int(torch.isinf(value).sum())
                if nan or inf:
                    # Its dtype: a float16 one may have been made so under autocast (an epsilon fp16 cannot hold).
                    dtype = str(value.dtype).replace("torch.", "")
                    made = made_in_half(value) if value.dtype == torch.float32 else None
                    if made is not None:
                        dtype += f" ({made} values)"
                    return f"{op_name(node)} {attr[len('_saved_'):]}: {nan} NaN, {inf} Inf of {value.numel()} values, {dtype}"
    return None


_CAST_UP_EVIDENCE = 16  # finite non-integer values that all fit a half type exactly


def made_in_half(value) -> "str | None":
    """'float16' or 'bfloat16' where every finite value of a float32 tensor is exactly one of
    that type's and enough of them are not whole numbers to tell: it was made in half
    precision and cast up (autocast casts a loss's float16 inputs to float32, so a Gram
    matrix or a teacher's logits that overflowed in float16 arrive as float32 with Inf)."""
    finite = value[torch.isfinite(value)]
    if int((finite != finite.round()).sum()) < _CAST_UP_EVIDENCE:
        return None
    for half in (torch.bfloat16, torch.float16):  # bfloat16's values fit float16's mantissa, not the reverse
        if torch.equal(finite.to(half).float(), finite):
            return str(half).replace("torch.", "")
    return None


_OWN_NODES = 64  # operations of a module's own code listed at most


def nodes_under(node, stops) -> list:
    """The graph nodes `node` (a module's output's grad_fn) is computed from, down to `stops`
    (other modules' outputs, its inputs' grad_fns) and the parameters' accumulators, in
    forward order: the code the module itself ran. At most _OWN_NODES (the nearest to the
    output kept)."""
    ends = {id(n) for n in stops if n is not None and n is not node}
    done, order, held = set(), [], []
    stack = [(node, False)]
    while stack and len(held) < 4 * _OWN_NODES:
        current, expanded = stack.pop()
        if expanded:
            order.append(current)  # children first: forward order
            continue
        if id(current) in done:
            continue
        done.add(id(current))
        held.append(current)  # (held while ids are compared: see path_nodes)
        stack.append((current, True))
        for child, _ in current.next_functions:
            if child is not None and id(child) not in ends and id(child) not in done \
                    and getattr(child, "variable", None) is None:
                stack.append((child, False))
    return order[-_OWN_NODES:]
