"""Gradients left from the step before: optimizer.zero_grad() (or model.zero_grad())
forgotten between optimizer steps, so every step adds its gradients to all the earlier
ones until they overflow fp16, and the report would blame the layer that overflows first.

One parameter is the probe: the smallest trainable one, whose .grad is cheap to read. Its
gradient hook runs before autograd accumulates into .grad, so at its first gradient of an
optimizer cycle .grad holds what the cycle before left: None or zeros after a zero_grad(),
else that cycle's gradient (event "gradients-not-zeroed", once). A parameter that no
optimizer the agent saw holds keeps its gradient by design (nothing zeroes or applies it)
and is not judged.
"""
import weakref

import torch

EVENT = "gradients-not-zeroed"


def probe_of(params: list) -> "torch.Tensor | None":
    """The smallest dense trainable parameter, or None."""
    candidates = [p for p in params if p.requires_grad and p.layout is torch.strided]
    return min(candidates, key=lambda p: p.numel(), default=None)


def probe_hook(handle, param: torch.Tensor, name: str, arrival):
    """`arrival`, the parameter's gradient hook, followed by the look at its .grad on its
    first gradient of a cycle."""
    ref = weakref.ref(param)

    def hook(grad):
        arrival(grad)
        if handle._live and not handle._gradients_probed:
            handle._gradients_probed = True
            p = ref()
            if p is not None and p.grad is not None:
                _look(handle, p, name)

    return hook


def _look(handle, param, name):
    grad = param.grad
    if grad.is_sparse or not bool(grad.any()):
        return
    optimizers = list(handle._optimizers)
    if not any(q is param for opt in optimizers for group in opt.param_groups for q in group["params"]):
        return
    handle._event(EVENT, f"{name}'s gradient still held the previous optimizer step's values when this step's first "
                         "gradient arrived: the gradients were not zeroed between steps", key=(EVENT,))
    return True
