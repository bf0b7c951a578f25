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
"""
import collections

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
        stop = {id(n) for n in module_nodes}  # the list keeps them alive: their ids stay theirs
        queue, seen, held = collections.deque([output_node]), set(), []
        while queue and len(seen) < _SEARCH_NODES:
            node = queue.popleft()
            if node is None or id(node) in seen or id(node) in stop:
                continue
            seen.add(id(node))
            held.append(node)  # a freed node's id could be handed to another (see _loss_code.py)
            for k, (child, _) in enumerate(node.next_functions):
                param = getattr(child, "variable", None)  # an accumulator's (under autocast, below its weight cast)
                if param is None:
                    queue.append(child)
                elif id(param) in self._uses:
                    self._uses[id(param)].watch_part(node, k)
