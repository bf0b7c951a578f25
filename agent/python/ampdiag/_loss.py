"""The loss of a run without a GradScaler: the roots that `backward()` is called on.

torch.Tensor.backward() calls torch.autograd.backward() by name, so one wrapper installed
while any handle needs it sees every root (of a backward started outside any other). A
root counts for a handle only if that backward reached the handle's model (one of its
gradient hooks fired), so a second model or an unrelated backward is not mistaken for the
training loss.
"""
import weakref

import torch

_watchers = weakref.WeakSet()
_original = None


def _backward(tensors, *args, **kwargs):
    if torch._C._current_graph_task_id() != -1:
        # Called inside a backward (a reentrant checkpoint recomputing its block): part of
        # the backward under way, whose roots are the loss.
        return _original(tensors, *args, **kwargs)
    watchers = list(_watchers)
    for w in watchers:
        w._before_backward(tensors)
    try:
        return _original(tensors, *args, **kwargs)
    finally:
        for w in watchers:
            w._after_backward()


def watch(handle) -> None:
    global _original
    if _original is None:
        _original = torch.autograd.backward
        torch.autograd.backward = _backward
    _watchers.add(handle)


def unwatch(handle) -> None:
    global _original
    _watchers.discard(handle)
    if not _watchers and _original is not None:
        if torch.autograd.backward is _backward:  # someone wrapped it after us: leave theirs in place
            torch.autograd.backward = _original
        _original = None


def tensors(value) -> list:
    """The tensors in a root or a list of roots."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors(v)]
    return []


def scalar_losses(value) -> list:
    """The scalar floating-point tensors in a root or a list of roots, detached."""
    return [t.detach() for t in tensors(value) if t.numel() == 1 and t.is_floating_point()]
