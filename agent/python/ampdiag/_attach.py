"""attach(): ampdiag's agent in a PyTorch training loop.

It wraps a real torch.amp.GradScaler *instance* (its unscale, scale and update), so the
fused statistics pass runs between backward and the unscale, registers a forward hook on
every module (activation statistics, forward order, the first module whose output is
non-finite) and a gradient hook on every trainable parameter (arrival order in backward),
and streams everything to a run.db through the C++ engine. It changes no number of the
training: with fused unscale on, the gradients are unscaled with the same bits as
torch._amp_foreach_non_finite_check_and_unscale_ writes.
"""
import functools
import inspect
import math
import os
import sys
import time
import weakref

import torch

from . import _ampdiag
from ._pin import _to_fp32, pin_fp32, unpin_fp32

_DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_ATTACHED = "_ampdiag_handle"


def _rank_and_world() -> tuple:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()

    def env(name: str, default: int) -> int:
        value = os.environ.get(name, "")
        if not value:
            return default
        if not value.isdigit():
            raise ValueError(f"environment variable {name}={value!r} is not a non-negative integer "
                             "(torchrun sets it; unset it for a single process)")
        return int(value)

    rank, world = env("RANK", 0), env("WORLD_SIZE", 1)
    if world < 1 or rank >= world:
        raise ValueError(f"RANK={rank} must be below WORLD_SIZE={world}")
    return rank, world


def _source(module: torch.nn.Module) -> str:
    try:
        forward = type(module).forward
        return f"{inspect.getsourcefile(forward)}:{inspect.getsourcelines(forward)[1]}"
    except (TypeError, OSError):
        return ""


def _first_float_tensor(value):
    if isinstance(value, torch.Tensor):
        return value if value.is_floating_point() else None
    if isinstance(value, (list, tuple)):
        for v in value:
            found = _first_float_tensor(v)
            if found is not None:
                return found
    if isinstance(value, dict):
        for v in value.values():
            found = _first_float_tensor(v)
            if found is not None:
                return found
    return None


def _dense(t: torch.Tensor) -> bool:
    """Whether t's elements fill one gap-free block of memory, in any order (contiguous,
    or a permutation of a contiguous tensor, such as a transpose)."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, n) for st, n in zip(t.stride(), t.shape) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _directly_readable(t: torch.Tensor) -> bool:
    """Every statistic is independent of element order, so a dense block is read in place."""
    return t.device.type == "cpu" and t.layout == torch.strided and t.dtype in _DTYPE_CODE and _dense(t)


def _readable_view(t: torch.Tensor) -> torch.Tensor:
    """t itself when the engine can read it in place (data_ptr() is then the block's first
    element: all strides are positive), else a contiguous CPU copy."""
    if _directly_readable(t):
        return t
    copy = t.detach().to("cpu")
    if copy.dtype not in _DTYPE_CODE:
        copy = copy.float()
    return copy.contiguous()


class AttachHandle:
    """What attach() returns. Also a context manager: leaving it closes the handle."""

    def __init__(self, model, scaler, optimizer, db, every, activations, pins, fused_unscale, context_steps,
                 histogram, overwrite, replay, queue_capacity, threads, amp_dtype):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"attach() takes a torch.nn.Module, not {type(model).__name__}")
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(f"scaler must be a torch.amp.GradScaler, not {type(scaler).__name__}")
        if scaler is not None and not scaler.is_enabled():
            raise ValueError("the GradScaler is disabled (enabled=False, or CUDA is not available for a 'cuda' "
                             "scaler), so there is no loss scale to watch: enable it, or for bf16 without a scaler "
                             "attach(model, optimizer=optimizer)")
        if scaler is None and optimizer is None:
            raise ValueError("pass scaler= (fp16 with a torch.amp.GradScaler) or optimizer= (bf16 without a "
                             "scaler) so ampdiag knows where each step's gradients are final")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, not {type(optimizer).__name__}")
        for owner, what in ((model, "model"), (scaler, "scaler")):
            if owner is not None and getattr(owner, _ATTACHED, None) is not None and getattr(owner, _ATTACHED)():
                raise RuntimeError(f"this {what} already has an ampdiag handle attached: close() it first")
        params = list(model.parameters())
        if not params:
            raise ValueError("the model has no parameters: nothing to watch")
        for p in params:
            if p.device.type not in ("cpu", "cuda"):
                raise ValueError(f"a parameter is on the {p.device.type!r} device: this ampdiag build reads "
                                 "CPU and CUDA tensors only")
        if isinstance(db, os.PathLike):
            db = os.fspath(db)
        if not isinstance(db, str) or not db:
            raise ValueError(f"db must be a file path such as 'run.db', not {db!r}")
        for name, value, low in (("every", every, 1), ("context_steps", context_steps, 0),
                                 ("queue_capacity", queue_capacity, 16), ("threads", threads, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, not {value!r}")

        self.model, self.scaler, self.optimizer = model, scaler, optimizer
        rank, world = _rank_and_world()
        self.db_path = _ampdiag.rank_db_path(db, rank, world)
        # Creating the file is where a bad path fails: before anything is attached.
        self._session = _ampdiag.Session(self.db_path, overwrite, queue_capacity, every, context_steps, threads,
                                         histogram)
        self._finalizer = weakref.finalize(self, self._session.close)
        self._fused = fused_unscale
        self._replay = replay
        self._closed = False
        self._hooks = []
        self._restore = []
        self._pinned = []
        self._last_step_skipped = False
        self._events_posted = set()
        try:
            self._write_meta(scaler, rank, world, every, context_steps, fused_unscale, histogram, amp_dtype, params)
            self._register_layers(model)
            self._modules = {}  # path -> module id
            self._in_replay = False
            self._replayed = set()
            self._reset_step()
            self._step_started = time.perf_counter_ns()
            if activations:
                for path, module in model.named_modules():
                    if path:
                        self._hooks.append(module.register_forward_hook(self._forward_hook(path), with_kwargs=True))
            for path in pins:
                try:
                    module = model.get_submodule(path)
                except AttributeError:
                    raise ValueError(f"pins: the model has no module {path!r}") from None
                pin_fp32(module)
                self._pinned.append(module)
            if scaler is not None:
                self._wrap_scaler(scaler)
            else:
                self._hooks.append(optimizer.register_step_pre_hook(self._before_optimizer_step))
                self._hooks.append(optimizer.register_step_post_hook(self._after_optimizer_step))
            setattr(model, _ATTACHED, weakref.ref(self))
            if scaler is not None:
                setattr(scaler, _ATTACHED, weakref.ref(self))
        except BaseException:
            self.close()
            raise

    # --- public --------------------------------------------------------------------

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last scaler.step() skipped the optimizer (torch itself does not say)."""
        return self._last_step_skipped

    @property
    def status(self) -> dict:
        """Steps seen, rows written, records dropped, write errors, and the db path."""
        return dict(self._session.status(), db_path=self.db_path)

    def close(self) -> None:
        """Detaches every hook and wrapper and finishes the run.db. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for obj, name in self._restore:
            obj.__dict__.pop(name, None)  # the class's method shows through again
        self._restore.clear()
        for module in self._pinned:
            unpin_fp32(module)
        for owner in (self.model, self.scaler):
            if owner is not None and owner.__dict__.get(_ATTACHED) is not None and owner.__dict__[_ATTACHED]() is self:
                del owner.__dict__[_ATTACHED]
        self._finalizer()

    detach = close

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    # --- setup ---------------------------------------------------------------------

    def _write_meta(self, scaler, rank, world, every, context_steps, fused, histogram, amp_dtype, params):
        meta = {
            "ampdiag_version": "0.1.0",
            "torch_version": torch.__version__,
            "source": "ampdiag Python agent",
            "device": str(params[0].device),
            "amp_dtype": amp_dtype or ("float16" if scaler is not None else "bfloat16"),
            "rank": str(rank),
            "world_size": str(world),
            "command_line": " ".join([sys.executable] + sys.argv),
            "pid": str(os.getpid()),
            "every": str(every),
            "context_steps": str(context_steps),
            "fused_unscale": "1" if fused else "0",
            "histogram": "1" if histogram else "0",
            "stats_isa": _ampdiag.cpu_isa(),
            "scaler_enabled": "1" if scaler is not None else "0",
        }
        if scaler is not None:
            meta.update(scaler_init_scale=repr(float(scaler.get_scale())),
                        scaler_growth_factor=repr(float(scaler.get_growth_factor())),
                        scaler_backoff_factor=repr(float(scaler.get_backoff_factor())),
                        scaler_growth_interval=str(scaler.get_growth_interval()))
        for key, value in meta.items():
            self._session.set_meta(key, value)

    def _register_layers(self, model):
        modules = dict(model.named_modules())
        self._layer_of = {}  # id(param) -> layer id
        self._params = []
        frozen = 0
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in self._layer_of:
                first = self._layer_of[id(p)]
                self._event("shared-parameter",
                            f"{name} is the same tensor as layer {first}; its statistics are recorded once")
                continue
            layer = len(self._params)
            self._layer_of[id(p)] = layer
            self._params.append(p)
            module_path = name.rpartition(".")[0]
            module = modules.get(module_path)
            frozen += not p.requires_grad
            self._session.add_layer(layer, name, module_path, type(module).__name__ if module is not None else "",
                                    str(p.dtype).replace("torch.", ""), str(list(p.shape)), p.numel(),
                                    p.requires_grad, _source(module) if module is not None else "")
            if p.requires_grad:
                self._hooks.append(p.register_hook(functools.partial(self._arrived, layer)))
        if frozen:
            self._event("frozen-parameters", f"{frozen} parameters do not require grad: listed, no statistics")

    def _wrap_scaler(self, scaler):
        original_unscale = scaler._unscale_grads_
        original_scale = scaler.scale
        original_update = scaler.update

        def _unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16):
            return self._on_unscale(original_unscale, optimizer, inv_scale, found_inf, allow_fp16)

        def scale(outputs):
            self._on_scale(outputs)
            return original_scale(outputs)

        def update(new_scale=None):
            found = self._found_inf(scaler)
            before = float(scaler.get_scale())
            original_update(new_scale)
            self._end_step(before, float(scaler.get_scale()), found, skipped=found)

        for name, fn in (("_unscale_grads_", _unscale_grads_), ("scale", scale), ("update", update)):
            setattr(scaler, name, functools.wraps(getattr(type(scaler), name))(fn))
            self._restore.append((scaler, name))

    def _event(self, kind, detail, key=None):
        key = key or (kind, detail)
        if key not in self._events_posted:
            self._events_posted.add(key)
            self._session.add_event(kind, detail)

    # --- per step --------------------------------------------------------------------

    def _reset_step(self):
        self._arrival = [-1] * len(self._params)
        self._next_arrival = 0
        self._loss = None
        self._python_ns = 0
        self._first_nonfinite = None
        self._escalate = None

    def _arrived(self, layer, grad):
        if self._arrival[layer] < 0:
            self._arrival[layer] = self._next_arrival
            self._next_arrival += 1

    def _on_scale(self, outputs):
        t0 = time.perf_counter_ns()
        self._arrival = [-1] * len(self._params)
        self._next_arrival = 0
        if isinstance(outputs, torch.Tensor) and outputs.numel() == 1:
            self._loss = outputs.detach()
        self._python_ns += time.perf_counter_ns() - t0

    def _layer_id(self, param):
        layer = self._layer_of.get(id(param))
        if layer is None:  # optimized, but not a parameter of the attached model
            layer = len(self._params)
            self._layer_of[id(param)] = layer
            self._params.append(param)
            self._arrival.append(-1)
            self._session.add_layer(layer, f"optimizer.param{layer}", "", "", str(param.dtype).replace("torch.", ""),
                                    str(list(param.shape)), param.numel(), True, "")
            self._event("foreign-parameter", f"optimizer.param{layer} is optimized but not part of the model")
        return layer

    def _gradients(self, optimizer):
        """(layer ids, gradients to read, whether any was sparse) of the optimizer's
        parameters that have a gradient. A sparse gradient is read through its values."""
        layers, grads, sparse = [], [], False
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                layer = self._layer_id(p)
                if grad.is_sparse:
                    sparse = True
                    self._event("sparse-gradient", f"layer {layer} has sparse gradients: statistics cover their "
                                                   "stored values", key=("sparse", layer))
                    grad = grad._values()
                layers.append(layer)
                grads.append(grad)
        return layers, grads, sparse

    def _stats(self, layers, grads, inv_scale=None):
        views = [_readable_view(g) for g in grads]
        for layer, g, v in zip(layers, grads, views):
            if v is not g:
                self._event("slow-path", f"layer {layer} has a {g.dtype} {g.device} gradient: its statistics are "
                                         "taken on a CPU copy", key=("copy", layer))
        found = self._session.grads(layers, [self._arrival[i] for i in layers], [v.data_ptr() for v in views],
                                    [v.numel() for v in views], [_DTYPE_CODE[v.dtype] for v in views], inv_scale)
        return found

    def _on_unscale(self, original, optimizer, inv_scale, found_inf, allow_fp16):
        t0 = time.perf_counter_ns()
        layers, grads, sparse = self._gradients(optimizer)
        special = sparse or any(g.dtype == torch.float16 for g in grads)
        fusable = (self._fused and grads and not special and all(_directly_readable(g) for g in grads)
                   and inv_scale.device.type == "cpu" and found_inf.device.type == "cpu")
        if fusable:
            with torch.no_grad():
                if self._stats(layers, grads, float(inv_scale.item())):
                    found_inf.fill_(1.0)
            self._python_ns += time.perf_counter_ns() - t0
            return {found_inf.device: found_inf}
        if grads:
            self._stats(layers, grads)
        self._python_ns += time.perf_counter_ns() - t0
        # torch's own unscale (it also raises for FP16 gradients, as it should).
        return original(optimizer, inv_scale, found_inf, allow_fp16)

    @staticmethod
    def _found_inf(scaler) -> bool:
        return any(bool(v.item()) for state in scaler._per_optimizer_states.values()
                   for v in state.get("found_inf_per_device", {}).values())

    def _before_optimizer_step(self, optimizer, args, kwargs):
        t0 = time.perf_counter_ns()
        layers, grads, _ = self._gradients(optimizer)
        self._bf16_found = bool(self._stats(layers, grads)) if grads else False
        self._python_ns += time.perf_counter_ns() - t0

    def _after_optimizer_step(self, optimizer, args, kwargs):
        self._end_step(1.0, 1.0, self._bf16_found, skipped=False)

    def _end_step(self, scale_before, scale_after, found_inf, skipped):
        loss = math.nan
        if self._loss is not None:
            loss = float(self._loss.float().item())
        now = time.perf_counter_ns()
        self._session.end_step(loss, scale_before, scale_after, found_inf, skipped, now - self._step_started,
                               self._python_ns)
        self._last_step_skipped = skipped
        self._step_started = now
        self._reset_step()

    # --- forward -------------------------------------------------------------------

    def _module_id(self, path, module):
        module_id = self._modules.get(path)
        if module_id is None:
            module_id = len(self._modules)
            self._modules[path] = module_id
            self._session.add_module(module_id, path, type(module).__name__, _source(module))
        return module_id

    def _forward_hook(self, path):
        module_id = None  # resolved on the first call, when the module first runs

        def hook(module, args, kwargs, output):
            nonlocal module_id
            if self._in_replay or self._closed:
                return None
            t0 = time.perf_counter_ns()
            tensor = output if type(output) is torch.Tensor else _first_float_tensor(output)
            if tensor is not None and tensor.is_floating_point():
                if module_id is None:
                    module_id = self._module_id(path, module)
                view = tensor if _directly_readable(tensor) else _readable_view(tensor)
                if self._session.activation(module_id, view.data_ptr(), view.numel(), _DTYPE_CODE[view.dtype]):
                    self._on_nonfinite_output(path, module, args, kwargs)
            self._python_ns += time.perf_counter_ns() - t0
            return None

        return hook

    def _on_nonfinite_output(self, path, module, args, kwargs):
        # Hooks fire as modules finish: a child before its parent. When the first module
        # with a non-finite output is not fixed by FP32 (it only received NaN/Inf), its
        # enclosing modules are replayed as they finish, until one is.
        if self._first_nonfinite is None:
            self._first_nonfinite = path
            self._escalate = None
            if self._replay and path not in self._replayed and not self._replay_fp32(path, module, args, kwargs):
                self._escalate = path
        elif self._escalate and self._escalate.startswith(path + ".") and path not in self._replayed:
            self._escalate = None if self._replay_fp32(path, module, args, kwargs) else path

    def _replay_fp32(self, path, module, args, kwargs) -> bool:
        """Runs the first module with a non-finite output again, once, in FP32 on the same
        inputs, and records whether that output is finite: evidence that pinning it helps.
        Eval mode and a restored RNG keep the training's numbers untouched."""
        self._replayed.add(path)
        self._in_replay = True
        was_training = module.training
        cpu_rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        try:
            module.eval()
            device = "cuda" if _first_float_tensor(args) is not None and _first_float_tensor(args).is_cuda else "cpu"
            with torch.no_grad(), torch.autocast(device, enabled=False):
                out = _first_float_tensor(module(*_to_fp32(args), **_to_fp32(kwargs)))
            finite = out is not None and bool(torch.isfinite(out).all())
            absmax = float(out.abs().max()) if finite and out.numel() else math.nan
            self._session.add_event("replay", f"module={path} fp32_finite={int(finite)} fp32_absmax={absmax:.6g}")
            return finite
        except Exception as error:  # a replay must never break the training
            self._session.add_event("replay", f"module={path} error={type(error).__name__}: {error}")
            return False
        finally:
            module.train(was_training)
            torch.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)
            self._in_replay = False


def attach(model: torch.nn.Module, scaler: "torch.amp.GradScaler | None" = None,
           optimizer: "torch.optim.Optimizer | None" = None, db="run.db", every: int = 1, activations: bool = True,
           pins=(), fused_unscale: bool = True, context_steps: int = 2, histogram: bool = False,
           overwrite: bool = False, replay: bool = True, queue_capacity: int = 1 << 15, threads: int = 0,
           amp_dtype: "str | None" = None) -> AttachHandle:
    """Attaches ampdiag to a training loop and returns a handle (also a context manager).

    model:          the torch.nn.Module being trained (a DDP wrapper is fine).
    scaler:         the torch.amp.GradScaler ("cpu" or "cuda") of an fp16 run.
    optimizer:      for bf16 runs without a scaler: statistics are taken before its step().
    db:             the run.db to write; under torchrun each rank writes NAME.rank{N}.db.
    every:          record per-layer statistics every N steps (overflows, scale changes and
                    `context_steps` steps around them are always recorded).
    activations:    forward hooks on every module: output statistics, forward order, the first
                    module whose output is NaN/Inf.
    pins:           module paths to run in FP32 while attached (see pin_fp32()).
    fused_unscale:  do the scaler's unscale inside ampdiag's pass (same bits as torch's).
    replay:         re-run the first module with a non-finite output once in FP32 and record
                    whether that fixes it.
    overwrite:      replace an existing db file instead of refusing.
    """
    return AttachHandle(model, scaler, optimizer, db, every, activations, tuple(pins), fused_unscale, context_steps,
                        histogram, overwrite, replay, queue_capacity, threads, amp_dtype)
