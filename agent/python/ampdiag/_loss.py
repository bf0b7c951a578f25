"""The loss of a run without a GradScaler: the roots that `backward()` is called on.

torch.Tensor.backward() calls torch.autograd.backward() by name, so one wrapper installed
while any handle needs it sees every root (of a backward started outside any other). A
root counts for a handle only if that backward reached the handle's model (one of its
gradient hooks fired), so a second model or an unrelated backward is not mistaken for the
training loss.

With a GradScaler the loss is what scaler.scale() received, and the wrapper only checks
the roots: a backward started from that loss itself, not from scale()'s output, never
multiplied its gradients by the scale (see check_scaled_roots).
"""
import weakref

import torch

from ._tensors import scale_on_device, scale_text


class _Wrapped:
    """torch.autograd.NAME replaced by `make(original, self)`'s function while any handle
    watches it, and given back when the last one stops. The handles are held weakly (a
    handle never closed is not kept alive by torch's module), as a tuple of references:
    every backward reads them, and iterating a WeakSet there cost ~8 µs a call, measured."""

    def __init__(self, name, make):
        self.name, self.make = name, make
        self.refs = ()
        self.original = self.wrapper = None

    def handles(self) -> list:
        return [h for h in (r() for r in self.refs) if h is not None]

    def watch(self, handle) -> None:
        if self.original is None:
            self.original = getattr(torch.autograd, self.name)
            self.wrapper = self.make(self.original, self)
            setattr(torch.autograd, self.name, self.wrapper)
        if handle not in self.handles():
            self.refs += (weakref.ref(handle),)

    def unwatch(self, handle) -> None:
        self.refs = tuple(r for r in self.refs if r() is not None and r() is not handle)
        if not self.refs and self.original is not None:
            if getattr(torch.autograd, self.name) is self.wrapper:  # someone wrapped it after us: leave theirs
                setattr(torch.autograd, self.name, self.original)
            self.original = self.wrapper = None


def _backward_wrapper(original, wrapped):
    def backward(tensors, *args, **kwargs):
        if torch._C._current_graph_task_id() != -1:
            # Called inside a backward (a reentrant checkpoint recomputing its block): part
            # of the backward under way, whose roots are the loss.
            return original(tensors, *args, **kwargs)
        watching = wrapped.handles()
        # torch.autograd.backward(tensors, grad_tensors, retain_graph, create_graph, ...)
        create_graph = kwargs.get("create_graph", args[2] if len(args) > 2 else False)
        for w in watching:
            w._before_backward(tensors, create_graph)
        try:
            return original(tensors, *args, **kwargs)
        finally:
            for w in watching:
                w._after_backward()

    return backward


def _grad_wrapper(original, wrapped):
    def grad(outputs, *args, **kwargs):
        if torch._C._current_graph_task_id() == -1:
            # torch.autograd.grad(outputs, inputs, grad_outputs, retain_graph, create_graph, ...)
            create_graph = kwargs.get("create_graph", args[3] if len(args) > 3 else False)
            for w in wrapped.handles():
                w._gradients_taken(outputs, create_graph)
        return original(outputs, *args, **kwargs)

    return grad


_backward = _Wrapped("backward", _backward_wrapper)
# torch.autograd.grad: a scaler.scale() output passed to it gives gradients back instead of
# accumulating them (PyTorch's gradient-penalty recipe), so it is not the step's loss; the
# loss is what backward() then receives.
_grad = _Wrapped("grad", _grad_wrapper)
watch, unwatch = _backward.watch, _backward.unwatch
watch_grad, unwatch_grad = _grad.watch, _grad.unwatch


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


def check_scaled_roots(handle, roots) -> bool:
    """Whether the backward's roots hold a scaler.scale() output of this step. With a
    scaler, the loss is what scale() received: a backward started from that loss itself,
    instead of from scale()'s output, makes gradients that were never multiplied by the
    scale, which scaler.step() then divides by it (event "unscaled-backward")."""
    if not handle._scaled:
        return False
    # Runs on every backward: the roots read as they come (through tensors(), whose
    # isinstance(x, torch.Tensor) goes through torch's metaclass, this cost ~6 µs a call).
    # (Loops, not generators: a generator is one more Python call each time it yields.)
    candidates = roots if type(roots) in (list, tuple) else (roots,)
    from_scaled = unscaled = False
    for scaled, _, given in handle._scaled:
        for root in candidates:
            from_scaled = from_scaled or root is scaled
            unscaled = unscaled or root is given
    if unscaled:
        scaler = handle.scaler
        # A CUDA scale is not read: that would make the training thread wait for the device.
        scale = "" if scale_on_device(scaler) else f" (scale {scale_text(float(scaler.get_scale()))})"
        handle._event("unscaled-backward", f"backward() ran on the loss given to scaler.scale(){scale}, not on its "
                      "output", key=("unscaled-backward",))
    return from_scaled
