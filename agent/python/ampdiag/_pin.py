"""Pinning a module to FP32 under autocast: the fix ampdiag suggests for a module that
overflows in fp16."""
import functools

import torch

_PINNED = "_ampdiag_fp32_original_forward"


def _to_fp32(value):
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float32:
        return value.float()
    if isinstance(value, (list, tuple)):
        return type(value)(_to_fp32(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_fp32(v) for k, v in value.items()}
    return value


def pin_fp32(module: torch.nn.Module) -> torch.nn.Module:
    """Runs `module` with autocast disabled and its floating-point inputs cast to float32.

    Returns the module. Its parameters stay as they are (fp32 master weights usually).
    Idempotent; undo with unpin_fp32().
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"pin_fp32() takes a torch.nn.Module, not {type(module).__name__}")
    if hasattr(module, _PINNED):
        return module
    original = module.forward

    @functools.wraps(original)
    def forward(*args, **kwargs):
        with torch.autocast("cpu", enabled=False):
            if torch.cuda.is_available():
                with torch.autocast("cuda", enabled=False):
                    return original(*_to_fp32(args), **_to_fp32(kwargs))
            return original(*_to_fp32(args), **_to_fp32(kwargs))

    setattr(module, _PINNED, original)
    module.forward = forward
    return module


def is_pinned(module: torch.nn.Module) -> bool:
    """Whether pin_fp32() pinned `module`."""
    return hasattr(module, _PINNED)


def unpin_fp32(module: torch.nn.Module) -> torch.nn.Module:
    """Undoes pin_fp32()."""
    original = getattr(module, _PINNED, None)
    if original is not None:
        if getattr(original, "__func__", None) is type(module).forward and getattr(original, "__self__", None) is module:
            module.__dict__.pop("forward", None)  # the class's own forward shows through again
        else:
            module.forward = original  # an instance-level forward the module had before
        delattr(module, _PINNED)
    return module
