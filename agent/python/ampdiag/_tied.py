"""Tied parameters: one tensor held by several modules, as a language model's embedding and
output head share their weight (GPT-2, BERT, T5). Its gradient hook fires once, when every
use has added its part, that is after the backward of its first use in forward, the
embedding, which runs last. So where the head's backward overflows fp16, the parameter's
NaN/Inf "arrives" last and the first non-finite gradient in backward order is the layer
below the head: the report blamed a LayerNorm for the head's overflow.

Each use is watched on its own: a forward hook on every module holding the tensor finds,
in autograd's graph just under the module's output, the node that hands that use's
gradient to the parameter, and a post-hook there looks at that part. A NaN/Inf part moves
the parameter's arrival to that moment (the session keeps a layer's first arrival) and is
event "tied-gradient-nonfinite", "emb.weight through head", which the analyzer reads to
name the module whose use went NaN/Inf. Host parameters only: a look at a device part would
wait for the device.
"""
import collections

import torch

from ._forward import compiling
from ._names import named_modules
from ._tensors import first_float_tensor, holds_nonfinite

EVENT = "tied-gradient-nonfinite"
_SEARCH_NODES = 64  # graph nodes looked at per use: the part is a few nodes under the output


def tied_owners(model: torch.nn.Module) -> dict:
    """id(tensor) -> [(module path, module)] for each trainable tensor more than one module
    holds directly."""
    owners = collections.defaultdict(list)
    for path, module in named_modules(model):
        for p in module._parameters.values():
            if p is not None and p.requires_grad:
                owners[id(p)].append((path, module))
    return {key: held for key, held in owners.items() if len(held) > 1}


def _node_handing_to(output_node, param):
    """(node, index) whose index-th input gradient goes to `param`'s accumulator, found
    breadth first from the module output's node; None if not within reach."""
    queue, seen = collections.deque([output_node]), set()
    while queue and len(seen) < _SEARCH_NODES:
        node = queue.popleft()
        if node is None or node in seen:
            continue
        seen.add(node)
        for k, (child, _) in enumerate(node.next_functions):
            if child is not None and getattr(child, "variable", None) is param:
                return node, k
            queue.append(child)
    return None


class TiedUse:
    """One module's use of a tied parameter (layer `layer`, named `name`)."""

    def __init__(self, handle, layer: int, name: str, path: str, param: torch.Tensor):
        self._handle, self._layer, self._name, self._path, self._param = handle, layer, name, path, param

    def forward_hook(self):
        """The holder module's forward hook. A plain function, not a bound method: a model
        deep-copied after attach() (an EMA teacher) copies its hooks, and copying a bound
        method would copy this object and the handle with it."""
        use, handle, param = self, self._handle, self._param

        def hook(module, args, output):
            if compiling() or not torch.is_grad_enabled() or not param.is_cpu:
                return None
            # Without activation hooks no cycle is open yet in forward: this one opens it.
            if not handle._live and (handle._standing_aside or not handle._begin_forward_cycle()):
                return None
            tensor = first_float_tensor(output)
            if tensor is None or tensor.grad_fn is None:
                return None
            found = _node_handing_to(tensor.grad_fn, param)  # none in a deep copy's graph: its own tensors
            if found is not None:
                use.watch_part(*found)
            return None

        return hook

    def watch_part(self, node, k):
        """Looks at the part of the gradient that `node` hands to the parameter (its k-th input)."""
        node.register_hook(lambda grad_inputs, grad_outputs: self._look(grad_inputs[k]))

    def _look(self, part):
        handle = self._handle
        if part is None or handle._standing_aside:
            return None
        if holds_nonfinite(handle._session, part):
            handle._session.arrived(self._layer)
            handle._event(EVENT, f"{self._name} through {self._path or 'the model'}",
                          key=(EVENT, self._name, handle._session.step))
        return None
