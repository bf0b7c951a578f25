"""torch's fused SGD with momentum (torch.optim.SGD(..., momentum=m, fused=True)) makes its
momentum buffers with torch.empty_like in the first step() that finds none, and fills them
in that step's kernel. Under a GradScaler the kernel returns at once where found_inf is
set: a first step the scaler skips (its calibration at init_scale=65536 often is) leaves the
buffers holding whatever memory they were given, and every later step starts its momentum
from it. The weights jump by orders of magnitude at the first applied step, and the
overflows that follow look like a learning rate far too high. A later skipped step does no
harm (the buffers exist; the kernel leaves them alone), nor does a buffer that happens to
be all zeros (the next step makes it the gradient, as a new one would be).

So, once per such optimizer, at the scaler.step() that creates its buffers, the probe looks
after the step at whether the scaler found NaN/Inf and a buffer holds anything but zeros:
event "fused-momentum-uninitialised" at that step. A device answer is reduced on the device,
copied to pinned memory and read when it has landed (a later step's end, or close()): the
training thread never waits.
"""
import weakref

import torch

from ._device_reads import DeviceReads

EVENT = "fused-momentum-uninitialised"


def _fused_momentum_groups(optimizer):
    return [group for group in optimizer.param_groups if group.get("fused") and group.get("momentum", 0)]


def _new_momentum_params(optimizer):
    """The parameters with gradients of an SGD's fused momentum groups, where none has a
    momentum buffer yet (this step() creates them all); else None."""
    params = [p for group in _fused_momentum_groups(optimizer) for p in group["params"] if p.grad is not None]
    if not params or any(optimizer.state.get(p, {}).get("momentum_buffer") is not None for p in params):
        return None
    return params


def _settings(optimizer):
    group = _fused_momentum_groups(optimizer)[0]
    return f"{type(optimizer).__name__}(fused=True, momentum={group['momentum']:g})"


class FusedMomentumProbe:
    def __init__(self, handle):
        self._handle = handle
        self._looked = weakref.WeakSet()  # optimizers whose buffers were created while watched
        self._reads = DeviceReads(self._landed)  # damaged?: (step, detail, optimizer id)

    def before_step(self, optimizer):
        """What to look at after this scaler.step(optimizer): its fused-momentum parameters
        when this step creates their buffers, else None. Cheap: a type check for most."""
        if not isinstance(optimizer, torch.optim.SGD) or optimizer in self._looked:
            return None
        params = _new_momentum_params(optimizer)
        if params is not None:
            self._looked.add(optimizer)
        return params

    def after_step(self, scaler, optimizer, params):
        try:
            self._look(scaler, optimizer, params)
        except Exception as error:  # a look must never break the training
            self._handle._event("warning", f"fused SGD's new momentum buffers were not looked at: "
                                f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}",
                                key=("fused-momentum-look",))

    def _look(self, scaler, optimizer, params):
        state = scaler._per_optimizer_states.get(id(optimizer), {})
        found = list(state.get("found_inf_per_device", {}).values())
        # An empty buffer holds nothing (and torch's foreach infinity norm raises for it).
        buffers = [optimizer.state[p]["momentum_buffer"] for p in params
                   if optimizer.state.get(p, {}).get("momentum_buffer") is not None and p.numel()]
        devices = {t.device for t in found + buffers}
        if not found or not buffers or len(devices) != 1:
            return  # nothing checked, or spread over devices: not looked at
        step = self._handle._session.step
        detail = (f"{_settings(optimizer)} created its momentum buffers in this step's scaler.step(), which the "
                  "scaler skipped (NaN/Inf in the gradients): the buffers were left unfilled, holding values that "
                  "are not zeros, and every later step starts its momentum from them")
        with torch.no_grad():
            # inf-norm per buffer in one launch; NaN is not 0 either.
            held = torch.stack(torch._foreach_norm(buffers, float("inf"))).ne(0).any()
            damaged = held & (torch.stack(found).sum() > 0)
        self._reads.send(damaged, (step, detail, id(optimizer)))

    def _landed(self, damaged, what):
        step, detail, key = what
        if damaged:
            self._handle._event(EVENT, detail, key=(EVENT, key), step=step)

    def step_ended(self):
        if self._reads.pending:
            self._reads.poll()

    def flush(self):
        self._reads.poll(wait=True)
