"""Stalled weight updates in half-precision parameters.

When the parameters themselves are fp16 or bf16 (``model.half()`` without FP32 master
weights), an optimizer update smaller than half a unit in the last place of a weight rounds
away: the weight keeps its value although its gradient was not zero. torch.amp keeps FP32
parameters, so this only happens to models that store their weights in half precision.

On the steps the regular sampling records, the probe copies those parameters just before
the optimizer's step() and counts afterwards, per layer, the elements whose gradient was
finite and non-zero and whose value did not change. The counts are reduced on the tensors'
device; a CUDA step's counts are read back without waiting, when the copy has landed.
"""
import torch

from ._device_reads import DeviceReads

HALF = (torch.float16, torch.bfloat16)


def holds_half_parameters(params) -> bool:
    return any(p.requires_grad and p.dtype in HALF for p in params)


class UpdateProbe:
    def __init__(self, handle, every):
        self._handle = handle
        self._every = every
        self._watched = set()  # id() of optimizers whose step() carries the probe's hooks
        self._before = None    # (step, [(layer, parameter, its copy, gradient mask)])
        self._reads = DeviceReads(lambda counts, what: self._post(*what, counts))  # (step, layers)

    def watch(self, optimizer):
        """Measures around `optimizer`'s step() from now on (once per optimizer)."""
        if id(optimizer) in self._watched:
            return
        self._watched.add(id(optimizer))
        hooks = self._handle._hooks
        hooks.append(optimizer.register_step_pre_hook(self._before_step))
        hooks.append(optimizer.register_step_post_hook(self._after_step))

    def flush(self):
        """Posts every count still landing (close(): waits for their copies)."""
        self._reads.poll(wait=True)

    def _before_step(self, optimizer, args, kwargs):
        handle = self._handle
        self._before = None
        if handle._standing_aside or not handle._begin_cycle():
            return
        if self._reads.pending:
            self._reads.poll()
        step = handle._session.step
        if step % self._every:
            return
        entries = []
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    g = p.grad
                    if p.dtype not in HALF or g is None or g.is_sparse or g.shape != p.shape:
                        continue
                    mask = torch.isfinite(g).logical_and_(g != 0)
                    entries.append((handle._layer_id(p), p, p.detach().clone(), mask))
        if entries:
            self._before = (step, entries)

    def _after_step(self, optimizer, args, kwargs):
        if self._before is None:
            return
        step, entries = self._before
        self._before = None
        by_device = {}
        with torch.no_grad():
            for layer, p, old, mask in entries:
                layers, counts = by_device.setdefault(p.device, ([], []))
                layers.append(layer)
                counts.append(mask.sum())
                counts.append(mask.logical_and_(p.detach() == old).sum())
        for layers, counts in by_device.values():
            self._reads.send(torch.stack(counts), (step, layers))

    def _post(self, step, layers, counts):
        totals = {}
        for i, layer in enumerate(layers):  # a layer the optimizer holds twice counts once
            totals.setdefault(layer, (counts[2 * i], counts[2 * i + 1]))
        for layer, (nonzero, stalled) in totals.items():
            self._handle._session.weight_update(step, layer, nonzero, stalled)
