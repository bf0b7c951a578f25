"""Training frameworks hand the user their own optimizer object: Accelerate's (a torch
Optimizer subclass that never ran torch's __init__, so it has no step hooks) and
Lightning's (no Optimizer at all), each holding the torch optimizer as `.optimizer` and
stepping it. attach(optimizer=...) watches the one they hold."""
import sqlite3

import pytest
import torch

import ampdiag
from conftest import Tiny


class SubclassWrapper(torch.optim.Optimizer):  # as accelerate.optimizer.AcceleratedOptimizer
    def __init__(self, optimizer):
        self.optimizer = optimizer

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none)

    def step(self, closure=None):
        self.optimizer.step(closure)


class PlainWrapper:  # as lightning.pytorch.core.optimizer.LightningOptimizer
    def __init__(self, optimizer):
        self._optimizer = optimizer

    @property
    def optimizer(self):
        return self._optimizer

    def zero_grad(self):
        self._optimizer.zero_grad()

    def step(self):
        self._optimizer.step()


class PosingWrapper:  # as LightningOptimizer: poses as its optimizer's class, forwards the rest
    def __init__(self, optimizer):
        self._optimizer = optimizer
        self.__class__ = type("Posing" + type(optimizer).__name__, (PosingWrapper, type(optimizer)), {})

    def __getattr__(self, name):
        return getattr(self._optimizer, name)

    @property
    def optimizer(self):
        return self._optimizer

    def step(self, closure=None):
        return self._optimizer.step(closure)


def bf16_steps(db, wrap, steps=3):
    torch.manual_seed(0)
    model = Tiny()
    optimizer = wrap(torch.optim.AdamW(model.parameters(), lr=1e-3))
    with ampdiag.attach(model, optimizer=optimizer, db=db):
        for _ in range(steps):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(torch.randn(8, 16)).float().pow(2).mean()
            loss.backward()
            optimizer.step()
    with sqlite3.connect(db) as c:
        return c.execute("SELECT COUNT(*) FROM steps").fetchone()[0]


def test_an_optimizer_subclass_wrapping_another_is_watched_through_the_one_it_wraps(tmp_path):
    assert bf16_steps(tmp_path / "subclass.db", SubclassWrapper) == 3


def test_a_wrapper_that_is_no_optimizer_but_holds_one_is_watched_through_it(tmp_path):
    assert bf16_steps(tmp_path / "plain.db", PlainWrapper) == 3


def test_a_wrapper_posing_as_its_optimizers_class_records_each_step_once(tmp_path):
    assert bf16_steps(tmp_path / "posing.db", PosingWrapper) == 3


def test_an_object_holding_no_optimizer_is_refused_by_its_type(tmp_path):
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer, or a wrapper holding one as "
                                        r"\.optimizer, not str"):
        ampdiag.attach(Tiny(), optimizer="adamw", db=tmp_path / "run.db")


def test_a_list_of_optimizers_with_a_scaler_is_told_to_leave_the_argument_out(tmp_path):
    model = Tiny()
    both = [torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.Adam(model.parameters())]
    with pytest.raises(TypeError, match="optimizer takes one torch optimizer, not a list of 2: leave optimizer= out: "
                                        "with a GradScaler every optimizer that scaler.step"):
        ampdiag.attach(model, torch.amp.GradScaler("cpu"), both, db=tmp_path / "run.db")


def test_a_list_of_optimizers_without_a_scaler_is_told_to_pass_the_one_that_ends_the_step(tmp_path):
    model = Tiny()
    both = (torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.Adam(model.parameters()))
    with pytest.raises(TypeError, match=r"not a tuple of 2: pass the one whose step\(\) ends each training step"):
        ampdiag.attach(model, optimizer=both, db=tmp_path / "run.db")
