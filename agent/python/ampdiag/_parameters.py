"""NaN/Inf already stored in the parameters when a step goes NaN/Inf.

Parameters change in the optimizer's step(), not in forward: a module whose weights hold
NaN/Inf makes them from finite inputs in any precision, which its FP32 replay would take
for its own code. So in a step whose output (or, without forward hooks, gradient) first
goes NaN/Inf and whose input held none, the agent looks at the parameters: one pass over
them, on such steps only, until it finds some. It then names an optimizer setting that
rounds to zero in the parameters' dtype, the usual way an update makes NaN from finite
gradients: Adam's eps=1e-8 is 0 in float16, so an element whose gradient is 0 gets 0/0.

A module's buffers are looked at where its FP32 replay made NaN from finite inputs: a
frozen BatchNorm's running variance that a checkpoint (or an earlier NaN batch) left NaN
makes every output NaN in any precision, and its code is not to blame. So does an Inf that
a step wrote into a buffer (an EMA codebook whose update autocast ran in float16). An Inf
buffer may be a mask, by design: one counts only where the buffer held no NaN/Inf at
attach() (finite_buffers()).
"""
import torch

from ._tensors import local_shard

HALF = (torch.float16, torch.bfloat16)
_LISTED = 5  # names in the event's detail; the rest are counted


def nonfinite_parameters(named_parameters) -> "str | None":
    """'2 of 6 parameter tensors: a.weight, a.bias' for the floating-point parameters that
    hold NaN/Inf (a frozen one: NaN; its -inf is a mask kept as a parameter, by design);
    None when none does. Reads the flags back once per device (it waits for the device: it
    runs only in a step that already went NaN/Inf)."""
    by_device = {}
    with torch.no_grad():
        for name, p in named_parameters:
            if not isinstance(p, torch.nn.Parameter):
                # A tensor put in a parameter's place for one call (torch.func.functional_call:
                # MAML's adapted weights) is computed by the step, not stored by an update.
                continue
            p = local_shard(p)  # FSDP2's DTensors: this rank's shard, a plain tensor
            if p.is_floating_point():
                names, flags = by_device.setdefault(p.device, ([], []))
                names.append(name)
                flags.append(torch.isfinite(p).all() if p.requires_grad else ~torch.isnan(p).any())
    bad, total = [], 0
    for names, flags in by_device.values():
        total += len(names)
        bad += [name for name, finite in zip(names, torch.stack(flags).tolist()) if not finite]
    if not bad:
        return None
    listed = ", ".join(bad[:_LISTED]) + (f" (+{len(bad) - _LISTED} more)" if len(bad) > _LISTED else "")
    return f"{len(bad)} of {total} parameter tensors: {listed}"


def eps_rounding_to_zero(optimizers) -> "str | None":
    """'Adam eps=1e-08 is 0 in float16' for the first parameter group whose `eps` is 0 in
    the dtype of half-precision parameters it updates; None when no group's is."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            eps = group.get("eps")
            if not isinstance(eps, float) or eps <= 0.0:
                continue  # Adafactor's is a pair; SGD has none
            for dtype in sorted({p.dtype for p in group["params"] if p.dtype in HALF}, key=str):
                if torch.tensor(eps, dtype=dtype).item() == 0.0:
                    return f"{type(optimizer).__name__} eps={eps:g} is 0 in {str(dtype).replace('torch.', '')}"
    return None


def finite_buffers(root) -> "set[tuple[int, str]]":
    """(id(module), name) of the floating-point buffers without NaN/Inf now, at attach(): one
    read-back per device."""
    by_device = {}
    with torch.no_grad():
        for module in root.modules():
            for name, b in module.named_buffers(recurse=False):
                b = local_shard(b)
                if b.is_floating_point() and b.numel() and not b.is_meta:
                    keys, flags = by_device.setdefault(b.device, ([], []))
                    keys.append((id(module), name))
                    flags.append(torch.isfinite(b).all())
    return {key for keys, flags in by_device.values() for key, finite in zip(keys, torch.stack(flags).tolist()) if finite}


def nan_buffers(path, module, finite_at_attach=frozenset()) -> "str | None":
    """'backbone.1: running_var (1 of 8 values NaN)' for the module's own floating-point
    buffers that hold NaN, or +Inf where they were in `finite_at_attach`, finite_buffers()'s
    ('vq: codebook (float32: 40 of 2048 values Inf, finite at attach())', counting both
    signs); a submodule's are its own to name, as it goes NaN first. None when none does."""
    found = []
    with torch.no_grad():
        for name, b in module.named_buffers(recurse=False):
            if b.is_floating_point():
                nan = int(torch.isnan(b).sum())
                # +Inf: a per-batch mask kept in a buffer fills -inf, by design, after attach().
                written = (id(module), name) in finite_at_attach and bool((b == float("inf")).any())
                inf = int(torch.isinf(b).sum()) if written else 0
                if inf:
                    counts = f"{nan} NaN and {inf} Inf of {b.numel()} values" if nan else f"{inf} of {b.numel()} values Inf"
                    found.append(f"{name} ({str(b.dtype).replace('torch.', '')}: {counts}, finite at attach())")
                elif nan:
                    found.append(f"{name} ({nan} of {b.numel()} values NaN)")
    if not found:
        return None
    listed = ", ".join(found[:_LISTED]) + (f" (+{len(found) - _LISTED} more)" if len(found) > _LISTED else "")
    return f"{path}: {listed}"
