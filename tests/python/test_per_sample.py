"""The agent's look at per-sample gradients (_per_sample.py), as Opacus keeps them in
p.grad_sample: a step whose per-sample gradients hold NaN/Inf is recorded only where the
scaler found .grad finite, so that it applies the step; a skipped step's, the scaler's own
calibration, is not, and does not use up the steps recorded."""
import types

import torch
from torch import nn

from ampdiag._per_sample import NONFINITE, PerSampleGradients


class Handle:
    """The handle's parts the look uses: the model, the session's step, and events written
    once a key, as the session's event_once() does."""

    def __init__(self, model):
        self._watched_model = model
        self._session = types.SimpleNamespace(step=0)
        self.events = []
        self._keys = set()

    def _event(self, kind, detail, key=None, step=None):
        if repr(key or (kind, detail)) not in self._keys:
            self._keys.add(repr(key or (kind, detail)))
            self.events.append((kind, detail, step))


def looked_at(skipped_steps, applied_step):
    """Steps 0 .. applied_step of a Linear whose per-sample gradients hold Inf at every step,
    .grad found NaN/Inf by the scaler at `skipped_steps`; the look's events."""
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = Handle(model)
    look = PerSampleGradients(handle)
    for step in range(applied_step + 1):
        handle._session.step = step
        model.weight.grad_sample = torch.full((3, 2, 4), float("inf"), dtype=torch.float16)
        model.bias.grad_sample = torch.zeros(3, 2, dtype=torch.float16)
        look.unscaled(opt, torch.tensor(1.0 if step in skipped_steps else 0.0))
    look.flush()
    return [(detail, step) for kind, detail, step in handle.events if kind == NONFINITE]


def test_per_sample_nan_at_a_step_the_scaler_skips_is_not_recorded():
    assert looked_at(skipped_steps={0, 1, 2}, applied_step=2) == []


def test_per_sample_nan_at_an_applied_step_after_skipped_ones_is_recorded_at_its_step():
    assert looked_at(skipped_steps=set(range(20)), applied_step=20) == [
        ("the per-sample gradients of weight held NaN/Inf", 20)]


def test_the_run_is_told_once_that_its_parameters_carry_per_sample_gradients():
    model = nn.Linear(4, 2)
    handle = Handle(model)
    model.weight.grad_sample = torch.zeros(3, 2, 4, dtype=torch.float16)
    look = PerSampleGradients(handle)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        look.unscaled(opt, torch.tensor(0.0))
    [(kind, detail, _)] = handle.events
    assert kind == "per-sample-gradients"
    assert detail.startswith("1 of the optimizer's parameters carry per-sample gradients (grad_sample, float16, as "
                             "Opacus's DP-SGD keeps them: weight of shape [3, 2, 4])")


def test_per_sample_gradients_of_the_second_optimizer_stepped_are_found():
    # A GAN whose discriminator trains with DP-SGD: the generator's optimizer is unscaled first.
    generator, discriminator = nn.Linear(4, 4), nn.Linear(4, 1)
    model = nn.ModuleDict({"g": generator, "d": discriminator})
    handle = Handle(model)
    look = PerSampleGradients(handle)
    opt_g, opt_d = torch.optim.SGD(generator.parameters(), lr=0.1), torch.optim.SGD(discriminator.parameters(), lr=0.1)
    discriminator.weight.grad_sample = torch.full((3, 1, 4), float("inf"), dtype=torch.float16)
    look.unscaled(opt_g, torch.tensor(0.0))
    look.unscaled(opt_d, torch.tensor(0.0))
    look.flush()
    kinds = [(kind, detail) for kind, detail, _ in handle.events]
    assert kinds[0][0] == "per-sample-gradients" and "d.weight of shape [3, 1, 4]" in kinds[0][1]
    assert kinds[1] == (NONFINITE, "the per-sample gradients of d.weight held NaN/Inf")
