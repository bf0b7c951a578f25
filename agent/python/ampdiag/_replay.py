"""The FP32 replay: evidence that pinning a module to FP32 fixes a NaN/Inf in forward.

When a module's output holds NaN/Inf, it is run once more with autocast off, on a copy of
the module (parameters shared, buffers and other state copied) and on copies of its
inputs, with the RNG state restored afterwards. Nothing the model computes, returns or
holds changes: the copy's caches, running statistics and any object a forward appends to
are the copy's own.

The inputs a forward hook sees are the inputs *after* the forward ran. For tensors and
plain values that is what the module was called with, unless it changed them in place.
For anything else (a cache object, an input the module wrote into) the replay waits for
the module's next call: a pre-hook copies the inputs before that forward runs, and the
replay uses the copy. A replay that cannot run, or raises, is "unconfirmed" with the
reason, and is never taken as evidence either way.

A module holding a hook of someone else's is not replayed (foreign_hooks()).
"""
import contextlib
import copy
import math
import random
import sys
import types

import torch

from ._pin import _PINNED, _to_fp32
from ._tensors import first_float_tensor, float_tensors

FINITE, NONFINITE, UNCONFIRMED = "finite", "nonfinite", "unconfirmed"
INTRINSIC = "intrinsic"  # NaN/Inf in FP32 from finite inputs: the module makes it in any precision
PENDING = "pending"  # waiting for the module's next call


def _plain(value) -> bool:
    if value is None or isinstance(value, (torch.Tensor, bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False


def _tensors_in(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors_in(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors_in(v)


def _changed_in_place(args, kwargs, output) -> bool:
    """Whether an input shares memory with the output: the module wrote into it."""
    out = {t.untyped_storage().data_ptr() for t in _tensors_in(output) if t.untyped_storage().nbytes()}
    return any(t.untyped_storage().data_ptr() in out for t in _tensors_in((args, kwargs)) if t.untyped_storage().nbytes())


@contextlib.contextmanager
def _tensors_copy_detached():
    """copy.deepcopy() of plain tensors as detached clones: activations are not graph
    leaves, which Tensor.__deepcopy__ refuses. Dispatch is by exact type, so Parameters
    (seeded in the memo) are untouched."""
    dispatch = copy._deepcopy_dispatch
    previous = dispatch.get(torch.Tensor)
    dispatch[torch.Tensor] = lambda t, memo: t.detach().clone()
    try:
        yield
    finally:
        if previous is None:
            dispatch.pop(torch.Tensor, None)
        else:
            dispatch[torch.Tensor] = previous


def copy_inputs(args, kwargs):
    with _tensors_copy_detached():
        return copy.deepcopy((args, kwargs))


def twin_of(module: torch.nn.Module, fp32=True, trainable=False) -> torch.nn.Module:
    """A copy of the module sharing its fp32 parameters (no memory), with its own buffers
    and state; where `fp32`, fp16/bf16 parameters and buffers become fp32 copies. Where
    `trainable`, its parameters are leaves of their own (the same memory, without the
    originals' hooks) that require gradients as the originals do."""
    memo = {}
    for p in module.parameters():
        if fp32 and p.is_floating_point() and p.dtype != torch.float32:
            memo[id(p)] = torch.nn.Parameter(p.detach().float(), requires_grad=trainable and p.requires_grad)
        elif trainable:
            memo[id(p)] = torch.nn.Parameter(p.detach(), requires_grad=p.requires_grad)
        else:
            memo[id(p)] = p
    with _tensors_copy_detached():
        twin = copy.deepcopy(module, memo)
    for m in twin.modules():
        for name, b in m._buffers.items():
            if fp32 and b is not None and b.is_floating_point() and b.dtype != torch.float32:
                m._buffers[name] = b.float()
        forward = m.__dict__.get("forward")
        if forward is None:
            continue
        if _PINNED in m.__dict__:  # ampdiag's own pin: the copy runs in FP32 anyway
            del m.__dict__["forward"], m.__dict__[_PINNED]
        elif isinstance(forward, types.MethodType):
            m.__dict__["forward"] = types.MethodType(forward.__func__, m)
        else:
            raise RuntimeError(f"{type(m).__name__}.forward is replaced on the instance by {forward!r}; a copy "
                               "of it could call the original module, so ampdiag does not run one")
    return twin


def rng_state():
    """torch's generators, and the global ones of Python and numpy that a model's forward may
    draw from too (HF's Wav2Vec2 masks its time steps with numpy's): a copy run with the same
    draws computes what the call did."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    numpy = sys.modules.get("numpy")
    return torch.get_rng_state(), cuda, random.getstate(), numpy.random.get_state() if numpy is not None else None


def set_rng_state(state):
    cpu, cuda, python, numpy_state = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    random.setstate(python)
    if numpy_state is not None:
        sys.modules["numpy"].random.set_state(numpy_state)


FOREIGN_HOOKS = ("it, or a module inside it, has a hook that is neither torch's nor ampdiag's: a copy would run "
                 "that hook too, which would see a call the model never made")


def foreign_hooks(module: torch.nn.Module, backward: bool = False) -> bool:
    """Whether a forward hook (with `backward`, a backward hook too) on the module, inside
    it or on every module is neither torch's (weight_norm, pruning, FSDP: part of what it
    computes) nor ampdiag's. A copy of the module carries its hooks, and a user's hook
    would see a call the model never made: a feature extractor's dict would hold the
    copy's FP32 output in place of the one the loss was to read, a counter would count
    it. Without the hook the copy might compute otherwise, so such a module is not run."""
    def foreign(hook):
        origin = getattr(hook, "__module__", None) or type(hook).__module__ or ""
        return not origin.startswith(("torch.", "ampdiag."))

    kinds = ("forward_hooks", "forward_pre_hooks") + (("backward_hooks", "backward_pre_hooks") if backward else ())
    everywhere = torch.nn.modules.module
    hooks = [h for kind in kinds for h in getattr(everywhere, f"_global_{kind}", {}).values()]
    for m in module.modules():
        for kind in kinds:
            hooks.extend(getattr(m, f"_{kind}", {}).values())
    return any(foreign(h) for h in hooks)


def run_fp32(module, args, kwargs):
    """(outcome, fp32 abs-max or NaN, reason) of one replay on copies of everything."""
    rng = rng_state()
    try:
        twin = twin_of(module)
        args, kwargs = copy_inputs(args, kwargs)
        inputs_finite = all(bool(torch.isfinite(t).all()) for t in float_tensors((args, kwargs)))
        with torch.no_grad(), torch.autocast("cpu", enabled=False), \
                (torch.autocast("cuda", enabled=False) if torch.cuda.is_available() else contextlib.nullcontext()):
            out = first_float_tensor(twin(*_to_fp32(args), **_to_fp32(kwargs)))
        if out is None:
            return UNCONFIRMED, math.nan, "its FP32 output holds no floating-point tensor"
        if not bool(torch.isfinite(out).all()):
            return (INTRINSIC if inputs_finite else NONFINITE), math.nan, ""
        return FINITE, float(out.abs().max()) if out.numel() else 0.0, ""
    except Exception as error:  # a replay must never break the training
        return UNCONFIRMED, math.nan, f"the replay raised {type(error).__name__}: {error}"
    finally:
        set_rng_state(rng)


class Replayer:
    """Replays each module at most once per run and remembers the verdict."""

    def __init__(self, record, as_run=lambda hook: hook):
        self._record = record  # record(path, outcome, absmax, reason)
        self._as_run = as_run  # a forward hook as the model runs it (outside a compiled graph)
        self._verdicts = {}
        self._absmax = {}      # path -> the largest |x| of its FP32 replay's output
        self._armed = {}       # path -> (module, pre-hook handle)
        self._snapshots = {}   # path -> (args, kwargs) copied before the current call
        self.busy = False      # a replay is running: the agent's hooks stand aside

    def fp32_absmax(self, path) -> float:
        """The largest |x| of the module's FP32 replay output (NaN where none ran)."""
        return self._absmax.get(path, math.nan)

    def known(self, path) -> "str | None":
        """The module's verdict where it has one, without replaying."""
        return self._verdicts.get(path)

    def verdict(self, path, module, args, kwargs, output) -> str:
        """The module's verdict (FINITE, NONFINITE, INTRINSIC, UNCONFIRMED), replaying it now
        if it has none; PENDING while the replay waits for the module's next call."""
        known = self._verdicts.get(path)
        if known is not None:
            return known
        if foreign_hooks(module):
            self._verdicts[path] = UNCONFIRMED
            self._record(path, UNCONFIRMED, math.nan, FOREIGN_HOOKS)
            return UNCONFIRMED
        snapshot = self._snapshots.pop(path, None)
        if snapshot is None:
            if not _plain((args, kwargs)) or _changed_in_place(args, kwargs, output):
                self._arm(path, module)
                return PENDING
            snapshot = (args, kwargs)
        self._disarm(path)
        self.busy = True
        try:
            outcome, absmax, reason = run_fp32(module, *snapshot)
        finally:
            self.busy = False
        self._verdicts[path] = outcome
        self._absmax[path] = absmax
        self._record(path, outcome, absmax, reason)
        return outcome

    def _arm(self, path, module):
        if path in self._armed:
            return

        def copy_before_forward(mod, args, kwargs):
            if not self.busy:
                try:
                    self._snapshots[path] = copy_inputs(args, kwargs)
                except Exception as error:
                    self._disarm(path)
                    self._verdicts[path] = UNCONFIRMED
                    self._record(path, UNCONFIRMED, math.nan,
                                 f"its inputs could not be copied ({type(error).__name__}: {error})")
            return None

        self._armed[path] = (module, module.register_forward_pre_hook(self._as_run(copy_before_forward),
                                                                      with_kwargs=True))

    def _disarm(self, path):
        armed = self._armed.pop(path, None)
        if armed is not None:
            armed[1].remove()

    def close(self):
        """Says why the replays still waiting never ran."""
        for path in list(self._armed):
            self._disarm(path)
            self._verdicts[path] = UNCONFIRMED
            self._record(path, UNCONFIRMED, math.nan,
                         "its inputs hold state (or it changes them in place), so the replay waited for its next call "
                         "to copy them first, and its output did not hold NaN/Inf again before the run ended")
        self._snapshots.clear()
