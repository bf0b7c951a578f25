"""The GradScaler instance's methods while attached: scale() collects the step's loss,
_unscale_grads_() takes the gradients' statistics (fused with the unscale, in the same bits
as torch's, or before torch's own), step() marks its optimizer step as the normal path
(see _outside_scaler.py), update() ends the step with the scale it chose."""
import functools
import time
import weakref

import torch

from . import _fp32_gradients, _loss
from ._grad_reads import optimizer_gradients, post_stats
from ._loss_code import read_first_loss_code
from ._per_sample import PerSampleGradients
from ._step_end import end_step, end_step_on_device
from ._tensors import (directly_readable, found_inf_tensor, host_gradients, host_outcome, host_scale, inf_checked,
                       scale_on_device)


def wrap_scaler(handle, scaler):
    """Replaces the instance's _unscale_grads_, scale and update with the agent's; close()
    restores the class's."""
    original_unscale = scaler._unscale_grads_
    original_scale = scaler.scale
    original_update = scaler.update
    original_step = scaler.step
    handle._per_sample = PerSampleGradients(handle)

    def _unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16):
        return _unscale(handle, original_unscale, optimizer, inv_scale, found_inf, allow_fp16)

    def scale(outputs):
        scaled = original_scale(outputs)
        _scale(handle, outputs, scaled)
        return scaled

    def step(optimizer, *args, **kwargs):
        if handle._inert:
            return original_step(optimizer, *args, **kwargs)
        new_momentum = handle._fused_momentum.before_step(optimizer)
        handle._scaler_stepped = handle._in_scaler_step = True
        try:
            result = original_step(optimizer, *args, **kwargs)
        finally:
            handle._in_scaler_step = False
        if new_momentum is not None:
            handle._fused_momentum.after_step(scaler, optimizer, new_momentum)
        return result

    def update(new_scale=None):
        if new_scale is not None and not handle._inert:
            _scale_set(handle, new_scale)
        if scale_on_device(scaler):
            # A CUDA scale stays on the device: the outcome is read back without waiting.
            checked = inf_checked(scaler)
            found = found_inf_tensor(scaler) if checked else None
            before = scaler._scale.clone()
            original_update(new_scale)
            if not handle._inert:
                end_step_on_device(handle, scaler._scale, checked, before, found)
            return
        checked, found = host_outcome(scaler)
        before = host_scale(scaler)
        original_update(new_scale)
        if handle._inert:
            return
        if not checked:
            # An update() with no gradients checked since the last one (e.g. holding a
            # minimum scale after the cycle's update()): the same step, at this scale.
            handle._session.amend_scale_after(host_scale(scaler))
            return
        # An optimizer that stepped outside scaler.step() applied this step whatever it held.
        taken = handle._bypass is not None and handle._bypass[0] == "unscaled"
        end_step(handle, before, host_scale(scaler), found, skipped=found and not taken)

    _replace(handle, scaler, _unscale_grads_=_unscale_grads_, scale=scale, step=step, update=update)


def _scale_set(handle, new_scale):
    """update(new_scale=...): event "update-new-scale" once a run, with the scale given (a
    device tensor's is not read: that would wait for the device). The analyzer reads it where
    skipped steps kept their scale."""
    if handle._new_scale_said:
        return
    handle._new_scale_said = True
    value = "a device tensor"
    if not isinstance(new_scale, torch.Tensor) or (new_scale.numel() == 1 and new_scale.is_cpu):
        try:
            value = f"{float(new_scale):g}"
        except (TypeError, ValueError, RuntimeError):
            value = type(new_scale).__name__  # torch's own update() says what is wrong with it
    handle._session.event("update-new-scale", value)


def disabled_scaler_detail(scaler, trains_on) -> str:
    """Event "scaler-disabled": why there is no loss scale. torch itself disables a scaler
    made for a device it does not have (torch.amp.GradScaler() and timm's NativeScaler()
    default to cuda), with one warning, while the model trains on `trains_on`."""
    made_for = getattr(scaler, "_device", None)
    if isinstance(made_for, str) and trains_on is not None and made_for != trains_on:
        return (f"the GradScaler made for {made_for} is disabled: torch turns it off where no {made_for} device is "
                f"available, and the model trains on {trains_on}; there is no loss scale, and the run is recorded as "
                "one without a scaler, each optimizer found in scaler.step()")
    return ("the GradScaler is disabled (enabled=False): there is no loss scale, and the run is recorded as one "
            "without a scaler, each optimizer found in scaler.step()")


def wrap_disabled_scaler(handle, scaler):
    """A disabled GradScaler's step(optimizer) is the optimizer's own and its update() does
    nothing: each optimizer it is given is watched from that call on, its first step
    included, and update() ends the step (the cycle may step several optimizers)."""
    original_step, original_update = scaler.step, scaler.update

    def step(optimizer, *args, **kwargs):
        if not handle._closed and isinstance(optimizer, torch.optim.Optimizer):
            handle._watch_optimizer(optimizer, ends_step=False)
        return original_step(optimizer, *args, **kwargs)

    def update(new_scale=None):
        original_update(new_scale)
        if not handle._closed and handle._in_cycle:
            handle._after_optimizer_step(None, (), {})

    _replace(handle, scaler, step=step, update=update)


def _replace(handle, scaler, **methods):
    """Sets the agent's methods on the instance (the class is untouched); close() removes
    them, and the class's show through again."""
    for name, fn in methods.items():
        setattr(scaler, name, functools.wraps(getattr(type(scaler), name))(fn))
        handle._restore.append((scaler, name))


def _scale(handle, outputs, scaled):
    if handle._inert:
        return
    t0 = time.perf_counter_ns()
    if not handle._live and not handle._begin_cycle():
        return
    handle._scaler_scaled = True
    # Runs every step: each tensor list read once, and loops rather than generators (a
    # generator is one more Python call each time it yields).
    given = _loss.tensors(outputs)
    added = []
    half = False
    for t, s in zip(given, _loss.tensors(scaled)):
        half = half or t.dtype == torch.float16
        if t.numel() == 1 and t.is_floating_point():
            # The same loss scaled again (once to log the scaled value, once to backpropagate
            # it) is one loss of the step, not two.
            loss = None
            for _, earlier, g in handle._scaled:
                if g is t:
                    loss = earlier
                    break
            if loss is None:
                loss = t.detach()
                handle._losses.append(loss)
            handle._scaled.append((s, loss, t))  # to take back if its gradients are taken instead
            added.append(loss)
    if half:
        # Its gradient starts as the scale itself, in fp16: the analyzer says what that costs.
        handle._event("half-loss", "scaler.scale() received a float16 loss")
    handle._keep_loss_nodes(given)
    if not handle._fp32_gradients_read:
        handle._fp32_gradients_read = _fp32_gradients.record(handle, given, handle._layers.model())
    read_first_loss_code(handle)
    handle._look_before_backward(added)
    handle._python_ns += time.perf_counter_ns() - t0


def _unscale(handle, original, optimizer, inv_scale, found_inf, allow_fp16):
    result = _read_and_unscale(handle, original, optimizer, inv_scale, found_inf, allow_fp16)
    if handle._live:  # a cycle the agent records, whose gradients it read
        handle._per_sample.unscaled(optimizer, found_inf)
    return result


def _read_and_unscale(handle, original, optimizer, inv_scale, found_inf, allow_fp16):
    t0 = time.perf_counter_ns()
    if not handle._live and not handle._begin_cycle():
        return original(optimizer, inv_scale, found_inf, allow_fp16)
    if handle._accumulation_probe is not None:
        handle._accumulation_probe.gradients_read()
    last = handle._last_unscaled
    if last is None or last() is not optimizer:  # one optimizer a step: added once
        handle._optimizers.add(optimizer)
        handle._optimizer_adds += 1
        handle._last_unscaled = weakref.ref(optimizer)
    if handle._updates is not None:
        handle._updates.watch(optimizer)
    if handle._profile is not None:
        handle._profile.watch_optimizer(optimizer)
        original = functools.partial(handle._profile.unscale, original)
    if handle._fused and found_inf.is_cpu and inv_scale.is_cpu:
        host = host_gradients(optimizer, handle._layer_id, handle._layers.known)
        if host is not None and host[0]:  # the common case: one pass over the gradients
            layers, ptrs, numels, codes = host
            if not handle._unreached.done:
                handle._unreached.check(optimizer, layers)
            places = [0] * len(layers)
            if handle._session.grads(layers, ptrs, numels, codes, places, places, places, float(inv_scale.item()),
                                   None):
                found_inf.fill_(1.0)
            handle._python_ns += time.perf_counter_ns() - t0
            return {found_inf.device: found_inf}
    layers, grads, sparse = optimizer_gradients(handle, optimizer)
    if not grads:
        _no_gradients(handle, optimizer)
    special = sparse or any(g.dtype == torch.float16 for g in grads)
    # Fused: every gradient read in place on the scale's own device (CPU: the scale is a
    # host value; CUDA: the kernels read inv_scale and write found_inf on the device).
    fusable = (handle._fused and grads and not special and all(directly_readable(g) for g in grads)
               and all(g.device == found_inf.device for g in grads) and inv_scale.device == found_inf.device)
    if fusable:
        with torch.no_grad():
            if found_inf.device.type == "cpu":
                if post_stats(handle, layers, grads, inv_scale=float(inv_scale.item())):
                    found_inf.fill_(1.0)
            else:
                post_stats(handle, layers, grads, device_scale=(inv_scale.data_ptr(), found_inf.data_ptr()))
        handle._python_ns += time.perf_counter_ns() - t0
        return {found_inf.device: found_inf}
    post_stats(handle, layers, grads)
    handle._python_ns += time.perf_counter_ns() - t0
    # torch's own unscale (it also raises for FP16 gradients, as it should).
    return original(optimizer, inv_scale, found_inf, allow_fp16)


def _no_gradients(handle, optimizer):
    """The scaler's unscale found no gradient in any of the optimizer's parameters, so
    torch's scaler.step() refuses it next ("No inf checks were recorded for this
    optimizer"). Where this step's backward did reach some of them, their .grad was set to
    None after it: event "gradients-set-to-none", which gives that refusal its fix
    (zero_grad() between backward() and step(); set_to_none=True is its default)."""
    # The model's own parameters (only they have arrival hooks), looked up without
    # layer_id(), which would register a frozen one for good before it is unfrozen.
    layers = {id(p): layer for layer, p in handle._layers.registered}
    session = handle._session
    reached = [p for group in optimizer.param_groups for p in group["params"]
               if id(p) in layers and session.arrival(layers[id(p)]) >= 0]
    if reached:
        handle._event("gradients-set-to-none", f"this step's backward reached {len(reached)} of the optimizer's "
                      "parameters, and every .grad was None when the scaler unscaled them: something set them to None "
                      "in between, as optimizer.zero_grad() does", key=("gradients-set-to-none",))
