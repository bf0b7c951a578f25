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

HALF = (torch.float16, torch.bfloat16)


def holds_half_parameters(params) -> bool:
    return any(p.requires_grad and p.dtype in HALF for p in params)


class UpdateProbe:
    def __init__(self, handle, every):
        self._handle = handle
        self._every = every
        self._watched = set()  # id() of optimizers whose step() carries the probe's hooks
        self._before = None    # (step, [(layer, parameter, its copy, gradient mask)])
        self._landing = []     # (step, layers, pinned host counts, CUDA event): copies under way

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
        for step, layers, host, event in self._landing:
            event.synchronize()
            self._post(step, layers, host.tolist())
        self._landing.clear()

    def _before_step(self, optimizer, args, kwargs):
        handle = self._handle
        self._before = None
        if handle._standing_aside or not handle._begin_cycle():
            return
        self._post_landed()
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
        for device, (layers, counts) in by_device.items():
            stacked = torch.stack(counts)
            if device.type == "cuda":
                host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
                host.copy_(stacked, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                self._landing.append((step, layers, host, event))
            else:
                self._post(step, layers, stacked.tolist())

    def _post_landed(self):
        still = []
        for entry in self._landing:
            step, layers, host, event = entry
            if event.query():
                self._post(step, layers, host.tolist())
            else:
                still.append(entry)
        self._landing = still

    def _post(self, step, layers, counts):
        totals = {}
        for i, layer in enumerate(layers):  # a layer the optimizer holds twice counts once
            totals.setdefault(layer, (counts[2 * i], counts[2 * i + 1]))
        for layer, (nonzero, stalled) in totals.items():
            self._handle._session.weight_update(step, layer, nonzero, stalled)
