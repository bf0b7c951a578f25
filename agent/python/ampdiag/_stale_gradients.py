"""Gradients left from the step before: optimizer.zero_grad() (or model.zero_grad())
forgotten between optimizer steps, so every step adds its gradients to all the earlier
ones until they overflow fp16, and the report would blame the layer that overflows first.

One parameter is the probe: the smallest trainable one, whose .grad is cheap to read. Its
gradient hook runs before autograd accumulates into .grad, so at its first gradient of an
optimizer cycle .grad holds what the cycle before left: None or zeros after a zero_grad(),
else that cycle's gradient. That is a suspicion, settled when the step ends: a later
gradient of the same cycle that finds .grad None or zeros shows it was zeroed in between
(PyTorch's DCGAN loop: the generator's backward runs through the discriminator after the
discriminator's step, and the discriminator's zero_grad() at the start of its next step
clears it); else event "gradients-not-zeroed", once, at the step of the first look. A
parameter that no optimizer the agent saw holds keeps its gradient by design (nothing
zeroes or applies it) and is not judged.

A CUDA .grad is reduced on its device, and so is each later look of the cycle (a .grad
of zeros clears the suspicion there, None on the host), so that the device answer is
settled as the host one is; at the step's end it is copied to pinned memory without
waiting, read when the copy has landed (at a later step, or at close()), and the event
carries the step it was looked at. Reading it at once would make the training thread wait
for the device on every step of a loop that zeroes with set_to_none=False.

Every ZERO_LOOK_EVERY steps the probe also looks at what its host gradients arrive
holding and, at the step's end, says once whether backward itself delivered nothing but zeros
(event "gradients-arrived-zero"): all-zero gradients at the optimizer step are then the
loss's (saturated, exactly 0, or detached from the model), not a zero_grad() between
backward and the step, which the report would otherwise infer from them.
"""
import weakref

import torch

from . import _device_reads

EVENT = "gradients-not-zeroed"
ARRIVED_ZERO = "gradients-arrived-zero"
ZERO_LOOK_EVERY = 16  # a look is a reduction of the smallest parameter's gradient: not every step


def probe_of(params: list) -> "torch.Tensor | None":
    """The smallest dense trainable parameter, or None."""
    candidates = [p for p in params if p.requires_grad and p.layout is torch.strided]
    return min(candidates, key=lambda p: p.numel(), default=None)


class GradientProbe:
    def __init__(self, handle, param: torch.Tensor, name: str):
        self._handle = handle
        self._param = weakref.ref(param)
        self._name = name
        self._reported = False
        self._suspect = None  # the step whose first gradient found .grad holding the last step's
        self._device_look = None  # [device bool, step]: a device suspicion of this cycle, unsettled
        self._reads = _device_reads.DeviceReads(self._landed)  # its answer, on its way: step
        self._look_step = None  # the step whose host gradients are being looked at as they arrive
        self._arrived_nonzero = False  # whether one of them held anything but zeros
        self._until_zero_look = 0  # steps until the next look at them (ZERO_LOOK_EVERY)
        self._zero_reported = False

    def hook(self, arrival):
        """`arrival`, the parameter's gradient hook, followed by the look at its .grad on
        its first gradient of a cycle."""
        handle = self._handle

        def hook(grad):
            arrival(grad)
            if not handle._live:
                return
            if self._until_zero_look == 0 and not self._zero_reported and not grad.is_cuda:
                # Read now: autograd may accumulate into this very tensor later in the step.
                self._look_step = handle._session.step
                self._arrived_nonzero = self._arrived_nonzero or grad.is_sparse or bool(grad.any())
            if self._reported:
                return
            p = self._param()
            if p is None:
                return
            if not handle._gradients_probed:
                handle._gradients_probed = True
                self._suspect = None
                if p.grad is not None:
                    self._look(p)
            elif self._suspect is not None and (p.grad is None or (not _device_reads.on_device(p.grad) and not bool(p.grad.any()))):
                self._suspect = None  # zeroed since the first look: what it held was never applied
            elif self._device_look is not None:
                if p.grad is None:
                    self._device_look = None
                elif _device_reads.on_device(p.grad):
                    with torch.no_grad():  # zeros now: zeroed since the first look
                        self._device_look[0] = self._device_look[0] & p.grad.any()

        return hook

    def step_ended(self):
        """The step is ending: a suspicion its later gradients did not clear is the event (a
        device one once its answer has landed)."""
        if self._suspect is not None and not self._reported:
            self._report(self._suspect)
        self._suspect = None
        if self._device_look is not None:
            self._reads.send(*self._device_look)
            self._device_look = None
        if self._reads.pending:
            self._reads.poll()
        if self._look_step is not None:
            self._look_at_arrivals()
        elif self._until_zero_look > 0:
            self._until_zero_look -= 1

    def _look_at_arrivals(self):
        step, nonzero = self._look_step, self._arrived_nonzero
        self._look_step, self._arrived_nonzero = None, False
        self._until_zero_look = ZERO_LOOK_EVERY - 1
        if nonzero:
            return
        self._zero_reported = True
        self._handle._event(ARRIVED_ZERO, f"{self._name}'s gradient arrived from backward all zeros",
                            key=(ARRIVED_ZERO,), step=step)

    def flush(self):
        """Reads a device look still landing (close(): waits for its copy)."""
        self._reads.poll(wait=True)

    def _look(self, param):
        grad = param.grad
        if grad.is_sparse:
            return
        step = self._handle._session.step
        if _device_reads.on_device(grad):
            self._look_on_device(grad, step)
        elif bool(grad.any()) and self.optimized(param):
            self._suspect = step

    def _look_on_device(self, grad, step):
        if self._reads.pending and not self._reads.poll():
            return  # the last look's answer is still on its way: this step goes unread
        if self._reported or not self.optimized(self._param()):
            return
        with torch.no_grad():
            self._device_look = [grad.any(), step]

    def _landed(self, held, step):
        if held:
            self._report(step)

    def optimized(self, param):
        return param is not None and any(q is param for opt in list(self._handle._optimizers)
                                         for group in opt.param_groups for q in group["params"])

    def _report(self, step):
        self._reported = True
        self._handle._event(EVENT, f"{self._name}'s gradient still held the previous optimizer step's values when "
                                   "this step's first gradient arrived: the gradients were not zeroed between steps",
                            key=(EVENT,), step=step)
