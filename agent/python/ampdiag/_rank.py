"""Which rank this process is (the run id every rank shares is derived by the session
core when the run.db is opened: agent/core/run_paths.h).

Under torchrun, RANK and WORLD_SIZE are set before the script starts. Under
torch.multiprocessing.spawn they are not, and attach() may run before
init_process_group(): then the rank is not known yet, and the run.db is created when the
first training step starts, by which time the process group usually exists.
"""
import multiprocessing
import os
import sys

import torch


def _env(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    if not value:
        return default
    if not value.isdigit():
        raise ValueError(f"environment variable {name}={value!r} is not a non-negative integer "
                         "(torchrun sets it; unset it for a single process)")
    return int(value)


def known_rank():
    """(rank, world_size), or None while it cannot be known yet (a spawned worker whose
    process group is not initialised)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    if "RANK" in os.environ or "WORLD_SIZE" in os.environ:
        rank, world = _env("RANK", 0), _env("WORLD_SIZE", 1)
        if world < 1 or rank >= world:
            raise ValueError(f"RANK={rank} must be below WORLD_SIZE={world}")
        return rank, world
    if torch.distributed.is_available() and multiprocessing.parent_process() is not None:
        return None
    return 0, 1


def rank_now_or_single():
    """The rank once training started: a worker that still has no process group trains alone."""
    return known_rank() or (0, 1)


def fsdp1_sharding(root: torch.nn.Module) -> "str | None":
    """How FSDP1 (FullyShardedDataParallel) shards the model, where it wraps the model or a
    module in it and splits the parameters across ranks: each rank then holds and reads only
    its own shard of each, as plain tensors (FSDP2's DTensors say so themselves), so no two
    ranks' statistics of a layer are of the same values. None otherwise (NO_SHARD keeps
    every parameter whole on every rank, as DDP does)."""
    fsdp = sys.modules.get("torch.distributed.fsdp.fully_sharded_data_parallel")  # loaded by whoever wrapped it
    wrapper = getattr(fsdp, "FullyShardedDataParallel", None)
    if wrapper is None:
        return None
    units = [m for m in root.modules() if isinstance(m, wrapper)]
    sharded = [m for m in units if getattr(getattr(m, "sharding_strategy", None), "name", "") != "NO_SHARD"]
    if not sharded:
        return None
    flat = not all(getattr(m, "_use_orig_params", True) for m in sharded)
    return ("the model is wrapped in FullyShardedDataParallel (FSDP1): each rank's statistics cover its own shards"
            + ("; use_orig_params=False flattens each wrapped unit's parameters into one, which is one layer here"
               if flat else ""))
