"""Self-healing pins (attach(autopin=N)): a module whose FP32 replay confirmed it as the
origin of a non-finite forward value runs in FP32 from the next optimizer cycle on, with an
`autopin` event (its detail is the module path, which the report reads) so the user can
make the pin permanent in code. Never a module whose replay was not confirmed, never more
than N modules. A confirmed module whose FP32 output is beyond fp16's range would hand it
to the code that uses it, which overflows instead where it runs in fp16: its parent is
pinned, with what uses that output (event `autopin-parent`, "PARENT: CHILD, FP32 output up
to X"). A module whose precision check found most of its output lost (finite, but at least
half of its L2 norm away from the same call in FP32) is pinned too (event
`autopin-precision`, "PATH: 97 % away from FP32"): the FP32 output is what the pin gives.
The parent is the nearest module above it with a forward of its own (past a ModuleDict or
ModuleList); where only the model is above it, nothing is pinned."""
import torch

from ._pin import pin_fp32

FP16_MAX = 65504.0


class AutoPinner:
    def __init__(self, handle, limit: int):
        self._handle = handle
        self._limit = limit
        self._waiting = []  # (path, module): confirmed this cycle, pinned when the next begins
        self._done = set()
        self._announce = []  # pinned, their events posted when the next cycle begins

    def confirmed(self, path, module, fp32_absmax=float("nan"), lost=None):
        """The replay of `module` was finite, up to `fp32_absmax` (or a precision check found
        `lost`, its relative error against FP32): pin it (or, beyond fp16's range in an fp16
        run, its parent) from the next cycle, within the limit."""
        child = None
        if self._handle._has_scaler and fp32_absmax > FP16_MAX and "." in path:
            child, path, module = path, *self._caller_of(path)
            if module is None:
                return  # nothing above it runs a forward of its own: pinned alone, the overflow moves on
        if path in self._done or any(p == path for p, _ in self._waiting):
            return
        if len(self._done) + len(self._waiting) >= self._limit:
            self._handle._event("autopin-limit", f"{path} was confirmed too, but autopin={self._limit} modules are "
                                "pinned already; pin it in code if the report names it", key=("autopin-limit",))
            return
        if child is not None:
            self._handle._event("autopin-parent", f"{path}: {child}, FP32 output up to {fp32_absmax:.6g}")
        elif lost is not None:
            self._handle._event("autopin-precision", f"{path}: {lost * 100:.0f} % away from FP32")
        self._waiting.append((path, module))

    def _caller_of(self, path):
        """(path, module) of the nearest module above `path` with a forward of its own: past a
        ModuleDict or ModuleList (PEFT's lora_B.default sits in the ModuleDict lora_B, which
        its LoRA Linear calls into); (None, None) where only the model is above it."""
        model = self._handle._watched_model
        while "." in path:
            path = path.rsplit(".", 1)[0]
            module = model.get_submodule(path)
            if type(module).forward is not torch.nn.Module.forward:
                return path, module
        return None, None

    def pin(self):
        """After a step ended: the modules confirmed in it run in FP32 from the next step."""
        for path, module in self._waiting:
            pin_fp32(module)
            self._handle._pinned.append(module)
            self._done.add(path)
            self._announce.append(path)
        self._waiting.clear()

    def announce(self):
        """At the start of the next cycle: the events, at the step the pins apply from."""
        for path in self._announce:
            self._handle._session.event("autopin", path)
        self._announce.clear()
