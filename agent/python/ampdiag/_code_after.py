"""The code after a module: where the gradient reaching the output of the module a skip
named held NaN/Inf (_gradient_entry.py), the operations from that output to the loss made
them (a CLIP whose similarities its own forward() scales by logit_scale.exp(); a VAE's gain
on its encoder's output). Pinning the module keeps its output, and the gradient it
receives, in float32, and the operations after it follow that dtype, up to one that autocast
runs in fp16 whatever its inputs' (a matmul): a pin helps where the operation whose fp16
backward overflows comes before any such one, and not after (CLIP's Mul by the
temperature follows its similarities' Mm).

So, once the named module's output is seen receiving NaN/Inf, that code is read from
autograd's graph (in backward, where its nodes have run: names and dtypes only): event
"output-code", "X: Pow(2):float16, ..., Mm:float16, Mul:float16, ...", where it runs,
"output-code-place" ("X: model", "X: loss" or "X: model, then loss": the model's own
forward() after X, the loss after the model's output), and the model's own parameters
beside it, "output-parameters", "X: logit_scale: 11.5 (float32, 1 value), read by Exp". At
a later step (within TRACE_STEPS), before its backward, each node of that code gets a hook,
and the first whose backward sends NaN/Inf back from finite gradients is the one that made
them: event "output-code-origin", "X: the operations from X's output to it,
it last" ("..., Mm:float16, Mul:float16"). Host tensors only; once per module, CODE_LOOKS
modules a run.
The C++ agent reads the code, its parameters and its origin the same way
(agent/src/code_after.h)."""
import torch

from ._loss_code import loss_code, op_name, path_nodes
from ._own_uses import describe_parameters
from ._tensors import first_float_tensor, holds_nonfinite

CODE_LOOKS = 4      # modules whose code after them is read, a run
TRACE_NODES = 1024  # nodes of that code hooked at a later step: a longer one is not traced
TRACE_STEPS = 64    # steps a trace waits for a backward that makes NaN/Inf there
_SIDE_HOPS = 4      # operations between a parameter and the code it feeds (exp, a cast, a clamp)


class CodeAfter:
    def __init__(self, handle):
        self._handle = handle
        self._read = set()     # modules whose code was read
        self._path = None      # the module whose code's origin a later backward looks for
        self._left = 0         # steps that trace has left
        self._forward = None   # its forward hook, which keeps this step's output node
        self._node = None      # this step's output node of that module
        self._trace = _Trace(handle)

    @property
    def armed(self):
        return self._path is not None

    def read(self, path, module, node):
        """Module `path`'s output (grad_fn `node`) received NaN/Inf: events "output-code" and
        "output-parameters", and its origin traced at the next steps."""
        handle = self._handle
        if node is None or path in self._read or len(self._read) >= CODE_LOOKS or not handle._loss_nodes:
            return
        self._read.add(path)
        nodes = path_nodes(handle._loss_nodes, [node])
        code = loss_code(nodes)
        if code is None:
            return
        handle._session.event("output-code", f"{path}: {code}")
        place = _place(nodes, path_nodes(handle._output_nodes, [node]) if handle._output_nodes else None)
        if place is not None:
            handle._session.event("output-code-place", f"{path}: {place}")
        mine = {id(p): name for name, p in handle._watched_model.named_parameters(recurse=False)}
        used = describe_parameters(parameters_beside(nodes, node, mine)) if mine else None
        if used is not None:
            handle._session.event("output-parameters", f"{path}: {used}")
        if self._path is None:
            self._path, self._left = path, TRACE_STEPS
            self._forward = module.register_forward_hook(handle._forward_hook_as_run(self._output_of(module)))

    def _output_of(self, module):
        handle = self._handle

        def hook(mod, args, output):
            # (A deep copy of the model carries this hook: only the watched module's call counts.)
            if mod is module and self._node is None and handle._live and torch.is_grad_enabled():
                tensor = first_float_tensor(output)
                if tensor is not None and tensor.is_cpu and tensor.grad_fn is not None:
                    self._node = tensor.grad_fn
            return None
        return hook

    def before_backward(self):
        """As scaler.scale() hands over the loss: the code after the module hooked, where
        its origin is looked for."""
        if self._node is not None and self._handle._loss_nodes:
            self._trace.hook(path_nodes(self._handle._loss_nodes, [self._node]))

    def step_ended(self):
        """As a step ends: event "output-code-origin" where its traced backward made NaN/Inf
        (the trace then ends), the hooks removed with the step's graph either way."""
        if self._path is None:
            return
        code, self._node = self._trace.finish(), None
        self._left -= 1
        if code is not None:
            self._handle._session.event("output-code-origin", f"{self._path}: {code}")
        if code is not None or self._left <= 0:
            self.close()

    def close(self):
        self._trace.finish()
        if self._forward is not None:
            self._forward.remove()
        self._path, self._forward, self._node = None, None, None


class LossCodeOrigin:
    """The same trace for the loss code itself: where the gradient reaching the model's
    output held NaN (event "output-gradient-nonfinite"), made by the loss's backward from a
    finite loss, the first operation of that code whose backward sends NaN/Inf back from
    finite gradients is the one to fix, whatever comes before it in forward order (a
    pairwise distance's sqrt of 0 after F.normalize's division): event "loss-code-origin",
    the operations from the model's output to it, it last. Once a run, at one of the next
    TRACE_STEPS steps; host tensors only."""

    def __init__(self, handle):
        self._handle = handle
        self._left = 0         # steps the trace has left; 0: not armed
        self._done = False     # traced, or given up: once a run
        self._trace = _Trace(handle)

    @property
    def armed(self):
        return self._left > 0

    def arm(self):
        if not self._done and not self.armed:
            self._left = TRACE_STEPS

    def before_backward(self):
        handle = self._handle
        if self.armed and handle._loss_nodes and handle._loss_code_outputs:
            self._trace.hook(path_nodes(handle._loss_nodes, handle._loss_code_outputs))

    def step_ended(self):
        if not self.armed:
            return
        code = self._trace.finish()
        self._left -= 1
        if code is not None:
            self._handle._session.event("loss-code-origin", code)
        if code is not None or self._left <= 0:
            self._left, self._done = 0, True

    def close(self):
        self._trace.finish()
        self._left = 0


class _Trace:
    """One step's hooks on the nodes of a stretch of code (in forward order), and the first
    of them whose backward sent NaN/Inf back from finite gradients."""

    def __init__(self, handle):
        self._handle = handle
        self._hooks = []     # this step's node hooks
        self._nodes = []     # the traced nodes, held while hooked
        self._names = []     # their names, read before backward frees a Mul's or Div's number
        self._origin = None  # index in _nodes of the node that made them

    def hook(self, nodes):
        if self._hooks or not nodes or len(nodes) > TRACE_NODES:
            return
        self._nodes, self._names, self._origin = nodes, [op_name(n) for n in nodes], None
        self._hooks = [n.register_hook(self._check(i)) for i, n in enumerate(nodes)]

    def _check(self, index):
        session = self._handle._session

        def check(grad_inputs, grad_outputs):
            if self._origin is None and _nonfinite(session, grad_inputs) and not _nonfinite(session, grad_outputs):
                self._origin = index
        return check

    def finish(self) -> "str | None":
        """The hooks removed; the code from the stretch's start to the node that made
        NaN/Inf, that one last, where one did."""
        for hook in self._hooks:
            hook.remove()
        nodes, names, origin = self._nodes, self._names, self._origin if self._hooks else None
        self._hooks, self._nodes, self._names, self._origin = [], [], [], None
        if origin is None:
            return None
        index = {id(n): i for i, n in enumerate(nodes)}
        return loss_code(_between(nodes, nodes[origin]) + [nodes[origin]],
                         names=lambda n: names[index[id(n)]])


def _place(nodes, in_model) -> "str | None":
    """Where the code after a module runs: "model" (its every operation computes one of the
    model's outputs: a model that returns its loss, as Hugging Face's CLIPModel), "loss" (the
    module's output is the model's, and the loss code alone uses it), or "model, then loss".
    `in_model`: the nodes from the module's output to the model's outputs (path_nodes); None
    where the model's outputs are not known."""
    if in_model is None or not nodes:
        return None
    inside = {id(n) for n in in_model}
    count = sum(1 for n in nodes if id(n) in inside)
    return "loss" if count == 0 else "model" if count == len(nodes) else "model, then loss"


def _nonfinite(session, grads) -> bool:
    for g in grads:
        # (A sparse gradient, an embedding's with sparse=True, is not looked at.)
        if (g is not None and g.is_cpu and g.layout is torch.strided and g.is_floating_point()
                and holds_nonfinite(session, g)):
            return True
    return False


def _between(nodes, made) -> list:
    """The nodes of `nodes` (the code after a module, in forward order) that `made` is
    computed from: those between the module's output and it."""
    index = {id(n): i for i, n in enumerate(nodes)}
    under, todo = set(), [made]
    while todo:
        node = todo.pop()
        for child, _ in node.next_functions:
            if child is not None and id(child) in index and id(child) not in under:
                under.add(id(child))
                todo.append(child)
    return [n for n in nodes if id(n) in under]


def parameters_beside(nodes, stop, params) -> dict:
    """{name: (parameter, the operation reading it)} for each of `params` ({id: name}) that
    reaches an operation of `nodes` through at most _SIDE_HOPS operations that are not in
    `nodes` themselves (exp(logit_scale) multiplying the similarities), and not from under
    `stop` (the module's output)."""
    seen = {id(n) for n in nodes} | {id(stop)}
    held = []  # every node seen is held until the walk ends, so that no id() is handed to another (see _loss_code.py)
    found = {}
    for reader in nodes:
        todo = [(reader, 0, reader)]
        while todo:
            node, hops, by = todo.pop()
            if node is not reader:
                param = getattr(node, "variable", None)  # an accumulator's
                if param is not None:
                    if id(param) in params:
                        found.setdefault(params[id(param)], (param, by))
                    continue
                if hops > _SIDE_HOPS:
                    continue
                by = node if op_name(node) != "ToCopy" else by  # the operation reading it, past autocast's cast
            for child, _ in node.next_functions:
                if child is not None and id(child) not in seen:
                    seen.add(id(child))
                    held.append(child)
                    todo.append((child, hops + 1, by))
    return found
