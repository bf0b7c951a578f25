"""FSDP2 (fully_shard) makes every parameter and gradient a DTensor: a wrapper whose own
data pointer is null and whose numel() is the global size. The agent reads each rank's
local shard, and leaves the unscale of DTensor gradients to torch (it reduces found_inf
over the ranks). FSDP1 (FullyShardedDataParallel) in a world of one keeps every parameter
whole (NO_SHARD). One process, a world of one, on the CPU."""
import sqlite3

import pytest
import torch
from torch import nn

import ampdiag

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)
if torch.torch_version.TorchVersion(torch.__version__) < (2, 6):
    pytest.skip("torch 2.5's FSDP2 (fully_shard) runs on CUDA only: these tests run on the CPU",
                allow_module_level=True)
from torch.distributed.fsdp import fully_shard  # noqa: E402


@pytest.fixture()
def world_of_one(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def sharded_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    fully_shard(model)
    return model


def fp16_training(model, db=None, steps=4):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 20)
    g = torch.Generator().manual_seed(1)

    def loop():
        for _ in range(steps):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(4, 8, generator=g)).float().pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()

    if db is None:
        loop()
    else:
        with ampdiag.attach(model, scaler, db=db):
            loop()
    return [p.to_local().detach().clone() for p in model.parameters()]


def test_sharded_gradients_are_read_from_the_local_shard(tmp_path, world_of_one):
    model = sharded_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    db = tmp_path / "bf16.db"
    with ampdiag.attach(model, optimizer=opt, db=db):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.randn(4, 8)).float().mean()
        loss.backward()
        expected = model[0].weight.grad.to_local().abs().max().item()
        opt.step()
    with sqlite3.connect(db) as c:
        (absmax,) = c.execute("SELECT absmax FROM grad_stats WHERE step = 0 AND layer_id = 0").fetchone()
    assert absmax == pytest.approx(expected)


def test_fp16_training_with_sharded_parameters_is_bit_identical_with_the_agent(tmp_path, world_of_one):
    without = fp16_training(sharded_model())
    with_agent = fp16_training(sharded_model(), tmp_path / "fp16.db")
    assert all(torch.equal(a, b) for a, b in zip(without, with_agent))
    with sqlite3.connect(tmp_path / "fp16.db") as c:
        assert c.execute("SELECT COUNT(*) FROM steps").fetchone() == (4,)


def test_a_run_with_sharded_gradients_says_so_once(tmp_path, world_of_one):
    fp16_training(sharded_model(), tmp_path / "events.db")
    with sqlite3.connect(tmp_path / "events.db") as c:
        assert c.execute("SELECT COUNT(*) FROM events WHERE kind = 'sharded-parameters'").fetchone() == (1,)


def test_fsdp1_in_a_world_of_one_keeps_its_parameters_whole_and_is_not_called_sharded(tmp_path, world_of_one):
    from torch.distributed.fsdp import FullyShardedDataParallel  # torch makes it NO_SHARD in a world of one

    torch.manual_seed(0)
    model = FullyShardedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)),
                                     device_id=torch.device("cpu"), use_orig_params=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with ampdiag.attach(model, scaler, opt, db=tmp_path / "whole.db"):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(4, 8)).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    with sqlite3.connect(tmp_path / "whole.db") as c:
        assert c.execute("SELECT COUNT(*) FROM events WHERE kind = 'sharded-parameters'").fetchone() == (0,)
        assert c.execute("SELECT COUNT(*) FROM weight_norms").fetchone()[0] > 0
