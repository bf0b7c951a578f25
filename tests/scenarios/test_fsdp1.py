"""FSDP1 (FullyShardedDataParallel) on two CPU ranks with its ShardedGradScaler: each rank
holds a shard of the parameters as plain tensors (a one-element bias on one rank only) and
the scaler reduces found_inf across the ranks, so a skip is every rank's. A shard's NaN/Inf
on one rank is no disagreement between the ranks. Layers and modules are named as in the
model FSDP1 wraps, without its `_fsdp_wrapped_module`."""
import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import ampdiag
from conftest import rows

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, db, port, orig_params):
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    # 6337 values in two shards: rank 1 holds the last Linear whole, rank 0 none of it.
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))
    sharded = FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=orig_params)
    opt = torch.optim.SGD(sharded.parameters(), lr=1e-3)
    scaler = ShardedGradScaler("cpu")
    g = torch.Generator().manual_seed(rank)
    with ampdiag.attach(sharded, scaler, opt, db=db):
        for _ in range(8):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = sharded(torch.randn(16, 32, generator=g))
            # Targets 4 below the outputs: the last bias's fp16 gradient sums 16 of 0.5 times
            # the scale, beyond 65504 until the scale has come down (calibration skips).
            loss = nn.functional.mse_loss(out.float(), torch.full((16, 1), -4.0))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as tests/scenarios/test_ranks.py: torch's distributed teardown is not judged here


def fsdp1_run(tmp_path, orig_params=True):
    db = str(tmp_path / "fsdp.db")
    mp.spawn(_worker, args=(2, db, _free_port(), orig_params), nprocs=2, join=True)
    return [tmp_path / f"fsdp.rank{r}.db" for r in (0, 1)]


@pytest.fixture(scope="module")
def orig_params_run(tmp_path_factory):
    return fsdp1_run(tmp_path_factory.mktemp("fsdp1"))


def test_fsdp1_calibration_skips_on_one_ranks_shard_are_healthy(orig_params_run, verdict):
    skips = [rows(db, "SELECT COUNT(*) FROM steps WHERE skipped = 1")[0][0] for db in orig_params_run]
    assert skips[0] > 0 and skips[0] == skips[1]  # the ranks skip together
    code, report = verdict(*orig_params_run)
    assert (code, report["healthy"]) == (0, True), report["findings"]
    assert not [f for f in report["findings"] if f["rule"] == "rank-disagreement"]


def test_each_fsdp1_rank_says_its_parameters_are_sharded_and_reads_no_weights(orig_params_run):
    for db in orig_params_run:
        events = rows(db, "SELECT detail FROM events WHERE kind = 'sharded-parameters'")
        assert len(events) == 1 and "FullyShardedDataParallel (FSDP1)" in events[0][0]
        assert rows(db, "SELECT COUNT(*) FROM weight_norms") == [(0,)]


def test_a_rank_whose_own_gradients_were_finite_names_the_rank_whose_were_not(orig_params_run, ampdiag):
    text = ampdiag("report", *orig_params_run).stdout
    assert ("rank 0 step 0 (scale 65536): every gradient recorded on this rank was finite; rank 1's held NaN/Inf "
            "(4.") in text


def test_fsdp1_layers_and_modules_are_named_as_in_the_unwrapped_model(orig_params_run):
    for db in orig_params_run:
        names = {name for (name,) in rows(db, "SELECT name FROM layers")}
        assert names <= {"0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"} and names, names
        assert {path for (path,) in rows(db, "SELECT path FROM modules")} == {"0", "2", "4"}


def test_fsdp1_flat_parameters_are_named_as_one_layer_per_unit(tmp_path):
    dbs = fsdp1_run(tmp_path, orig_params=False)
    assert rows(dbs[0], "SELECT name FROM layers") == [("_flat_param",)]
    (detail,), = rows(dbs[0], "SELECT detail FROM events WHERE kind = 'sharded-parameters'")
    assert "use_orig_params=False" in detail
