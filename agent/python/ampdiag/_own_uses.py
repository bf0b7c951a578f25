"""A submodule's parameter that the model's own forward() uses as well: an LM whose logits are
F.linear(h, self.emb.weight), the embedding's weight, without a head module. The parameter's
gradient hook fires when every use has added its part, after the embedding's backward, the
last; so where the logits' backward overflows fp16 the first non-finite gradient in
backward order is a layer below them, which the report named. As for a weight tied between
two modules (_tied.py), that use is watched on its own: in a training forward whose output
the model computed after its last module, the graph under the output is searched, not past
any module's output, for the nodes handing a part of such a parameter's gradient to it; a
NaN/Inf part there moves the parameter's arrival to that moment and is event
"tied-gradient-nonfinite", "emb.weight through the model". Host parameters only.

The same search names the model's own parameters (held by no submodule) that its code after
the modules reads, where that code made the output NaN/Inf (event "model-parameters").
"""
import collections

import torch

from ._loss_code import op_name
from ._tied import TiedUse

_SEARCH_NODES = 64  # graph nodes looked at a step: the model's own code between its modules is short


class OwnUses:
    """The uses, by the model's own code, of the trainable parameters its submodules hold."""

    def __init__(self, handle, candidates):
        # id(param) -> TiedUse; `candidates` is [(layer, name, param)]
        self._uses = {id(p): TiedUse(handle, layer, name, "", p) for layer, name, p in candidates if p.is_cpu}

    def watch(self, output_node, module_nodes):
        """Hooks each use found under `output_node` (the model's output's grad_fn) that is not
        under a module's output (`module_nodes`, those of this forward)."""
        if not self._uses or output_node is None:
            return
        for node, k, param in after_modules(output_node, module_nodes)[1]:
            if id(param) in self._uses:
                self._uses[id(param)].watch_part(node, k)


def after_modules(output_node, module_nodes):
    """The graph under `output_node` that is not under a module's output (`module_nodes`: the
    list keeps them alive, so their ids stay theirs), breadth first, at most _SEARCH_NODES
    nodes: (those nodes, [(node, k, parameter)] for each parameter's accumulator that is
    the node's k-th next function)."""
    stop = {id(n) for n in module_nodes}
    queue, seen, nodes, reads = collections.deque([output_node]), set(), [], []
    while queue and len(seen) < _SEARCH_NODES:
        node = queue.popleft()
        if node is None or id(node) in seen or id(node) in stop:
            continue
        seen.add(id(node))
        nodes.append(node)  # held: a freed node's id could be handed to another (see _loss_code.py)
        for k, (child, _) in enumerate(node.next_functions):
            param = getattr(child, "variable", None)  # an accumulator's (under autocast, below its weight cast)
            if param is None:
                queue.append(child)
            else:
                reads.append((node, k, param))
    return nodes, reads


def own_parameters(output_node, module_nodes, params) -> "str | None":
    """'logit_scale: 14.29 (float32, 1 value), read by Exp' for each of `params` ({id: name}:
    the model's own, held by no submodule) that the model's code after its modules reads:
    CLIP's temperature, whose exp() scales the logits, is where their overflow comes from,
    not the operations the model-code event lists. None for none."""
    nodes, reads = after_modules(output_node, module_nodes)
    found = {}  # name -> (parameter, the operation reading it that is nearest the output)
    for reader, _, param in reads:
        if id(param) not in params:
            continue
        if op_name(reader) == "ToCopy":  # autocast's cast of it: the operation reading the cast says more
            reader = next((n for n in nodes if any(c is reader for c, _ in n.next_functions)), reader)
        found.setdefault(params[id(param)], (param, reader))
    return describe_parameters(found)


def describe_parameters(found) -> "str | None":
    """'logit_scale: 14.29 (float32, 1 value), read by Exp; ...' for {name: (parameter, the
    operation reading it)}, by name; None for none."""
    described = []
    for name, (p, reader) in sorted(found.items(), key=lambda item: item[0]):
        if p.numel() == 0:
            continue  # an empty placeholder (a parameters buffer kept for a state dict) enlarges nothing
        with torch.no_grad():
            value = f"{p.item():.4g}" if p.numel() == 1 else f"|x| up to {p.abs().max().item():.4g}"
        count = "1 value" if p.numel() == 1 else f"{p.numel()} values"
        described.append(f"{name}: {value} ({str(p.dtype).replace('torch.', '')}, {count}), read by {op_name(reader)}")
    return "; ".join(described) or None
