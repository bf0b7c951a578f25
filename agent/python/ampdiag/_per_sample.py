"""Per-sample gradients beside a GradScaler. Opacus's DP-SGD keeps each sample's gradient in
`p.grad_sample` (of the loss backward() was given, in the dtype autocast computed it in), and
its DPOptimizer clips, sums and noises them into `.grad` inside step(): after the scaler has
unscaled `.grad` and checked it for NaN/Inf. The scaler neither unscales nor checks them, so
max_grad_norm bounds them times the scale, and one that overflows float16 makes the update
NaN/Inf on a step the scaler applies.

Where the optimizer's parameters hold them at the first unscale, event "per-sample-gradients"
says so (once); a step whose per-sample gradients hold NaN/Inf gets event
"per-sample-nonfinite" naming the parameters, read back without the training thread waiting
(a CUDA flag lands with a later step)."""
import torch

from ._device_reads import DeviceReads
from ._names import named_parameters

EVENT = "per-sample-gradients"
NONFINITE = "per-sample-nonfinite"


def _tensors(samples):
    """Opacus keeps a tensor, or a list of them for a parameter used more than once."""
    return samples if isinstance(samples, (list, tuple)) else (samples,)


class PerSampleGradients:
    def __init__(self, handle):
        self._handle = handle
        self._looked = False
        self._params = []  # (name, parameter) of those holding per-sample gradients
        self._reads = DeviceReads(self._landed)

    def unscaled(self, optimizer):
        """At the scaler's unscale of `optimizer`'s gradients."""
        if self._reads.pending:
            self._reads.poll()
        if not self._looked:
            self._looked = True
            self._find(optimizer)
        if not self._params:
            return
        try:
            self._check()
        except Exception as error:  # a look must never break the training
            self._params = []
            self._handle._event("warning", f"per-sample gradients were not checked: {type(error).__name__}: "
                                f"{str(error).splitlines()[0][:200] if str(error) else ''}", key=(NONFINITE, "look"))

    def _find(self, optimizer):
        held = {id(p) for group in optimizer.param_groups for p in group["params"]
                if getattr(p, "grad_sample", None) is not None}
        if not held:
            return
        self._params = [(name, p) for name, p in named_parameters(self._handle._watched_model) if id(p) in held]
        if not self._params:
            return
        first = _tensors(self._params[0][1].grad_sample)[0]
        self._handle._event(EVENT, f"{len(self._params)} of the optimizer's parameters carry per-sample gradients "
                            f"(grad_sample, {str(first.dtype).replace('torch.', '')}, as Opacus's DP-SGD keeps them: "
                            f"{self._params[0][0]} of shape {list(first.shape)}): gradients of the scaled loss, which "
                            "its optimizer clips and sums inside step(), after the GradScaler has unscaled and checked "
                            ".grad; the scaler neither unscales nor checks them")

    def _check(self):
        names, flags = {}, {}
        with torch.no_grad():
            for name, p in self._params:
                samples = getattr(p, "grad_sample", None)
                if samples is None:
                    continue
                for t in _tensors(samples):
                    flags.setdefault(t.device, []).append(torch.isfinite(t).all().logical_not())
                    names.setdefault(t.device, []).append(name)
        step = self._handle._session.step
        for device, held in flags.items():
            self._reads.send(torch.stack(held), (step, names[device]))

    def _landed(self, values, what):
        step, names = what
        bad = list(dict.fromkeys(name for name, flag in zip(names, values) if flag))
        if not bad:
            return
        more = f" (+{len(bad) - 1} more)" if len(bad) > 1 else ""
        self._handle._event(NONFINITE, f"the per-sample gradients of {bad[0]}{more} held NaN/Inf", step=step)

    def flush(self):
        self._reads.poll(wait=True)
