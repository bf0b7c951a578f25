"""Device profiling ranges (attach(profile=True)): what each module launches in forward and
backward, and what the optimizer and torch's unscale launch, is tied to them through
CUPTI's external correlation ids, which the session pushes on the launching thread. The
session decides whether a step is profiled; when profiling is unavailable (no CUPTI, no
device) every hook here returns at once."""
import torch

from . import _ampdiag
from ._forward import compiling
from ._tensors import foreign_copy

_KIND_OF_DTYPE = {torch.float16: _ampdiag.KIND_FLOAT16, torch.bfloat16: _ampdiag.KIND_BFLOAT16,
                  torch.float32: _ampdiag.KIND_FLOAT32}


def _kind_hint(args) -> int:
    """What the module computes in, for kernels whose names do not say: autocast's dtype
    where autocast is on for the inputs' device, else the first floating input's dtype."""
    first = next((a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
    if first is None:
        return _ampdiag.KIND_OTHER
    device = first.device.type
    if torch.is_autocast_enabled(device):
        return _KIND_OF_DTYPE.get(torch.get_autocast_dtype(device), _ampdiag.KIND_OTHER)
    return _KIND_OF_DTYPE.get(first.dtype, _ampdiag.KIND_OTHER)


class ProfileRanges:
    """Forward pre-hooks and hooks that open and close a module's forward range, and
    autograd-node hooks on its output that do the same for its backward (they run on
    autograd's thread, where the backward kernels launch)."""

    def __init__(self, handle, modules):
        self._handle = handle
        self._optimizers = set()
        # Ranges a module's pre-hook opened, by id(module): a module may run inside itself,
        # and a replay's deep copy of it is another module.
        self._open = {}
        for path, module in modules:
            as_run = handle._forward_hook_as_run
            handle._hooks.append(module.register_forward_pre_hook(as_run(self._pre_hook(path, module))))
            handle._hooks.append(module.register_forward_hook(as_run(self._post_hook())))

    @property
    def _session(self):
        return self._handle._session

    def _active(self) -> bool:
        return self._session.opened and self._session.profiling and not self._handle._standing_aside

    def _pre_hook(self, path, owner):
        module_id = None

        def hook(module, args):
            nonlocal module_id
            if compiling():  # see _forward.py
                self._handle._traced_by_compile = True
                return None
            if (module is not owner and foreign_copy(module)
                    or not self._active() or not self._handle._begin_forward_cycle()):
                return None
            if module_id is None:
                module_id = self._handle._module_id(path, module, args)
            hint = _kind_hint(args)
            opened = self._session.begin_range(module_id, _ampdiag.PHASE_FORWARD, hint)
            self._open.setdefault(id(module), []).append((opened, module_id, hint))
            return None

        return hook

    def _post_hook(self):
        def hook(module, args, output):
            if compiling():
                return None
            stack = self._open.get(id(module))
            if not stack:
                return None
            opened, module_id, hint = stack.pop()
            if not opened:
                return None
            self._session.end_range()
            tensor = output if isinstance(output, torch.Tensor) else None
            if tensor is not None and tensor.grad_fn is not None:
                self._backward_range(tensor.grad_fn, module_id, hint)
            return None

        return hook

    def _backward_range(self, node, module_id, hint):
        session = self._session  # this step's: the hooks run before the next one
        opened = []

        def before(grad_outputs):
            opened.append(session.begin_range(module_id, _ampdiag.PHASE_BACKWARD, hint))

        def after(grad_inputs, grad_outputs):
            if opened and opened.pop():
                session.end_range()

        node.register_prehook(before)
        node.register_hook(after)

    def watch_optimizer(self, optimizer):
        """The optimizer's step() as its own phase (registered once per optimizer)."""
        if id(optimizer) in self._optimizers:
            return
        self._optimizers.add(id(optimizer))
        opened = []

        def before(opt, args, kwargs):
            if self._active():
                opened.append(self._session.begin_range(-1, _ampdiag.PHASE_OPTIMIZER, _ampdiag.KIND_OTHER))

        def after(opt, args, kwargs):
            if opened and opened.pop():
                self._session.end_range()

        self._handle._hooks.append(optimizer.register_step_pre_hook(before))
        self._handle._hooks.append(optimizer.register_step_post_hook(after))

    def unscale(self, original, *args):
        """torch's own unscale, in its phase (ampdiag's fused unscale is counted as its own)."""
        opened = self._active() and self._session.begin_range(-1, _ampdiag.PHASE_UNSCALE, _ampdiag.KIND_OTHER)
        try:
            return original(*args)
        finally:
            if opened:
                self._session.end_range()
