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
arms the look for the module that sent them (_gradient_sender.py).

The other modules whose gradients went NaN/Inf in that skip (at most COMPANIONS) are
watched with it, and judged at a later skip naming it where theirs went NaN/Inf again (the
watch lasts until each is judged, or its WATCH_STEPS run out): event
"companion-output-gradient", "q: finite, beside k" says q's own backward overflowed as well,
apart from k's (two projections of one large input), so that pinning k alone would leave
the step skipped; "nonfinite", that q received its NaN/Inf. A companion's verdict leaves its
own as a named module to come (and the looks that follow that one)."""
import torch

from ._backward_replay import backward_origin_module
from ._gradient_sender import GradientSenders
from ._tensors import first_float_tensor, holds_nonfinite

KIND = "module-output-gradient"
BESIDE_KIND = "companion-output-gradient"
VERDICTS = 4
WATCH_STEPS = 64
COMPANIONS = 3


class _Watch:
    """One watched module: its forward hook, and this step's look at its output gradient."""

    __slots__ = ("path", "hook", "hooked", "reached", "done")

    def __init__(self, path):
        self.path = path
        self.hook = None
        self.done = False     # judged
        self.hooked = False   # this step's first call of the module has its gradient hook
        self.reached = None   # whether the gradient reaching its output this step held NaN/Inf


class GradientEntries:
    def __init__(self, handle):
        self._handle = handle
        self._judged = set()    # named modules' verdicts
        self._beside = set()    # companions' verdicts: (companion, named)
        self._watches = []      # the named module's first, then its companions
        self._left = 0          # steps the watch waits for a skip that names it again
        self.watching = False   # a watch is armed (read by the end of every step: no call when not)
        self._senders = GradientSenders(handle)

    def step_ended(self, judge: bool):
        """Called as a host step ends that was skipped, or while a watch is armed; `judge`:
        the step was skipped with a finite loss."""
        reached = []
        for w in self._watches:
            reached.append(w.reached)
            w.reached, w.hooked = None, False
        path = backward_origin_module(self._handle) if judge else ""
        others = self._handle._session.nonfinite_modules(COMPANIONS) if path else []
        self._senders.step_ended(path)  # before a verdict below arms it: a later skip answers
        watched = self._watches[0].path if self._watches else None
        if not path:
            self._count_down()
        elif watched == path:
            named = self._watches[0]
            if not named.done and reached[0] is not None:
                named.done = True
                self._judged.add(path)
                self._handle._session.event(KIND, f"{path}: {'nonfinite' if reached[0] else 'finite'}")
                if reached[0]:
                    self._senders.arm(path)
            # A companion is judged where its gradients went NaN/Inf in a skip naming the
            # module too, and watched until then (q beside k, not in every skip k is first in).
            for w, seen in zip(self._watches[1:], reached[1:]):
                if not w.done and seen is not None and w.path in others:
                    w.done = True
                    self._beside.add((w.path, path))
                    self._handle._session.event(BESIDE_KIND,
                                                f"{w.path}: {'nonfinite' if seen else 'finite'}, beside {path}")
            if all(w.done for w in self._watches):
                self._drop()
            else:
                self._count_down()
        elif path not in self._judged and len(self._judged) < VERDICTS:
            self._drop()
            self._arm([path] + [p for p in others if (p, path) not in self._beside][:COMPANIONS])
        else:
            self._count_down()
        self.watching = bool(self._watches) or self._senders.armed

    def _arm(self, paths):
        handle = self._handle
        for path in paths:
            try:
                module = handle._watched_model.get_submodule(path)
            except AttributeError:
                if path == paths[0]:
                    return
                continue
            w = _Watch(path)
            w.hook = module.register_forward_hook(handle._forward_hook_as_run(self._watcher(w, module)))
            self._watches.append(w)
        self._left = WATCH_STEPS

    def _watcher(self, w, module):
        handle = self._handle

        def on_gradient(grad):
            if not w.reached:
                w.reached = grad.is_cpu and holds_nonfinite(handle._session, grad)

        def after(mod, args, output):
            # (A deep copy of the model carries this hook: only the watched module's call counts.)
            if mod is not module or w.hooked or not handle._live or w.done or not torch.is_grad_enabled():
                return None
            tensor = first_float_tensor(output)
            if tensor is not None and tensor.requires_grad and tensor.is_cpu:
                w.hooked = True
                tensor.register_hook(on_gradient)
            return None

        return after

    def _count_down(self):
        if self._watches:
            self._left -= 1
            if self._left <= 0:
                self._drop()

    def _drop(self):
        for w in self._watches:
            w.hook.remove()
        self._watches = []

    def close(self):
        self._drop()
        self._senders.close()
