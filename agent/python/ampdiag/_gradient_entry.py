"""Where a backward overflow enters a module. The first NaN/Inf gradient of a skipped step
names the module whose backward ran first with it, yet that module may only have
received the NaN/Inf through its output's gradient, made by the code after it in forward
(a gain, a temperature or an exp() in the model's own forward() or in the loss, whose
fp16 backward overflows): pinning the module would not help there.

So the module a skipped step names has the gradient reaching its output checked on the
first call of each step after that (host tensors only: a device check would wait for the
device). At the next skipped step that names it again, event "module-output-gradient",
"PATH: nonfinite" where that gradient already held NaN/Inf, "PATH: finite" where it was
finite and the module's own backward made them. A skip that names another module moves
the watch there; one verdict a module, at most VERDICTS a run, and a watch no skip
answers within WATCH_STEPS steps is dropped. Steps whose forward, batch, parameters or
loss already held NaN/Inf are the forward's, and judge nothing. A "nonfinite" verdict
arms the look for the module that sent them (_gradient_sender.py)."""
import torch

from ._backward_replay import backward_origin_module
from ._gradient_sender import GradientSenders
from ._tensors import first_float_tensor, holds_nonfinite

KIND = "module-output-gradient"
VERDICTS = 4
WATCH_STEPS = 64


class GradientEntries:
    def __init__(self, handle):
        self._handle = handle
        self._judged = set()
        self._watch = None     # (path, hook handle, steps left)
        self.watching = False  # a watch is armed (read by the end of every step: no call when not)
        self._hooked = False   # this step's first call of the watched module has its gradient hook
        self._reached = None   # whether the gradient reaching its output this step held NaN/Inf
        self._senders = GradientSenders(handle)

    def step_ended(self, judge: bool):
        """Called as a host step ends that was skipped, or while a watch is armed; `judge`:
        the step was skipped with a finite loss."""
        reached, self._reached, self._hooked = self._reached, None, False
        path = backward_origin_module(self._handle) if judge else ""
        self._senders.step_ended(path)  # before a verdict below arms it: a later skip answers
        watch = self._watch
        if not path:
            self._count_down()
        elif watch is not None and watch[0] == path and reached is not None:
            self._drop()
            self._judged.add(path)
            self._handle._session.event(KIND, f"{path}: {'nonfinite' if reached else 'finite'}")
            if reached:
                self._senders.arm(path)
        elif path not in self._judged and len(self._judged) < VERDICTS and (watch is None or watch[0] != path):
            self._drop()
            self._arm(path)
        else:
            self._count_down()
        self.watching = self._watch is not None or self._senders.armed

    def _arm(self, path):
        handle = self._handle
        try:
            module = handle._watched_model.get_submodule(path)
        except AttributeError:
            return

        def on_gradient(grad):
            if not self._reached:
                self._reached = grad.is_cpu and holds_nonfinite(handle._session, grad)

        def after(mod, args, output):
            # (A deep copy of the model carries this hook: only the watched module's call counts.)
            if mod is not module or self._hooked or not handle._live or not torch.is_grad_enabled():
                return None
            tensor = first_float_tensor(output)
            if tensor is not None and tensor.requires_grad and tensor.is_cpu:
                self._hooked = True
                tensor.register_hook(on_gradient)
            return None

        self._watch = (path, module.register_forward_hook(handle._forward_hook_as_run(after)), WATCH_STEPS)

    def _count_down(self):
        if self._watch is not None:
            path, hook, left = self._watch
            if left <= 1:
                self._drop()
            else:
                self._watch = (path, hook, left - 1)

    def _drop(self):
        if self._watch is not None:
            self._watch[1].remove()
            self._watch = None

    def close(self):
        self._drop()
        self._senders.close()
