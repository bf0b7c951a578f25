"""The precision a run is judged in, where attach() could only guess it: the autocast dtype
of the first training forward. A GradScaler kept from fp16 days with bf16 autocast made the
guess float16, and the report then judged bf16 values by fp16's range (underflow warnings
that told to train in bf16, which the run already did)."""
import torch

from ._forward import compiling

_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def learn_amp_dtype(handle, model, device_type, guessed):
    """Registers a forward pre-hook on `model` that, at its first forward with gradients on,
    reads autocast's dtype on `device_type` and, where it is not `guessed`, records it as the
    run's amp_dtype (meta) with an event "amp-dtype"; then removes itself."""
    registered = None

    def hook(module, args):
        if compiling() or not torch.is_grad_enabled():
            return None  # traced (see _forward.py), or an evaluation: wait for a training forward
        registered.remove()
        if not torch.is_autocast_enabled(device_type):
            return None  # autocast starts inside the model, or none: keep the guess
        seen = _NAMES.get(torch.get_autocast_dtype(device_type))
        if seen is not None and seen != guessed:
            handle._session.set_meta("amp_dtype", seen)
            unneeded = seen == "bfloat16" and handle.scaler is not None
            handle._event("amp-dtype", f"autocast ran in {seen}, not the {guessed} attach() assumed: the run is "
                          f"judged in {seen}" + (" (bfloat16 needs no GradScaler)" if unneeded else ""))
        return None

    registered = model.register_forward_pre_hook(handle._forward_hook_as_run(hook))
    return registered
