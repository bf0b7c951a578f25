"""Per-sample gradients beside a GradScaler. Opacus's DP-SGD keeps each sample's gradient in
`p.grad_sample` (of the loss backward() was given, in the dtype autocast computed it in), and
its DPOptimizer clips, sums and noises them into `.grad` inside step(): after the scaler has
unscaled `.grad` and checked it for NaN/Inf. The scaler neither unscales nor checks them, so
max_grad_norm bounds them times the scale, and one that overflows float16 makes the update
NaN/Inf on a step the scaler applies.

Where an optimizer's parameters hold them at its first unscale, event "per-sample-gradients"
says so (once a run); a step whose per-sample gradients hold NaN/Inf while the scaler found .grad
finite, so that it applies the step, gets event "per-sample-nonfinite" naming the parameters
(the first 16 such steps), read back without the training thread waiting (a CUDA flag lands
with a later step)."""
import weakref

import torch

from ._device_reads import DeviceReads
from ._names import named_parameters

EVENT = "per-sample-gradients"
NONFINITE = "per-sample-nonfinite"
# Steps recorded, the first ones: once the parameters are NaN every later step holds them too.
WRITTEN = 16


def _tensors(samples):
    """Opacus keeps a tensor, or a list of them for a parameter used more than once."""
    return samples if isinstance(samples, (list, tuple)) else (samples,)


class PerSampleGradients:
    def __init__(self, handle):
        self._handle = handle
        # Each optimizer's (name, parameter) of those holding per-sample gradients, found at its
        # first unscale (a GAN's discriminator trained with DP-SGD may be the second stepped).
        self._params_of = weakref.WeakKeyDictionary()
        self._reads = DeviceReads(self._landed)
        self._written = 0  # per-sample-nonfinite events, one a step up to WRITTEN

    def unscaled(self, optimizer, found_inf):
        """After the scaler's unscale of `optimizer`'s gradients, `found_inf` its check of .grad."""
        if self._reads.pending:
            self._reads.poll()
        params = self._params_of.get(optimizer)
        if params is None:
            params = self._params_of[optimizer] = self._find(optimizer)
        if not params:
            return
        try:
            self._check(params, found_inf)
        except Exception as error:  # a look must never break the training
            params.clear()
            self._handle._event("warning", f"per-sample gradients were not checked: {type(error).__name__}: "
                                f"{str(error).splitlines()[0][:200] if str(error) else ''}", key=(NONFINITE, "look"))

    def _find(self, optimizer):
        """The optimizer's parameters of the model holding per-sample gradients, as (name, parameter)."""
        held = {id(p) for group in optimizer.param_groups for p in group["params"]
                if getattr(p, "grad_sample", None) is not None}
        if not held:
            return []
        params = [(name, p) for name, p in named_parameters(self._handle._watched_model) if id(p) in held]
        if params:
            first = _tensors(params[0][1].grad_sample)[0]
            self._handle._event(EVENT, f"{len(params)} of the optimizer's parameters carry per-sample gradients "
                                f"(grad_sample, {str(first.dtype).replace('torch.', '')}, as Opacus's DP-SGD keeps "
                                f"them: {params[0][0]} of shape {list(first.shape)}): gradients of the scaled loss, "
                                "which its optimizer clips and sums inside step(), after the GradScaler has unscaled "
                                "and checked .grad; the scaler neither unscales nor checks them", key=(EVENT,))
        return params

    def _check(self, params, found_inf):
        names, flags = {}, {}
        with torch.no_grad():
            for name, p in params:
                samples = getattr(p, "grad_sample", None)
                if samples is None:
                    continue
                for t in _tensors(samples):
                    flags.setdefault(t.device, []).append(torch.isfinite(t).all().logical_not())
                    names.setdefault(t.device, []).append(name)
            if found_inf.device in flags:  # None: the scaler's own finding, a step it skips
                flags[found_inf.device].append(found_inf.reshape(()) > 0)
                names[found_inf.device].append(None)
        step = self._handle._session.step
        for device, held in flags.items():
            self._reads.send(torch.stack(held), (step, names[device]))

    def _landed(self, values, what):
        step, names = what
        if any(flag for name, flag in zip(names, values) if name is None):
            return  # the scaler found NaN/Inf in .grad too: the step is skipped, nothing applied
        bad = list(dict.fromkeys(name for name, flag in zip(names, values) if flag))
        if not bad or self._written >= WRITTEN:
            return
        self._written += 1
        more = f" (+{len(bad) - 1} more)" if len(bad) > 1 else ""
        # Keyed by the step: the same words at a later step are another step's.
        self._handle._event(NONFINITE, f"the per-sample gradients of {bad[0]}{more} held NaN/Inf",
                            key=(NONFINITE, step), step=step)

    def flush(self):
        self._reads.poll(wait=True)
