"""attach()'s arguments: checked before anything is attached, and their defaults."""
import os

import torch

from ._forward import compiled_fullgraph, watched_root


def check_options(db, every, context_steps, queue_capacity, threads, amp_dtype, run_id, autopin, replay,
                  activations, activation_every, precision_budget) -> str:
    """Raises ValueError naming the first bad option; returns db as a str path."""
    if isinstance(db, os.PathLike):
        db = os.fspath(db)
    if not isinstance(db, str) or not db:
        raise ValueError(f"db must be a file path such as 'run.db', not {db!r}")
    for name, value, low in (("every", every, 1), ("context_steps", context_steps, 0),
                             ("queue_capacity", queue_capacity, 16), ("threads", threads, 0),
                             ("activation_every", activation_every, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, not {value!r}")
    if amp_dtype not in (None, "float16", "bfloat16"):
        raise ValueError(f"amp_dtype must be 'float16' or 'bfloat16', not {amp_dtype!r}")
    if run_id is not None and (not isinstance(run_id, str) or not run_id):
        raise ValueError(f"run_id must be a non-empty string, not {run_id!r}")
    if not isinstance(autopin, int) or autopin < 0:
        raise ValueError(f"autopin must be False or the most modules to pin (an integer >= 0), not {autopin!r}")
    if (not isinstance(precision_budget, (int, float)) or isinstance(precision_budget, bool)
            or not 0.0 <= precision_budget <= 1.0):
        raise ValueError(f"precision_budget must be a share of the training time from 0 to 1 (0.005: half a "
                         f"per cent), not {precision_budget!r}")
    if autopin and not (replay and activations):
        raise ValueError("autopin needs activations=True and replay=True: it pins only what an FP32 replay confirmed")
    return db


def torch_optimizer(optimizer):
    """The torch optimizer whose step hooks ampdiag sets: the innermost one a training
    framework's wrapper holds as `.optimizer` and steps, or `optimizer` itself. Hooks set on
    a wrapper go wrong: Accelerate's AcceleratedOptimizer subclasses torch's Optimizer
    without running its __init__ (no step hooks at all), and Lightning's LightningOptimizer
    poses as its optimizer's class and reaches the optimizer's own hooks through it, so the
    optimizer stepping would look like a second one. Opacus's DPOptimizer, alike in the
    first, holds it as `.original_optimizer` and steps it once the clipped, noised
    per-sample gradients are in .grad."""
    given = optimizer
    for _ in range(4):
        inner = getattr(optimizer, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            inner = getattr(optimizer, "original_optimizer", None)  # Opacus's DPOptimizer
        if not isinstance(inner, torch.optim.Optimizer) or inner is optimizer:
            break
        optimizer = inner
    if isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "_optimizer_step_pre_hooks"):
        return optimizer
    raise TypeError(f"optimizer must be a torch.optim.Optimizer, or a wrapper holding one as .optimizer, not "
                    f"{type(given).__name__}: pass the torch optimizer that steps the model's parameters")


# Where training frameworks keep the torch GradScaler they drive: timm's NativeScaler
# (._scaler), Accelerate's Accelerator and Lightning's precision plugin (.scaler), reached
# from a Lightning Trainer through its strategy's precision plugin.
_SCALER_HOLDERS = ("scaler", "_scaler", "grad_scaler", "accelerator", "precision_plugin", "strategy")
_MISSING = object()


def torch_scaler(scaler):
    """The torch.amp.GradScaler that `scaler` is or holds; None where it holds one set to None
    (a framework configured for bf16 or without AMP)."""
    if scaler is None or isinstance(scaler, torch.amp.GradScaler):
        return scaler
    given, frontier, seen, held_none = scaler, [scaler], {id(scaler)}, False
    for _ in range(3):
        deeper = []
        for holder in frontier:
            for name in _SCALER_HOLDERS:
                try:
                    inner = getattr(holder, name, _MISSING)
                except Exception:  # a property that raises while the framework is not set up
                    continue
                if inner is _MISSING:
                    continue
                if isinstance(inner, torch.amp.GradScaler):
                    return inner
                if inner is None:
                    held_none = held_none or name in ("scaler", "_scaler", "grad_scaler")
                elif id(inner) not in seen and not isinstance(inner, (str, bytes, int, float, bool)):
                    seen.add(id(inner))
                    deeper.append(inner)
        frontier = deeper
    kind = type(given).__name__
    if held_none:
        # A Lightning Trainer holds its optimizers once fit() has set them up (on_train_start).
        optimizers = getattr(given, "optimizers", None)
        which = "optimizer=" + ("trainer.optimizers[0]" if isinstance(optimizers, list) and optimizers else "")
        raise ValueError(f"scaler: this {kind} holds no GradScaler (its scaler is None: bf16, or AMP off); for a run "
                         f"without a scaler pass {which} instead")
    raise TypeError(f"scaler must be a torch.amp.GradScaler, or a wrapper holding one (timm's NativeScaler, "
                    f"Accelerate's Accelerator), not {kind}")


def trains_fp16_parameters(params) -> bool:
    """The model itself is fp16 (model.half()): its precision is its parameters', whatever autocast says."""
    return any(p.dtype == torch.float16 for p in params if p.requires_grad)


def default_amp_dtype(scaler, params) -> str:
    # Without a scaler the run is bf16 autocast, unless the model itself is fp16.
    return "float16" if scaler is not None or trains_fp16_parameters(params) else "bfloat16"


def check_watched(model, scaler, optimizer, activations, attached):
    """attach()'s model, scaler and optimizer, checked before anything is attached: raises
    naming the first problem; returns (the module hooks go on, the scaler, a disabled
    scaler or None, the optimizer, the model's parameters). `attached`: the attribute that
    holds a live handle's weakref on a model or scaler."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"attach() takes a torch.nn.Module, not {type(model).__name__}")
    scaler = torch_scaler(scaler)
    # torch's AMP recipe turns AMP off with GradScaler(enabled=use_amp): the scaler then
    # passes everything through (scale() returns the loss, step() calls the optimizer's),
    # and the run is recorded as one without a scaler, its optimizers found in step().
    disabled = scaler if scaler is not None and not scaler.is_enabled() else None
    if disabled is not None:
        scaler = None
    if scaler is None and optimizer is None and disabled is None:
        raise ValueError("pass scaler= (fp16 with a torch.amp.GradScaler) or optimizer= (bf16 without a "
                         "scaler) so ampdiag knows where each step's gradients are final")
    if isinstance(optimizer, (list, tuple)):
        # Two optimizers (a GAN's, a sparse embedding's beside a dense one's) given together.
        raise TypeError(f"optimizer takes one torch optimizer, not a {type(optimizer).__name__} of {len(optimizer)}: "
                        + ("leave optimizer= out: with a GradScaler every optimizer that scaler.step() receives is "
                           "watched" if scaler is not None or disabled is not None else
                           "pass the one whose step() ends each training step (bf16 without a scaler)"))
    if optimizer is not None:
        optimizer = torch_optimizer(optimizer)
    root = watched_root(model)
    for owner, what in ((root, "model"), (scaler if scaler is not None else disabled, "scaler")):
        if owner is not None and getattr(owner, attached, None) is not None and getattr(owner, attached)():
            # One scaler stepping several models (torch's AMP example with two models)
            # is one run: its steps, scale and skips are shared.
            also = (": to watch several models that one scaler steps, attach one torch.nn.ModuleDict holding "
                    "them all, ampdiag.attach(torch.nn.ModuleDict({'a': model_a, 'b': model_b}), scaler)"
                    if what == "scaler" else "")
            raise RuntimeError(f"this {what} already has an ampdiag handle attached: close() it first{also}")
    params = list(model.parameters())
    if not params:
        raise ValueError("the model has no parameters: nothing to watch")
    for p in params:
        if p.device.type not in ("cpu", "cuda"):
            raise ValueError(f"a parameter is on the {p.device.type!r} device: this ampdiag build reads "
                             "CPU and CUDA tensors only")
    if activations and root is not model and compiled_fullgraph(model):
        raise ValueError("the model was compiled with torch.compile(fullgraph=True), which refuses the graph "
                         "break ampdiag's forward hooks make at each module: attach(..., activations=False) "
                         "watches gradients and the loss scale only, or compile without fullgraph=True")
    return root, scaler, disabled, optimizer, params
