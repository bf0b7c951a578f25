"""Module and parameter names as the user's model has them. FullyShardedDataParallel (FSDP1)
and torch's checkpoint_wrapper hold the module they wrap as `_fsdp_wrapped_module` and
`_checkpoint_wrapped_module`: their state_dict() leaves those parts out, and both forward
attribute lookups to the wrapped module, so that `model.layers[0].attn` and
get_submodule("layers.0.attn") reach it through them. A run names `layers.0.attn`, as the
checkpoint does, not `_fsdp_wrapped_module.layers.0._fsdp_wrapped_module.attn`."""
import torch

_WRAPPED = frozenset(("_fsdp_wrapped_module", "_checkpoint_wrapped_module"))


def clean(name: str) -> str:
    """`name` without the wrappers' parts."""
    if "_wrapped_module" not in name:  # every name of a model without such wrappers: one check
        return name
    return ".".join(part for part in name.split(".") if part not in _WRAPPED)


def named_modules(root: torch.nn.Module) -> list:
    """root.named_modules() under clean names. A wrapper and the module it wraps share one:
    the wrapped module takes it (its own type and forward; the wrapper's forward only calls
    it), in the wrapper's place."""
    found = {}
    for name, module in root.named_modules():
        found[clean(name)] = module  # the wrapped module comes after its wrapper
    return list(found.items())


def named_parameters(model: torch.nn.Module, **kwargs) -> list:
    """model.named_parameters(**kwargs) under clean names."""
    return [(clean(name), p) for name, p in model.named_parameters(**kwargs)]
