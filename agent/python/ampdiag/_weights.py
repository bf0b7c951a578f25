"""The weights' norms now and then: evidence of why a module overflowed.

A learning rate far too high (AdamW at 0.3) grows the weights step by step until a forward
overflows fp16. The report names the module where that happened, which is true, and
without the weights it cannot say why: the loss may grow less than 2x on the way. So on the
session core's schedule (WeightSchedule: the start of steps 0, 1, 2, 3, 4, 6, 8, 12, ...,
and the end of the run's first skipped steps) each registered parameter's L2 norm and
abs-max are recorded (rows of weight_norms), and each optimizer's settings (event
"optimizer-settings"): once, then again on the schedule's steps where a learning-rate
schedule (a warm-up, OneCycleLR) has moved the first group's lr 2x or more since, so that
the report quotes the rate the weights grew under, not the warm-up's first. Device
parameters are reduced on their device (torch's foreach norms, L2 in float64) and their
values copied to pinned memory without waiting; they are recorded, at the step they were
read at, once the copy has landed (a later step's start or end, or close()). Sharded
parameters (FSDP2's DTensors, every parameter under FSDP1) are not read: that would see one
shard.
"""
import math
import weakref

import torch

from . import _ampdiag
from ._device_reads import DeviceReads
from ._tensors import DTYPE_CODE, directly_readable, distributed


LR_MOVED = 2.0  # the factor by which the learning rate must move to be recorded again


def _lr(optimizer):
    """The first group's learning rate, a number, or None."""
    lr = optimizer.param_groups[0].get("lr") if optimizer.param_groups else None
    if isinstance(lr, torch.Tensor) and lr.numel() == 1 and not lr.is_cuda:  # a tensor lr (capturable Adam)
        lr = lr.item()
    return float(lr) if isinstance(lr, (int, float)) and not isinstance(lr, bool) else None


def _moved(said, now) -> bool:
    if said is None or now is None:
        return False
    return now >= said * LR_MOVED or now * LR_MOVED <= said if said > 0 else now > 0


def _settings(optimizer) -> str:
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    said = [f"{key}={group[key]:.6g}" for key in ("lr", "weight_decay", "momentum")
            if isinstance(group.get(key), (int, float)) and not isinstance(group.get(key), bool)]
    groups = len(optimizer.param_groups)
    return f"{type(optimizer).__name__} {' '.join(said)}" + (f" (first of {groups} groups)" if groups > 1 else "")


def _norms(params):
    """(L2 in float64, abs-max) of each tensor, as an [n, 2] float64 tensor on their device:
    two foreach launches, whose float64 squares cannot overflow. An empty tensor's are 0
    (torch's foreach infinity norm raises for one: it has no identity)."""
    with torch.no_grad():
        params = [p if p.numel() else p.new_zeros(1) for p in params]
        l2 = torch.stack(torch._foreach_norm(params, 2, dtype=torch.float64))
        peak = torch.stack(torch._foreach_norm(params, math.inf)).double()
        return torch.stack([l2, peak], 1)


class WeightSampler:
    def __init__(self, handle, registered, sharded=False):
        self._handle = handle
        self._sharded = sharded  # FSDP1's shards, plain tensors: each would be read as a whole weight
        # (layer, parameter): floating-point tensors of the model, on the host and on devices
        self._params, self._device_params = [], {}
        for layer, p in registered:
            self.add(layer, p)
        self._reads = DeviceReads(lambda values, what: self._post(*what, values))  # (step, layers)
        self._schedule = _ampdiag.WeightSchedule()
        self._described = weakref.WeakKeyDictionary()  # optimizer -> the lr its last settings event said
        self._adds = 0  # the handle's _optimizer_adds when the sets were last looked at

    def add(self, layer, p):
        """A parameter of the model (at attach(), or added to it since)."""
        if not p.is_floating_point() or distributed(p) or self._sharded:
            return
        if p.device.type == "cpu":
            self._params.append((layer, p))
        elif p.is_cuda:
            self._device_params.setdefault(p.device, []).append((layer, p))

    def step_began(self, step: int):
        if self._reads.pending:
            self._reads.poll()
        if self._schedule.at_start(step):
            self._sample()
            for optimizer, said in list(self._described.items()):
                now = _lr(optimizer)
                if _moved(said, now):
                    self._described[optimizer] = now
                    self._handle._session.event("optimizer-settings", _settings(optimizer))

    def step_ended(self, step: int, skipped: bool, seen, stepped, adds: int):
        """`seen` and `stepped` (WeakSets): the optimizers of the run so far; `adds`: how many
        times one was added to them. They are looked at only when that moved, then their
        sizes first: iterating WeakSets every step cost more than the rest of this."""
        if adds != self._adds:
            self._adds = adds
            if len(self._described) < len(seen) + len(stepped):
                for optimizer in list(seen) + list(stepped):
                    if optimizer in self._described:
                        continue
                    self._described[optimizer] = _lr(optimizer)
                    self._handle._session.event("optimizer-settings", _settings(optimizer))
        if skipped and self._schedule.after_skip(step):
            self._sample()
        if self._reads.pending:
            self._reads.poll()

    def flush(self):
        """close(): waits for the device reads still landing."""
        self._reads.poll(wait=True)

    def _sample(self):
        if self._device_params:
            try:
                self._sample_devices()
            except Exception as error:  # reading the weights must never break the training
                self._device_params.clear()
                self._handle._event("warning", f"the weights on devices are not read: {type(error).__name__}: "
                                    f"{str(error).splitlines()[0][:200] if str(error) else ''}",
                                    key=("device-weights",))
        if not self._params:
            return
        # float32, float16 and bfloat16 in one pass of the engine (L2 accumulated in double,
        # abs-max); torch's inf norm alone took 8 ms of a 19 MB model's 9.5 (PERFORMANCE.md).
        layers, ptrs, numels, codes, others = [], [], [], [], []
        for layer, p in self._params:
            if not directly_readable(p):
                others.append((layer, p))
                continue
            layers.append(layer)
            ptrs.append(p.data_ptr())
            numels.append(p.numel())
            codes.append(DTYPE_CODE[p.dtype])
        self._handle._session.weight_norms(layers, ptrs, numels, codes)
        if others:  # float64, or with gaps
            self._post(None, [layer for layer, _ in others], _norms([p for _, p in others]).tolist())

    def _sample_devices(self):
        step = self._handle._session.step
        for params in self._device_params.values():
            self._reads.send(_norms([p for _, p in params]), (step, [layer for layer, _ in params]))

    def _post(self, step, layers, values):
        """Rows for `values` ([l2, abs-max] each) of `layers`; a tensor holding NaN/Inf has none."""
        session = self._handle._session
        for layer, (l2, peak) in zip(layers, values):
            if math.isfinite(l2) and math.isfinite(peak):
                session.weight_norm(layer, l2, min(peak, l2), step=step)
