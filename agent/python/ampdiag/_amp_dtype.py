"""The precision a run is judged in, where attach() could only guess it: the autocast dtype
of the first training forward. A GradScaler kept from fp16 days with bf16 autocast made the
guess float16, and the report then judged bf16 values by fp16's range (underflow warnings
that told to train in bf16, which the run already did). A run with AMP switched off
(torch's recipe: autocast(enabled=use_amp) with GradScaler(enabled=use_amp)) kept the
no-scaler guess, and its report was headed "bfloat16 on cpu" for a run that is float32
throughout. A run with a GradScaler whose first forward ran in float32 may turn autocast on
later (a float32 warm-up): it is watched until it does, and then judged in that dtype."""
import torch
from torch.nn.modules.module import register_module_forward_pre_hook

from ._forward import compiling

_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def learn_amp_dtype(handle, model, device_type, guessed, params):
    """Registers a forward pre-hook on `model` that, at its first forward with gradients on,
    reads autocast's dtype on `device_type` and, where it is not `guessed`, records it as the
    run's amp_dtype (meta) with an event "amp-dtype"; then removes itself. Where autocast is
    off as the model's forward begins, the modules that forward runs are asked instead (the
    model may enter autocast inside it): a forward that ran no module under autocast, in a
    model without bfloat16 parameters (`params`, those it trains), is a float32 run."""
    registered = []

    def remove_hooks():
        for hook in registered:
            hook.remove()
        registered.clear()

    def settle(seen):
        remove_hooks()
        if seen is not None and seen != guessed:
            handle._session.set_meta("amp_dtype", seen)
            if seen == "float32":
                text = f"the first training forward ran no module under autocast: the run is judged in float32, " \
                       f"not the {guessed} attach() assumed"
            else:
                unneeded = seen == "bfloat16" and handle.scaler is not None
                text = f"autocast ran in {seen}, not the {guessed} attach() assumed: the run is judged in {seen}" + \
                       (" (bfloat16 needs no GradScaler)" if unneeded else "")
            handle._event("amp-dtype", text)
        if seen == "float32" and handle.scaler is not None:
            registered.append(model.register_forward_pre_hook(handle._forward_hook_as_run(turned_on)))

    def turned_on(module, args):
        """After a float32 first forward under a scaler: the first training forward that
        begins under autocast (one call a forward until then)."""
        if compiling() or not torch.is_grad_enabled():
            return None
        seen = autocast_dtype()
        if seen is not None:
            remove_hooks()
            handle._session.set_meta("amp_dtype", seen)
            handle._event("amp-dtype", f"autocast turned on in {seen} at step {handle._session.step}, after a start "
                                       f"in float32: the run is judged in {seen}")
        return None

    def autocast_dtype():
        return _NAMES.get(torch.get_autocast_dtype(device_type)) if torch.is_autocast_enabled(device_type) else None

    def inside(module, args):
        seen = None if compiling() else autocast_dtype()
        if seen is not None:
            settle(seen)
        return None

    def ended(module, args, output):
        if not compiling():
            settle("bfloat16" if any(p.dtype == torch.bfloat16 for p in params) else "float32")
        return None

    def hook(module, args):  # named as the agent's other hooks, which the compile test looks for
        if compiling() or not torch.is_grad_enabled():
            return None  # traced (see _forward.py), or an evaluation: wait for a training forward
        seen = autocast_dtype()
        if seen is not None:
            settle(seen)
            return None
        registered.pop().remove()
        # Every module's pre-hook, for this one forward: removed by whichever settles first.
        registered.append(register_module_forward_pre_hook(handle._forward_hook_as_run(inside)))
        registered.append(model.register_forward_hook(handle._forward_hook_as_run(ended)))
        return None

    registered.append(model.register_forward_pre_hook(handle._forward_hook_as_run(hook)))
    return _Remover(registered)


class _Remover:
    """What attach()'s handle removes on close(): whichever of the hooks above are still there."""

    def __init__(self, registered):
        self._registered = registered

    def remove(self):
        for hook in self._registered:
            hook.remove()
        self._registered.clear()
