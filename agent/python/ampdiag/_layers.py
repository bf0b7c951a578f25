"""The run's layers: every parameter of the watched model registered with the session once,
under its first name, with its gradient hook (backward arrival order), the stale-gradient
and accumulation probes on the smallest one, and a look at each use of a tied one; and the layer of any
tensor an optimizer hands over, a parameter of the model or not."""
import inspect
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from . import _stale_gradients
from ._accumulation import AccumulationProbe
from ._names import named_modules, named_parameters
from ._own_uses import OwnUses
from ._tied import TiedUse, tied_owners


def source_of(module: torch.nn.Module) -> str:
    """Where the module's forward() is written, "file:line", or empty."""
    try:
        forward = type(module).forward
        return f"{inspect.getsourcefile(forward)}:{inspect.getsourcelines(forward)[1]}"
    except (TypeError, OSError):
        return ""


class Layers:
    def __init__(self, handle, model: torch.nn.Module):
        self._handle = handle
        self._params = []      # every registered tensor, kept alive: id() is its key in the session
        self._layer_ids = {}   # id() -> layer, for tensors the optimizer has handed over
        self.known = self._layer_ids.get  # a layer_id() already answered: what layer_id() returns
        self._hookless = {}    # id() -> (layer, name): frozen at attach(), no arrival hook yet
        self.registered = []   # (layer, parameter) of the model, each tensor once
        self._model = weakref.ref(model)
        session = handle._session
        modules = dict(named_modules(model))
        probe = _stale_gradients.probe_of(list(model.parameters()))
        tied = tied_owners(model)
        held_by_submodules = []  # (layer, name, tensor): the model's own code may use them too
        for name, p in named_parameters(model, remove_duplicate=False):
            module_path = name.rpartition(".")[0]
            module = modules.get(module_path)
            layer, added, _ = session.add_layer(id(p), name, module_path, type(module).__name__ if module is not None else "",
                                             str(p.dtype).replace("torch.", ""), str(list(p.shape)), p.numel(),
                                             p.requires_grad, source_of(module) if module is not None else "")
            if not added:
                continue  # the same tensor as an earlier name (the session says so once)
            self._params.append(p)
            self.registered.append((layer, p))
            if not p.requires_grad:
                self._hookless[id(p)] = (layer, name)  # frozen now; see layer_id()
                continue
            hook = handle._arrival_hook(layer)
            if p is probe:
                handle._gradient_probe = _stale_gradients.GradientProbe(handle, p, name)
                handle._accumulation_probe = AccumulationProbe(handle, p, name, handle._gradient_probe.optimized)
                hook = handle._accumulation_probe.hook(handle._gradient_probe.hook(hook))
                handle._hooks.append(p.register_post_accumulate_grad_hook(handle._accumulation_probe.accumulated))
                handle._hooks.append(register_optimizer_step_post_hook(handle._accumulation_probe.step_hook()))
            handle._hooks.append(p.register_hook(hook))
            if module_path:
                held_by_submodules.append((layer, name, p))
            for path, owner in tied.get(id(p), ()):
                use = TiedUse(handle, layer, name, path, p)
                handle._hooks.append(owner.register_forward_hook(handle._forward_hook_as_run(use.forward_hook())))
        handle._own_uses = OwnUses(handle, held_by_submodules)
        session.layers_done()

    def model(self):
        """The attached model; None once it is gone."""
        return self._model()

    def layer_id(self, param) -> int:
        """The layer of a tensor whose gradient is read (on every step, for every one)."""
        layer = self._layer_ids.get(id(param))  # every key's tensor is kept alive in _params
        if layer is None and id(param) in self._hookless and param.requires_grad:
            # Frozen at attach() and trained since (a backbone unfrozen after a few epochs):
            # its gradients arrive in backward order from the next step on, not after all others.
            handle = self._handle
            layer, name = self._hookless.pop(id(param))
            handle._hooks.append(param.register_hook(handle._arrival_hook(layer)))
            handle._event("parameters-unfrozen", f"{name} was frozen at attach() and has a gradient from this step: "
                          "its backward order is recorded from the next step", key=("unfrozen",))
        if layer is None and self._handle._session.find_layer(id(param)) < 0:
            layer = self._added_to_model(param)
        if layer is None:
            layer, added = self._handle._session.layer_of(id(param), str(param.dtype).replace("torch.", ""),
                                                          str(list(param.shape)), param.numel())
            if added:  # optimized, but not a parameter of the model
                self._params.append(param)
            self._layer_ids[id(param)] = layer
        return layer

    def _added_to_model(self, param):
        """The layer of a parameter the model holds now but did not at attach() (a block grown
        or a head swapped in, then given to the optimizer), registered under its name, its
        gradients in backward order from the next step, its modules' outputs watched from
        their next call; None where the model does not hold it."""
        model = self._model()
        if model is None:
            return None
        for name, p in named_parameters(model):
            if p is not param:
                continue
            module_path = name.rpartition(".")[0]
            module = model.get_submodule(module_path) if module_path else model
            handle = self._handle
            layer, added, recorded = handle._session.add_layer(
                id(p), name, module_path, type(module).__name__, str(p.dtype).replace("torch.", ""),
                str(list(p.shape)), p.numel(), p.requires_grad, source_of(module))
            self._layer_ids[id(p)] = layer
            if added:
                self._params.append(p)
                self.registered.append((layer, p))
                handle._hooks.append(p.register_hook(handle._arrival_hook(layer)))
                if handle._weights is not None:
                    handle._weights.add(layer, p)
                handle._watch_added_modules(model)
                handle._event("parameters-added", f"{recorded} was added to the model after attach(): its gradients "
                              "are recorded from this step, in backward order and with its module's outputs from the "
                              "next", key=("added", recorded))
            return layer
        return None
