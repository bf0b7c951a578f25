"""The backward replay: evidence for a NaN/Inf that a module's backward makes while its
forward output stays finite.

At a loss scale of 1 or below the scaler no longer enlarges the gradients, so a module
whose backward still goes NaN/Inf there either makes NaN in any precision (the gradient of
sqrt or a norm at 0, a division by 0), or holds an fp16 value beyond 65504 inside it: an
intermediate that overflows and is squashed before the output (tanh of x**3 for a large
x is 1, and its gradient 0 * Inf is NaN), or a true gradient beyond fp16's range. Pinning
the module to FP32 helps the second kind only, and the statistics cannot tell them apart.

So the module's backward is run again, once per run: on its next call (the first of a
step) the agent keeps copies of its inputs, the RNG and autocast state, and the gradient
its (first floating-point) output receives; when that step ends, a copy of the module
(parameters shared as new leaves, without their gradient hooks) runs forward and backward
on them twice, as it ran and in FP32. NaN/Inf as run and none in FP32 is evidence for
pinning; NaN/Inf in FP32 too, from finite inputs and a finite output gradient, is evidence
against. Nothing the model holds changes; a module holding someone else's hook is not
replayed (foreign_hooks()). Event "backward-replay", "PATH: finite|intrinsic|unconfirmed[: why]".
"""
import torch

from ._pin import _to_fp32
from ._replay import FOREIGN_HOOKS, copy_inputs, foreign_hooks, rng_state, set_rng_state, twin_of
from ._tensors import first_float_tensor, float_tensors

FINITE, INTRINSIC, UNCONFIRMED = "finite", "intrinsic", "unconfirmed"
# Steps a suspect is captured for before the replay gives up: its backward has to go
# NaN/Inf again as run for the FP32 run to say anything.
ATTEMPTS = 3


class _Unconfirmed(Exception):
    pass


class _Capture:
    def __init__(self, args, kwargs):
        self.args, self.kwargs = copy_inputs(args, kwargs)
        self.rng = rng_state()
        device = next((t.device.type for t in float_tensors((args, kwargs))), "cpu")
        self.device = device if device in ("cpu", "cuda") else "cpu"
        self.autocast = torch.is_autocast_enabled(self.device), torch.get_autocast_dtype(self.device)
        self.hooked = False  # the output of this call has its gradient hook
        self.grad = None     # the gradient its first floating-point output received


def _nonfinite_gradients(module, capture, fp32):
    """(gradients holding NaN/Inf, gradients made) by a copy of the module's forward and
    backward on the captured inputs and output gradient: as it ran, or in FP32."""
    args, kwargs = copy_inputs(capture.args, capture.kwargs)
    if fp32:
        args, kwargs = _to_fp32(args), _to_fp32(kwargs)
    inputs = [t.requires_grad_() for t in float_tensors((args, kwargs)) if t.is_leaf]
    twin = twin_of(module, fp32=fp32, trainable=True)
    set_rng_state(capture.rng)  # the same dropout masks
    enabled, dtype = capture.autocast
    with torch.enable_grad(), torch.autocast(capture.device, dtype=dtype, enabled=enabled and not fp32):
        out = first_float_tensor(twin(*args, **kwargs))
    if out is None or not out.requires_grad:
        raise _Unconfirmed("its output holds no floating-point tensor with a gradient")
    leaves = [p for p in twin.parameters() if p.requires_grad] + inputs
    grads = torch.autograd.grad(out, leaves, grad_outputs=capture.grad.to(out.dtype), allow_unused=True)
    made = [g for g in grads if g is not None]
    return sum(1 for g in made if not bool(torch.isfinite(g).all())), len(made)


def replay_backward(module, capture) -> "tuple[str | None, str]":
    """(outcome, detail); outcome None where the replay as run stayed finite (try again)."""
    saved = rng_state()
    try:
        as_run, made = _nonfinite_gradients(module, capture, fp32=False)
        if not as_run:
            return None, "its backward stayed finite when replayed as it ran"
        in_fp32, _ = _nonfinite_gradients(module, capture, fp32=True)
        enabled, dtype = capture.autocast
        ran = f"{str(dtype).replace('torch.', '')} autocast" if enabled else "as it ran"
        said = f"{ran}: NaN/Inf in {as_run} of {made} gradients; FP32: {in_fp32}"
        if not in_fp32:
            return FINITE, said
        finite_in = all(bool(torch.isfinite(t).all())
                        for t in float_tensors((capture.args, capture.kwargs, capture.grad)))
        if not finite_in:
            raise _Unconfirmed("its inputs or output gradient held NaN/Inf")
        return INTRINSIC, said
    except _Unconfirmed as why:
        return UNCONFIRMED, str(why)
    except Exception as error:  # a replay must never break the training
        return UNCONFIRMED, f"the replay raised {type(error).__name__}: {error}"
    finally:
        set_rng_state(saved)


def backward_origin_module(handle) -> str:
    """The module the report names for the step's first NaN/Inf gradient in backward: the
    innermost holding it and the finite one before it, unless that holds every layer (the
    model, or DDP's "module" in it). "" for the model itself, where no gradient held
    NaN/Inf, and where the step's forward, batch, parameters or loss already did (the
    forward's, not the backward's)."""
    if handle._forward_nonfinite or handle._input_nan or handle._parameters_nonfinite or handle._output_gradient_seen:
        return ""
    return handle._session.origin_module()


class BackwardReplayer:
    """Replays the backward of at most one suspect at a time, each module once per run."""

    def __init__(self, handle, replayer):
        self._handle = handle
        self._replayer = replayer  # its `busy` makes the agent's hooks stand aside
        self._judged = set()       # paths replayed (or given up on)
        self._suspect = None       # (path, module, hook handles, attempts left)
        self._capture = None       # this step's _Capture of the suspect's first call

    def skipped_at_unit_scale(self):
        """A step skipped at a loss scale of 1 or below: the module where its backward went
        NaN/Inf is suspected."""
        path = backward_origin_module(self._handle)
        if path:
            self.suspect(path, self._handle._watched_model.get_submodule(path))

    def suspect(self, path, module):
        """Captures `module`'s next call, for a replay when that step ends."""
        if self._suspect is not None or path in self._judged:
            return
        handle = self._handle
        if foreign_hooks(module, backward=True):
            self._judged.add(path)
            handle._session.event("backward-replay", f"{path}: {UNCONFIRMED}: {FOREIGN_HOOKS}")
            return

        def before(mod, args, kwargs):
            if self._capture is None and not handle._standing_aside and torch.is_grad_enabled():
                try:
                    self._capture = _Capture(args, kwargs)
                except Exception as error:
                    self._finish(UNCONFIRMED, f"its inputs could not be copied ({type(error).__name__}: {error})")
            return None

        def after(mod, args, kwargs, output):
            capture = self._capture
            if capture is None or capture.hooked or handle._standing_aside:
                return None
            capture.hooked = True
            tensor = first_float_tensor(output)
            if tensor is None or not tensor.requires_grad:
                self._finish(UNCONFIRMED, "its output holds no floating-point tensor with a gradient")
                return None

            def keep(grad):
                if capture.grad is None:
                    capture.grad = grad.detach().clone()

            tensor.register_hook(keep)
            return None

        as_run = handle._forward_hook_as_run
        hooks = (module.register_forward_pre_hook(as_run(before), with_kwargs=True),
                 module.register_forward_hook(as_run(after), with_kwargs=True))
        self._suspect = (path, module, hooks, ATTEMPTS)

    def step_ended(self):
        """Replays the suspect where this step captured its call and output gradient."""
        capture, self._capture = self._capture, None
        if self._suspect is None or capture is None or capture.grad is None:
            return
        path, module, hooks, attempts = self._suspect
        handle = self._handle
        self._replayer.busy = True
        handle._live = False
        try:
            outcome, detail = replay_backward(module, capture)
        finally:
            self._replayer.busy = False
            handle._live = handle._in_cycle and not handle._inert
        if outcome is None and attempts > 1:
            self._suspect = (path, module, hooks, attempts - 1)
            return
        self._finish(outcome or UNCONFIRMED, detail if outcome else
                      f"its backward stayed finite when replayed as it ran, in {ATTEMPTS} steps")

    def _finish(self, outcome, detail):
        path, _, hooks, _ = self._suspect
        for hook in hooks:
            hook.remove()
        self._suspect = None
        self._capture = None
        self._judged.add(path)
        self._handle._session.event("backward-replay", f"{path}: {outcome}: {detail}")

    def close(self):
        if self._suspect is not None:
            self._finish(UNCONFIRMED, "the run ended before the module's backward could be replayed")

