"""optimizer.step() called directly in a loop that scales its loss: torch lets it run,
and the run goes NaN with nothing to say why.

Two forms, told apart by the scaler's own record of the optimizer:
- never unscaled (scaler.step() forgotten): the optimizer applies gradients still
  multiplied by the loss scale, and since update() is never called the agent ends the
  step after the optimizer's, with the statistics of those scaled gradients;
- after scaler.unscale_(): the gradients are right, but a step whose gradients hold
  NaN/Inf is applied instead of skipped, so update()'s step is recorded as taken.

The loop's optimizer is not given to attach() with a scaler, so the hooks are torch's
global optimizer step hooks, which see every optimizer of the process; a step inside
scaler.step() (the agent wraps it) is the normal path and costs one flag test.
"""
import weakref

import torch
from torch.amp.grad_scaler import OptState
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ._grad_reads import optimizer_gradients, post_stats
from ._step_end import end_step, end_step_on_device
from ._tensors import scale_on_device, scale_text

EVENT = "optimizer-outside-scaler"


def watch(handle, scaler) -> list:
    """Registers the global hooks for this handle; returns their removable handles."""
    ref = weakref.ref(handle)  # a handle never closed must not be kept alive by torch's globals

    def before(optimizer, args, kwargs):
        h = ref()
        if h is not None and not h._in_scaler_step and h._in_cycle and not h._inert:
            _before(h, scaler, optimizer)

    def after(optimizer, args, kwargs):
        h = ref()
        if h is not None and h._bypass is not None and h._bypass[0] == "scaled" and h._in_cycle:
            _, found, scale = h._bypass
            if isinstance(scale, float):
                end_step(h, scale, scale, found, skipped=False)
            else:
                # found_inf 0, so not skipped: the optimizer applied the step whatever it held.
                end_step_on_device(h, scale, True, scale, torch.zeros((), dtype=torch.float64, device=scale.device))

    return [register_optimizer_step_pre_hook(before), register_optimizer_step_post_hook(after)]


def _before(handle, scaler, optimizer):
    states = scaler._per_optimizer_states
    unscaled = id(optimizer) in states and states[id(optimizer)]["stage"] is OptState.UNSCALED
    name = type(optimizer).__name__
    if unscaled:
        handle._bypass = ("unscaled",)
        handle._event(EVENT, f"{name}.step() ran after scaler.unscale_(optimizer) but outside scaler.step(): a step "
                             "whose gradients hold NaN/Inf is applied instead of skipped", key=(EVENT, "unscaled"))
    elif handle._scaled and not handle._scaler_stepped:
        # A scaled loss went backward in this cycle and no scaler.step() has run: these
        # gradients are multiplied by the scale.
        layers, grads, _ = optimizer_gradients(handle, optimizer)
        found = post_stats(handle, layers, grads)  # host gradients' (device ones land later)
        # A CUDA scale stays a device tensor: reading it would make the training thread wait.
        scale = scaler._scale if scale_on_device(scaler) else float(scaler.get_scale())
        handle._bypass = ("scaled", found, scale)
        shown = f" ({scale_text(scale)})" if isinstance(scale, float) else ""
        handle._event(EVENT, f"{name}.step() ran on gradients still multiplied by the loss scale{shown}: "
                             "scaler.step(optimizer) was not called", key=(EVENT, "scaled"))
