"""Where a backward overflow enters a module: the hooks for the session core's EntryWatches
(agent/core/entry_watches.h, which decides what is watched, which skip judges it, and the
events). The first NaN/Inf gradient of a skipped step names the module whose backward ran
first with it, yet that module may only have received the NaN/Inf through its output's
gradient, made by the code after it in forward (a gain, a temperature or an exp() in the
model's own forward() or in the loss, whose fp16 backward overflows): pinning the module
would not help there.

So each module the core watches (the one a skip named, and up to COMPANIONS others whose
gradients went NaN/Inf in that skip) has the gradient reaching its output checked in each
step, at the call whose output receives its gradient first in backward: the last call of a
module the forward runs several times (host tensors only: a device check would wait for
the device), and what was seen goes to the core as the step ends. Steps whose forward, batch, parameters or
loss already held NaN/Inf are the forward's, and judge nothing. A "nonfinite" verdict on the
named module arms the look for the module that sent them (_gradient_sender.py)."""
import torch

from . import _ampdiag
from ._backward_replay import backward_origin_module
from ._code_after import CodeAfter, LossCodeOrigin
from ._gradient_sender import GradientSenders
from ._tensors import first_float_tensor, holds_nonfinite

COMPANIONS = _ampdiag.EntryWatches.COMPANIONS
_NOT_SEEN, _FINITE, _NONFINITE = -1, 0, 1


class _Look:
    """One watched module: its forward hook, and this step's look at its output gradient."""

    __slots__ = ("path", "hook", "reached", "done")

    def __init__(self, path, done):
        self.path = path
        self.hook = None
        self.done = done      # judged: no more looks
        self.reached = _NOT_SEEN


class GradientEntries:
    def __init__(self, handle):
        self._handle = handle
        self._core = _ampdiag.EntryWatches()
        self._looks = []        # one per core watch, in its order
        self.watching = False   # a watch is armed (read by the end of every step: no call when not)
        self._senders = GradientSenders(handle)
        self._code_after = CodeAfter(handle)  # the code after the named module, where it received NaN/Inf
        self._loss_origin = LossCodeOrigin(handle)  # where the loss's backward made the output's NaN/Inf

    def step_ended(self, judge: bool):
        """Called as a host step ends that was skipped, or while a watch is armed; `judge`:
        the step was skipped with a finite loss."""
        reached = []
        for look in self._looks:
            reached.append(look.reached)
            look.reached = _NOT_SEEN
        self._code_after.step_ended()
        self._loss_origin.step_ended()
        path = backward_origin_module(self._handle) if judge else ""
        others = self._handle._session.nonfinite_modules(COMPANIONS) if path else []
        self._senders.step_ended(path)  # before a verdict below arms it: a later skip answers
        events, nonfinite = self._core.step_ended(path, others, reached)
        for kind, detail in events:
            self._handle._session.event(kind, detail)
        if nonfinite:
            self._senders.arm(nonfinite)
        watches = self._core.watches
        if [p for p, _ in watches] != [look.path for look in self._looks]:
            self._drop()
            self._arm(watches)
        else:
            for look, (_, done) in zip(self._looks, watches):
                look.done = done
        self.watching = self._watching()

    def _watching(self):
        return bool(self._looks) or self._senders.armed or self._code_after.armed or self._loss_origin.armed

    def trace_loss_code(self):
        """The gradient reaching the model's output held NaN made by the loss's backward: its
        origin in the loss code is traced at the next steps."""
        self._loss_origin.arm()
        self.watching = self._watching()

    def _arm(self, watches):
        handle = self._handle
        for path, done in watches:
            look = _Look(path, done)
            self._looks.append(look)
            try:
                module = handle._watched_model.get_submodule(path)
            except AttributeError:
                continue  # never seen: judged by no skip, dropped with the watch
            look.hook = module.register_forward_hook(handle._forward_hook_as_run(self._watcher(look, module)))

    def _watcher(self, look, module):
        handle = self._handle

        def judged_by(node):
            def on_gradient(grad):
                # The first of the step's calls to receive its gradient is judged: later ones
                # (earlier calls of a module the forward runs again and again, an ODE's
                # function, a shared layer) may hold what its own backward made in between.
                if look.reached != _NOT_SEEN:
                    return
                look.reached = _NONFINITE if grad.is_cpu and holds_nonfinite(handle._session, grad) else _FINITE
                if look.reached == _NONFINITE and self._looks and look is self._looks[0]:  # the named module's
                    self._code_after.read(look.path, module, node)

            return on_gradient

        def after(mod, args, output):
            # (A deep copy of the model carries this hook: only the watched module's call counts.)
            if mod is not module or not handle._live or look.done or not torch.is_grad_enabled():
                return None
            tensor = first_float_tensor(output)
            if tensor is not None and tensor.requires_grad and tensor.is_cpu:
                tensor.register_hook(judged_by(tensor.grad_fn))
            return None

        return after

    def before_backward(self):
        """As scaler.scale() hands over the loss: the named module's code after it traced
        for where it made NaN/Inf, once that code was read."""
        self._code_after.before_backward()
        self._loss_origin.before_backward()

    def _drop(self):
        for look in self._looks:
            if look.hook is not None:
                look.hook.remove()
        self._looks = []

    def close(self):
        self._drop()
        self._code_after.close()
        self._loss_origin.close()
        self._senders.close()
