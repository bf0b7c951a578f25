"""The end of an optimizer cycle: what is known only once the step is over, the step's row
(its scalars read on the host, or left on their device and written when they land), and
the handle's cycle closed, so that the next hook opens the next one."""
import math

import torch

from . import _ampdiag
from ._looks import look_at_loss_code
from ._tensors import engine_place, host_sum, sum_on


def end_step(handle, scale_before, scale_after, found_inf, skipped):
    """Ends the step with its scalars on the host (a CUDA loss is still read back later)."""
    _before_step_end(handle)
    losses = handle._logged_losses or handle._losses or handle._taken_losses
    on_device = None
    for t in losses:  # (a loop: a generator is one more call a loss, every step)
        if t.is_cuda:
            on_device = t.device
            break
    if on_device is not None:
        # A CUDA loss (bf16 without a scaler) is summed there and read back with the step,
        # never with .item(): that would wait for the device.
        zero = torch.zeros((), dtype=torch.float64, device=on_device)
        _end_step_later(handle, torch.stack([sum_on(on_device, losses), zero, zero, zero]), _ampdiag.OUTCOME_LOSS,
                        losses, scale_before, scale_after, found_inf, skipped)
    else:
        loss = host_sum(losses)
        finite_loss = not losses or math.isfinite(loss)
        entries = handle._gradient_entries
        if entries is not None and (skipped or entries.watching):
            entries.step_ended(skipped and finite_loss)
        if not finite_loss:
            look_at_loss_code(handle)
        elif skipped and scale_before <= 1.0 and handle._backward_replayer is not None:
            handle._backward_replayer.skipped_at_unit_scale()
        handle._weights.step_ended(handle._session.step, skipped, handle._optimizers, handle._stepped_optimizers,
                                   handle._optimizer_adds)
        handle._session.end_step(loss, len(losses), scale_before, scale_after, found_inf, skipped, handle._python_ns)
        _step_ended(handle)
    handle._last_step_skipped = skipped


def end_step_on_device(handle, scale, checked, before, found):
    """Ends the step (or amends the pending one) with its scalars still on the scale's
    device (found_inf summed there, float64)."""
    zero = torch.zeros((), dtype=torch.float64, device=scale.device)
    if not checked:
        values = torch.stack([zero, zero, scale.double(), zero])
        handle._session.amend_on_device(values.data_ptr(), *engine_place(values)[1:])
        return
    _before_step_end(handle)
    losses = handle._logged_losses or handle._losses or handle._taken_losses
    fields = (_ampdiag.OUTCOME_SCALE_BEFORE | _ampdiag.OUTCOME_SCALE_AFTER | _ampdiag.OUTCOME_FOUND_INF
              | _ampdiag.OUTCOME_SKIPPED_IS_FOUND_INF)
    loss = zero
    if losses and not all(t.device.type == "cpu" for t in losses):
        loss = sum_on(scale.device, losses)
        fields |= _ampdiag.OUTCOME_LOSS
    _end_step_later(handle, torch.stack([loss, before.double(), scale.double(), found]), fields, losses,
                         math.nan, math.nan, False, False)
    handle._last_step_skipped = found  # read only if someone asks


def _before_step_end(handle):
    """What is known only once the step is over: its NaN/Inf forwards that no backward
    reached, and whether its gradients started from the last step's."""
    for kind, detail in handle._dropped.step_ended():
        handle._session.event(kind, detail)
    if handle._gradient_probe is not None:
        handle._gradient_probe.step_ended()
    handle._fused_momentum.step_ended()
    if handle._accumulation_probe is not None:
        handle._accumulation_probe.step_ended()
    if handle._backward_replayer is not None:
        handle._backward_replayer.step_ended()
    if handle._precision is not None:
        handle._precision.step_ended()


def _end_step_later(handle, values, fields, losses, scale_before, scale_after, found_inf, skipped):
    """Ends the step with `values` (loss, scale before, after, found_inf: float64 on a
    CUDA device), which the session copies to pinned memory on the current stream and
    writes into the step as `fields` says when they have landed; the rest from here."""
    loss = host_sum(losses) if not fields & _ampdiag.OUTCOME_LOSS else math.nan
    handle._session.end_step_on_device(loss, len(losses), scale_before, scale_after, found_inf, skipped,
                                       handle._python_ns, values.data_ptr(), *engine_place(values)[1:], fields)
    _step_ended(handle)


def _step_ended(handle):
    """The session has ended the step: the next hook opens the next cycle, and the
    modules confirmed in this one are pinned from it on."""
    if handle._traced_by_compile:
        # Moving the hooks outside the graph now would break a fullgraph=True compile,
        # which nothing here can see, in the middle of training.
        handle._traced_by_compile = False
        handle._event("compiled-after-attach", "torch.compile traced ampdiag's forward hooks: the model, or part of "
                    "it, was compiled after attach(), and what was compiled is not watched (no activation rows); "
                    "call attach() after torch.compile")
    handle._python_ns = 0
    handle._in_cycle = False
    handle._live = False
    handle._root_inputs = None  # the batch is the user's again
    handle._output_nodes, handle._loss_code_outputs, handle._loss_nodes, handle._scaled = [], [], [], []  # the step's graph is the user's to free
    handle._last_node, handle._module_nodes = None, []
    if handle._autopin is not None:
        handle._autopin.pin()
