"""attach(model, scaler) takes a training framework's object that holds the torch GradScaler
it drives, as users have it in hand: timm's NativeScaler (._scaler), Accelerate's
Accelerator (.scaler), a Lightning Trainer (.strategy.precision_plugin.scaler). One holding
None (bf16, AMP off) or nothing is refused with what to pass."""
import sqlite3
import types

import pytest
import torch
from torch import nn

import ampdiag


class NativeScalerLike:
    """timm.utils.NativeScaler's shape: loss_scaler(loss, optimizer) scales, backwards,
    steps and updates through its own GradScaler."""

    def __init__(self):
        self._scaler = torch.amp.GradScaler("cpu")

    def __call__(self, loss, optimizer):
        self._scaler.scale(loss).backward()
        self._scaler.step(optimizer)
        self._scaler.update()


def steps_recorded(db):
    with sqlite3.connect(db) as c:
        return c.execute("SELECT COUNT(*), MIN(scale_before) FROM steps").fetchone()


def test_a_native_scaler_is_watched_through_the_grad_scaler_it_holds(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt, loss_scaler = torch.optim.SGD(model.parameters(), lr=1e-3), NativeScalerLike()
    with ampdiag.attach(model, loss_scaler, db=tmp_path / "run.db"):
        for _ in range(3):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(4, 8)).float().pow(2).mean()
            loss_scaler(loss, opt)
    assert steps_recorded(tmp_path / "run.db") == (3, 65536.0)


def test_a_lightning_trainers_scaler_is_found_through_its_precision_plugin(tmp_path):
    scaler = torch.amp.GradScaler("cpu")
    trainer = types.SimpleNamespace(strategy=types.SimpleNamespace(precision_plugin=types.SimpleNamespace(scaler=scaler)))
    handle = ampdiag.attach(nn.Linear(4, 1), trainer, db=tmp_path / "run.db")
    assert handle._held_scaler is scaler
    handle.close()


def test_a_holder_whose_scaler_is_none_is_refused_with_what_to_pass(tmp_path):
    accelerator = types.SimpleNamespace(scaler=None)  # Accelerator(mixed_precision="bf16")
    with pytest.raises(ValueError, match="holds no GradScaler .* pass optimizer= instead"):
        ampdiag.attach(nn.Linear(4, 1), accelerator, db=tmp_path / "run.db")


def test_an_object_holding_no_scaler_is_refused_by_its_type(tmp_path):
    with pytest.raises(TypeError, match="a wrapper holding one .* not SimpleNamespace"):
        ampdiag.attach(nn.Linear(4, 1), types.SimpleNamespace(optimizer=None), db=tmp_path / "run.db")


def test_a_trainer_whose_scaler_is_none_is_refused_with_its_optimizer_to_pass(tmp_path):
    # Lightning runs precision="16-mixed" on the CPU as bf16: no scaler, and the optimizer
    # is at hand in the trainer from on_train_start.
    optimizer = torch.optim.SGD(nn.Linear(4, 1).parameters(), lr=0.1)
    trainer = types.SimpleNamespace(strategy=types.SimpleNamespace(precision_plugin=types.SimpleNamespace(scaler=None)),
                                    optimizers=[optimizer])
    with pytest.raises(ValueError, match=r"pass optimizer=trainer\.optimizers\[0\] instead"):
        ampdiag.attach(nn.Linear(4, 1), trainer, db=tmp_path / "run.db")
