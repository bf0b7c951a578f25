"""Ranks: torch.multiprocessing.spawn with attach() before init_process_group, and what
`ampdiag report` accepts as the ranks of one run."""
import contextlib
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import ampdiag
from conftest import rows


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _leave():
    """Ends a worker whose run.db is closed and whose process group is destroyed, without the
    interpreter's teardown of torch's distributed state. Rank 0 of one of these runs once
    aborted in CI ("terminate called without an active exception", not reproduced in 100
    runs here). The run.db is complete by then, and skipping the teardown keeps torch's
    shutdown out of what these tests judge; tests/python covers exiting with a handle open."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _worker(rank, world, db, port):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    handle = ampdiag.attach(model, scaler, db=db)  # before the process group exists
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ddp = nn.parallel.DistributedDataParallel(model)
    for _ in range(3):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = ddp(torch.randn(4, 8)).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    handle.close()
    dist.destroy_process_group()
    _leave()


def spawn_run(tmp_path, name="spawn.db"):
    db = str(tmp_path / name)
    mp.spawn(_worker, args=(2, db, _free_port()), nprocs=2, join=True)
    return [tmp_path / name.replace(".db", f".rank{r}.db") for r in (0, 1)]


def test_spawned_workers_attached_before_init_process_group_write_one_db_each(tmp_path, verdict):
    dbs = spawn_run(tmp_path)
    assert all(db.exists() for db in dbs)
    assert [rows(db, "SELECT value FROM meta WHERE key = 'rank'") for db in dbs] == [[("0",)], [("1",)]]
    ids = {rows(db, "SELECT value FROM meta WHERE key = 'run_id'")[0][0] for db in dbs}
    assert len(ids) == 1  # both ranks carry the same run id
    code, rep = verdict(*dbs)
    assert (code, rep["healthy"]) == (0, True), rep["findings"]


def test_the_same_file_twice_is_refused_in_one_line(tmp_path, ampdiag):
    dbs = spawn_run(tmp_path)
    result = ampdiag("report", dbs[0], dbs[0])
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "given twice" in result.stderr


def test_ranks_of_two_different_runs_are_refused(tmp_path, ampdiag):
    first = spawn_run(tmp_path, "a.db")
    second = spawn_run(tmp_path, "b.db")
    result = ampdiag("report", first[0], second[1])
    assert result.returncode == 2
    assert "not from the same run" in result.stderr and result.stderr.count("\n") == 1


def test_a_missing_rank_is_reported(tmp_path, verdict):
    dbs = spawn_run(tmp_path)
    code, rep = verdict(dbs[0])
    assert code == 0  # a warning: the gate is errors
    missing = [f for f in rep["findings"] if f["rule"] == "missing-ranks"]
    assert len(missing) == 1 and "missing rank(s): 1" in missing[0]["evidence"]


def _accumulating_worker(rank, world, db, port, zero_each_micro_batch):
    """DistributedDataParallel with its gradients as bucket views, four micro-batches a step,
    the first three under no_sync()."""
    torch.manual_seed(0)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ddp = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)),
                                              gradient_as_bucket_view=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    with ampdiag.attach(ddp, scaler, db=db):
        for i in range(24):
            if zero_each_micro_batch or i % 4 == 0:
                opt.zero_grad()
            x, y = torch.randn(8, 8), torch.randn(8, 1)
            with ddp.no_sync() if (i + 1) % 4 else contextlib.nullcontext():
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = nn.functional.mse_loss(ddp(x).float(), y) / 4
                scaler.scale(loss).backward()
            if (i + 1) % 4 == 0:
                scaler.step(opt)
                scaler.update()
    dist.destroy_process_group()
    _leave()


def accumulating_run(tmp_path, zero_each_micro_batch):
    db = str(tmp_path / "ddp.db")
    mp.spawn(_accumulating_worker, args=(2, db, _free_port(), zero_each_micro_batch), nprocs=2, join=True)
    return [tmp_path / f"ddp.rank{r}.db" for r in (0, 1)]


def test_zero_grad_inside_ddp_accumulation_with_bucket_views_is_named_on_every_rank(tmp_path, verdict):
    # The reducer rebinds .grad to its bucket at the end of the synchronising backward.
    code, rep = verdict(*accumulating_run(tmp_path, zero_each_micro_batch=True))
    assert code == 1
    cleared = [f for f in rep["findings"] if f["rule"] == "accumulated-gradients-cleared"]
    assert [(f["severity"], sorted(f["ranks"])) for f in cleared] == [("error", [0, 1])]


def test_ddp_accumulation_under_no_sync_zeroed_once_per_step_is_healthy(tmp_path, verdict):
    code, rep = verdict(*accumulating_run(tmp_path, zero_each_micro_batch=False))
    assert code == 0, rep["findings"]
