"""Which module's backward sends the NaN/Inf that reaches a module through its output.
Where the gradient reaching X's output already held NaN/Inf (event
`module-output-gradient`, "X: nonfinite"), the code that uses X's output made them. With
several users of that output (a classifier and a box head on one backbone), the one whose
backward ran just before X's need not be the one: autograd sums what each sends.

So, once X is judged so, its next skip looks at each module given X's output: a module
whose first floating-point argument was made from X's output by operations of one input
each (views, activations, pooling). The gradient it receives at its output and the one it
sends back to that argument are checked apart (every floating-point output's: an LSTM's state
as well as its sequence). The innermost such module that received a
finite gradient and sent NaN/Inf made them in its own backward: event
`module-gradient-sender`, "X: Y" (in backward order, "X: Y, Z" where several did). Host
tensors only: a device check would wait for the device. A watch no skip of X answers within
64 steps is dropped, a verdict on another module moves it there, and each module is
looked at once: those decisions are the session core's SenderWatch
(agent/core/sender_watch.h, shared with the C++ agent); here are the hooks."""
import torch

from . import _ampdiag
from ._names import named_modules
from ._tensors import first_float_tensor, float_tensors, holds_nonfinite

KIND = "module-gradient-sender"
TRACE_HOPS = 16      # operations of one input between X's output and a user's argument
SUBGRAPH_NODES = 512  # autograd nodes searched in a user's call for the edge back to its argument


def _made_from(node, made) -> bool:
    """Whether `node` is one of `made` or follows from one through operations whose only
    input that is not a leaf (a parameter) is the one before."""
    for _ in range(TRACE_HOPS):
        if node is None:
            return False
        if node in made:
            return True
        before = [n for n, _ in node.next_functions if n is not None and type(n).__name__ != "AccumulateGrad"]
        if len(before) != 1:
            return False
        node = before[0]
    return False


def _edges_into(top, given):
    """(node, index) pairs of the call's subgraph, from its output's node down, whose
    index-th input is `given`: where its backward sends the argument its gradient."""
    edges, seen, todo = [], {top}, [top]
    while todo and len(seen) < SUBGRAPH_NODES:
        node = todo.pop()
        for index, (n, _) in enumerate(node.next_functions):
            if n is None:
                continue
            if n is given:
                edges.append((node, index))
            elif n not in seen:
                seen.add(n)
                todo.append(n)
    return edges


class _Call:
    __slots__ = ("path", "received", "sent")

    def __init__(self, path):
        self.path = path
        self.received = -1  # the gradients at its outputs: 1 where one held NaN/Inf, 0 finite
        self.sent = -1      # the order in backward in which it sent NaN/Inf back, if it did


class GradientSenders:
    def __init__(self, handle):
        self._handle = handle
        self._core = _ampdiag.SenderWatch()
        self._hooks = []     # the watched module's output hook and its users' hooks
        self._made = set()   # this step's autograd nodes of X's outputs
        self._calls = []     # this step's calls of modules given X's output
        self._sends = 0      # NaN/Inf sends seen this step, for their order

    @property
    def armed(self):
        return self._core.armed

    def arm(self, path):
        """Looks at X = `path`'s next skip; a watch on another module moves here (the latest
        module skips name is the one the report blames)."""
        self._core.arm(path)
        if self._core.target != path:
            return  # looked at already
        self._remove_hooks()
        handle = self._handle
        model = handle._watched_model
        try:
            watched = model.get_submodule(path)
        except AttributeError:
            return
        self._hooks = [watched.register_forward_hook(handle._forward_hook_as_run(self._output_hook(watched)))]
        for name, module in named_modules(model):
            if self._core.user(name):
                self._hooks.append(module.register_forward_hook(handle._forward_hook_as_run(self._user_hook(name, module))))

    def _looking(self, mod, module):
        # (A deep copy of the model carries these hooks: only the watched model's calls count;
        # a checkpointed block's forward run again inside backward builds no graph that is used.)
        return (mod is module and self._handle._live and torch.is_grad_enabled()
                and torch._C._current_graph_task_id() == -1)

    def _output_hook(self, watched):
        def hook(mod, args, output):
            if self._looking(mod, watched):
                tensor = first_float_tensor(output)
                if tensor is not None and tensor.grad_fn is not None:
                    self._made.add(tensor.grad_fn)
            return None
        return hook

    def _user_hook(self, path, module):
        def hook(mod, args, output):
            if not self._made or not self._looking(mod, module):
                return None
            given = first_float_tensor(args)
            if given is None or not given.is_cpu or given.grad_fn is None or not _made_from(given.grad_fn, self._made):
                return None
            # Every output with a gradient to receive: an LSTM's state as well as its sequence.
            outs = [t for t in float_tensors(output) if t.grad_fn is not None and t.grad_fn is not given.grad_fn]
            edges = [edge for out in outs for edge in _edges_into(out.grad_fn, given.grad_fn)]
            if not edges:
                return None
            call = _Call(path)
            self._calls.append(call)
            session = self._handle._session

            def received(grad):
                if call.received != 1 and grad.is_cpu:
                    call.received = int(holds_nonfinite(session, grad))

            def sent(index):
                def check(grad_inputs, grad_outputs):
                    grad = grad_inputs[index] if index < len(grad_inputs) else None
                    if call.sent < 0 and grad is not None and grad.is_cpu and holds_nonfinite(session, grad):
                        call.sent = self._sends
                        self._sends += 1
                return check

            for out in outs:
                out.register_hook(received)
            for node, index in dict.fromkeys(edges):  # (outputs that share a node reach it once)
                node.register_hook(sent(index))
            return None
        return hook

    def step_ended(self, named: str):
        """As a host step ends; `named`: the module its first NaN/Inf gradient names ("" where
        it was not skipped with a finite loss)."""
        if not self._core.armed:
            return
        calls, self._calls, self._made, self._sends = self._calls, [], set(), 0
        detail = self._core.step_ended(named, [(c.path, c.received, c.sent) for c in calls])
        if detail:
            self._handle._session.event(KIND, detail)
        if not self._core.armed:
            self._remove_hooks()

    def _remove_hooks(self):
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def close(self):
        self._remove_hooks()
