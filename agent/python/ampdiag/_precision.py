"""Precision checks: what fp16/bf16 does to a module's output when nothing goes NaN/Inf.

A module can lose its output to half precision without a NaN: a hand-written RMSNorm
whose x.pow(2) overflows inside it computes rsqrt(Inf) = 0 and hands on zeros; a
difference of two large values cancels to rounding. No statistic of the output shows it,
and the loss scale stays steady. So, within a share of the training time
(`precision_budget`), the agent takes one watched module at a time, round robin, and on
its next call in a training step keeps a copy of the module (its state before the call),
copies of its inputs and the RNG state; right after the call the copy runs in FP32 on
them (autocast off, the same dropout masks) and the two outputs are compared. A row of
`precision_checks`: relative L2 error, values that came out exactly 0 where FP32's are
not, FP32's largest |x|. Nothing the model holds, computes or draws from the RNG changes.

On a device the comparison is made there and its five numbers are read back through pinned
memory when they have landed: the training thread never waits. Only calls that ran in
reduced precision are checked (autocast on for the inputs' device,
or half-precision parameters), and only outputs finite both ways: NaN/Inf has its own
replay. A module whose copy cannot be made or run leaves the rotation, and so does one
carrying a forward hook of the user's (the copy would run it too).
"""
import contextlib
import math
import time

import torch
from torch.overrides import TorchFunctionMode

from ._device_reads import DeviceReads
from ._pin import _to_fp32
from ._replay import copy_inputs, foreign_hooks, rng_state, set_rng_state, twin_of
from ._tensors import first_float_tensor, float_tensors

_HALF = (torch.float16, torch.bfloat16)
AUTOPIN_ERROR = 0.5  # attach(autopin=...) pins a module whose check found at least this much lost
# A module found running in FP32 sits out 1, 3, 7, ... up to this many of its turns before
# it is armed again: in a loop with AMP off, arming and looking cost a step ~2 % (MLP,
# 7 ms) and find nothing, while a loop that turns autocast on later is checked again soon.
FP32_WAIT_MAX = 63
# A host check this far from FP32 is taken only once the call is shown to be reproducible:
# the copy run again as the call ran (same precision, same draws) must give its output back
# within REPRODUCED. A forward that draws from a generator ampdiag cannot put back (one of
# its own, a hardware source) would otherwise be compared with different draws, and the
# difference called precision lost.
VERIFY_FROM = 0.02
REPRODUCED = 1e-3
UNREPRODUCIBLE = "precision-check-unreproducible"
# A host check of a call that drew random numbers is not taken where other draws move the
# FP32 output at least this share of its distance from FP32.
DRAWS_EXPLAIN = 0.5


class _Decisions(TorchFunctionMode):
    """The integer and boolean tensors a call makes (argmax and top-k indices, comparisons,
    the rows a mask selects), in order: where the FP32 run makes other ones than the call in
    its own precision, a decision inside it (a top-1 router's expert for a near-tied token)
    came out otherwise, and the two outputs differ by that decision, not by values lost."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and not (t.is_floating_point() or t.is_complex()):
                self.made.append(t.detach().clone())
        return out

    def same_as(self, other) -> bool:
        return len(self.made) == len(other.made) and all(
            a.shape == b.shape and torch.equal(a, b) for a, b in zip(self.made, other.made))


def _relative(a, b) -> float:
    """||a - b|| / ||b|| in float64 on the host (host checks only); inf where they do not
    compare (missing, shapes differ, not finite)."""
    if a is None or b is None or a.shape != b.shape:
        return math.inf
    b64 = b.detach().double()
    difference = float(torch.linalg.vector_norm(a.detach().double() - b64))
    norm = float(torch.linalg.vector_norm(b64))
    if not math.isfinite(difference):
        return math.inf
    return difference / norm if norm > 0 else (0.0 if difference == 0 else math.inf)


def drew_on_device(before, after) -> bool:
    """Whether a call moved a device generator (dropout, a random mask): between rng_state()s
    taken before and after it. A device's kernels map their draws to elements by the
    tensor's dtype (vector width), so the FP32 copy, put back to the same state, draws other
    masks than the float16/bfloat16 call did."""
    if before[1] is None or after[1] is None:
        return False
    return any(not torch.equal(a, b) for a, b in zip(before[1], after[1]))


def _reduced_precision(module, args, kwargs) -> bool:
    device = next((t.device.type for t in float_tensors((args, kwargs))), None)
    if device in ("cpu", "cuda") and torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) in _HALF:
        return True
    return any(p.dtype in _HALF for p in module.parameters())


def measures(ran, fp32):
    """(output as it ran, float64 tensor on its device: all finite, FP32's L2 norm, the
    difference's L2 norm, values zeroed, FP32's abs-max) of the two outputs' first
    floating-point tensors, computed without waiting for a device; None where they cannot be
    compared (no such tensor, shapes or devices differ)."""
    y, r = first_float_tensor(ran), first_float_tensor(fp32)
    if y is None or r is None or y.shape != r.shape or y.device != r.device or y.numel() == 0:
        return None
    y32, r32 = y.detach().float(), r.detach().float()
    finite = torch.isfinite(y32).all() & torch.isfinite(r32).all()
    # Norms accumulated in float64: a bf16 output's squares can pass float32's range.
    return y, torch.stack([finite.double(), torch.linalg.vector_norm(r32, dtype=torch.float64),
                           torch.linalg.vector_norm(y32 - r32, dtype=torch.float64),
                           ((y32 == 0) & (r32 != 0)).sum().double(), r32.abs().max().double()])


def judged(values):
    """(relative error, values zeroed, FP32 abs-max) from measures()' values read back;
    None where NaN/Inf was in either output (the replays' business) or FP32's is all zero."""
    finite, norm, diff, zeroed, absmax = values
    if not finite or not norm > 0.0 or not math.isfinite(diff / norm):
        return None
    return diff / norm, int(zeroed), absmax


class _Capture:
    def __init__(self, module, args, kwargs):
        self.rng = rng_state()
        self.twin = twin_of(module)  # before the call: the state it ran with
        self.args, self.kwargs = copy_inputs(args, kwargs)
        # For running the call again as it ran, where the FP32 copy comes out far from it: a
        # second copy in the call's own precision (host modules with float32 parameters,
        # where autocast alone made it reduced: the usual AMP case).
        self.as_ran = None
        params = list(module.parameters())
        if all(p.dtype == torch.float32 and p.device.type == "cpu" for p in params):
            self.as_ran = twin_of(module, fp32=False)


class PrecisionChecker:
    """Arms one module per step, within `budget` (a share of the time since the first step
    began), and records the comparison of its first call."""

    def __init__(self, handle, watched, budget):
        self._handle = handle
        self._modules = list(watched)  # (path, module), the rotation
        self._by_path = dict(self._modules)
        self._budget = budget
        self._next = 0
        self._started = None  # perf_counter_ns when the first step began
        self._spent = 0       # ns the checks took
        self._armed = None    # (path, module, hook handles)
        self._fp32_waits = {}  # path: [turns left to sit out, turns sat out last time]
        self._capture = None
        self._reads = DeviceReads(lambda values, what: self._post(*what, values))  # (step, path, dtype, numel)

    def step_began(self):
        """A cycle opened: arm the next module if the checks are within their budget."""
        self._post_landed()
        now = time.perf_counter_ns()
        if self._started is None:
            self._started = now
        if self._armed is not None or not self._modules or self._spent > self._budget * (now - self._started):
            return
        path, module = self._modules[self._next % len(self._modules)]
        self._next += 1
        wait = self._fp32_waits.get(path)
        if wait is not None and wait[0] > 0:  # it ran in FP32 at its last turn: nothing armed this step
            wait[0] -= 1
            return
        # Closures, not bound methods: a copy of the module carries its hooks, and
        # copy.deepcopy() copies a bound method's object (the agent) but not a function.
        def before(mod, args, kwargs):
            return self._before(mod, args, kwargs)

        def after(mod, args, kwargs, output):
            return self._after(mod, args, kwargs, output)

        as_run = self._handle._forward_hook_as_run
        hooks = (module.register_forward_pre_hook(as_run(before), with_kwargs=True),
                 module.register_forward_hook(as_run(after), with_kwargs=True))
        self._armed = (path, module, hooks)
        # Arming and disarming count against the budget too: in a loop of ~1 ms steps they
        # cost ~4 % of each step when a module was armed every step (most ran in FP32).
        self._spent += time.perf_counter_ns() - now

    def step_ended(self):
        """A module that did not run this step waits for its turn in the rotation again."""
        if self._armed is None and not self._reads.pending:  # most steps: nothing to undo or read
            return
        t0 = time.perf_counter_ns()
        self._disarm()
        self._post_landed()
        self._spent += time.perf_counter_ns() - t0

    def close(self):
        self._disarm()
        self._post_landed(wait=True)

    def _post_when_read(self, path, output, values):
        """Posts the check now for a host output; a device output's values are posted once
        their copy to pinned memory has landed (at a later step's start or end, with the
        step they belong to): the training thread never waits."""
        dtype, numel = str(output.dtype).replace("torch.", ""), output.numel()
        self._reads.send(values, (self._handle._session.step, path, dtype, numel))

    def _post_landed(self, wait=False):
        if self._reads.pending:
            self._reads.poll(wait)

    def _post(self, step, path, dtype, numel, values):
        verdict = judged(values)
        if verdict is None:
            return
        handle = self._handle
        handle._session.precision_check(path, dtype, numel, *verdict, step=step)
        error, _, fp32_absmax = verdict
        if error >= AUTOPIN_ERROR and handle._autopin is not None:
            handle._autopin.confirmed(path, self._by_path[path], fp32_absmax, lost=error)

    def _reproducible(self, path, capture, output, values, fp32, drew) -> bool:
        """Whether the check can be taken: a device one, a host one close to FP32, or one whose
        call the copy gives back run as it ran and whose draws (where it drew from torch's
        generator: `drew`) do not explain the difference. One that is not leaves the rotation
        (event precision-check-unreproducible)."""
        if values.is_cuda or capture.as_ran is None:
            return True
        verdict = judged(values.tolist())
        if verdict is None or verdict[0] < VERIFY_FROM:
            return True
        set_rng_state(capture.rng)
        with torch.no_grad(), _Decisions() as as_ran:  # under the call's own autocast: the hook runs inside it
            again = first_float_tensor(capture.as_ran(*capture.args, **capture.kwargs))
        if _relative(again, output) > REPRODUCED:
            self._leave_rotation(path, "run again as it ran (same precision, inputs, state and draws of torch's, "
                                 "Python's and numpy's generators), it gave another output; it is not compared "
                                 "with FP32 (a generator of its own, or another source of chance)")
            return False
        set_rng_state(capture.rng)
        with _Decisions() as in_fp32:
            self._fp32_call(capture)
        if not as_ran.same_as(in_fp32):
            self._leave_rotation(path, f"a decision inside its call (an argmax or top-k index, a comparison) came out "
                                 f"otherwise in FP32, and its output with it ({100 * verdict[0]:.0f} % away): a "
                                 "near-tie that either precision may break, as a top-1 router's for one token; it is "
                                 "not compared with FP32")
            return False
        if drew:
            # Same generator state, but a kernel may map its draws to elements by dtype (the
            # CPU's bernoulli for a bfloat16 probability tensor): other draws in FP32 show how
            # far the draws alone move the output.
            set_rng_state(capture.rng)
            torch.rand(1)
            other = first_float_tensor(self._fp32_call(capture))
            moved = _relative(other, fp32)
            if moved >= DRAWS_EXPLAIN * verdict[0]:
                self._leave_rotation(path, f"its call draws random numbers, and other draws move its FP32 output "
                                     f"{100 * moved:.0f} % as against {100 * verdict[0]:.0f} % from FP32: draws that "
                                     "the reduced precision maps to elements differently would explain it; it is "
                                     "not compared with FP32")
                return False
        return True

    @staticmethod
    def _fp32_call(capture):
        with torch.no_grad(), torch.autocast("cpu", enabled=False), \
                (torch.autocast("cuda", enabled=False) if torch.cuda.is_available() else contextlib.nullcontext()):
            return capture.twin(*_to_fp32(capture.args), **_to_fp32(capture.kwargs))

    def _leave_rotation(self, path, why):
        self._handle._event(UNREPRODUCIBLE, f"{path}: {why}", key=(UNREPRODUCIBLE, path))
        self._modules = [(p, m) for p, m in self._modules if p != path]

    def _ran_in_fp32(self, path):
        last = self._fp32_waits.get(path, [0, 0])[1]
        turns = min(2 * last + 1, FP32_WAIT_MAX)
        self._fp32_waits[path] = [turns, turns]

    def _disarm(self):
        if self._armed is not None:
            for hook in self._armed[2]:
                hook.remove()
        self._armed, self._capture = None, None

    def _drop(self, module):
        self._modules = [(p, m) for p, m in self._modules if m is not module]
        self._disarm()

    def _before(self, module, args, kwargs):
        armed, handle = self._armed, self._handle
        # (A copy of the module carries these hooks: only the watched module's call counts.)
        if armed is None or module is not armed[1] or self._capture is not None or not handle._live:
            return None
        t0 = time.perf_counter_ns()
        try:
            if foreign_hooks(module):
                self._drop(module)
            elif _reduced_precision(module, args, kwargs):
                self._fp32_waits.pop(armed[0], None)
                self._capture = _Capture(module, args, kwargs)
            else:
                self._ran_in_fp32(armed[0])
                self._disarm()  # nothing to compare this step
        except Exception:  # a check must never break the training
            self._drop(module)
        self._spent += time.perf_counter_ns() - t0
        handle._python_ns += time.perf_counter_ns() - t0
        return None

    def _after(self, module, args, kwargs, output):
        armed, capture, handle = self._armed, self._capture, self._handle
        if armed is None or module is not armed[1] or capture is None or not handle._live:
            return None
        t0 = time.perf_counter_ns()
        path = armed[0]
        self._disarm()
        saved = rng_state()
        handle._replayer.busy = True  # the agent's hooks stand aside for the copy's forward
        handle._live = False
        try:
            if drew_on_device(capture.rng, saved):
                self._leave_rotation(path, "its call drew random numbers on the device (dropout, a random mask), "
                                     "whose kernels map them to elements differently in float32 than in "
                                     "float16/bfloat16; it is not compared with FP32")
                return None
            set_rng_state(capture.rng)
            fp32 = self._fp32_call(capture)
            measured = measures(output, fp32)
            drew = not torch.equal(capture.rng[0], saved[0])
            if measured is not None and self._reproducible(path, capture, *measured, first_float_tensor(fp32), drew):
                self._post_when_read(path, *measured)
        except Exception:  # a check must never break the training
            self._drop(module)
        finally:
            set_rng_state(saved)
            handle._replayer.busy = False
            handle._live = handle._in_cycle and not handle._inert
        self._spent += time.perf_counter_ns() - t0
        handle._python_ns += time.perf_counter_ns() - t0
        return None
