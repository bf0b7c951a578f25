"""torch's fused SGD with momentum fills the momentum buffers it creates only in a step it
applies: where the scaler skips that first step (its calibration), they hold uninitialised
memory and the weights jump at the first applied step. The agent sees the buffers unfilled
(event "fused-momentum-uninitialised") and the report names it, not the learning rate; an
applied first step, a later skip and the unfused SGD record nothing."""
import sqlite3

import pytest
import torch
from torch import nn

import ampdiag


def train(db, fused=True, init_scale=65536.0, inf_at=None, steps=8, empty=False):
    """fp16 SGD(momentum=0.9) steps with a real GradScaler, attached where `db` is given; the
    loss made Inf at step `inf_at`; with `empty`, the model also holds an empty parameter.
    Returns the parameters after training."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    if empty:
        model.register_parameter("none", nn.Parameter(torch.empty(0)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, fused=fused)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    x, y = torch.randn(64, 16), torch.randn(64, 1)
    handle = ampdiag.attach(model, scaler, db=str(db)) if db is not None else None
    for step in range(steps):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x).float(), y) + (model.none.sum() if empty else 0.0)
        if step == inf_at:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    if handle is not None:
        handle.close()
    return [p.detach().clone() for p in model.parameters()]


def events(db):
    with sqlite3.connect(db) as c:
        return c.execute("SELECT step FROM events WHERE kind = 'fused-momentum-uninitialised'").fetchall()


def test_a_skipped_first_step_of_fused_sgd_is_recorded_and_named_before_the_learning_rate(tmp_path, report):
    train(tmp_path / "run.db", init_scale=2.0**18)  # steps 0-2 skipped as the scale comes down
    assert events(tmp_path / "run.db") == [(0,)]
    code, rep = report(tmp_path / "run.db")
    rules = [f["rule"] for f in rep["findings"]]
    assert code == 1 and rules[0] == "fused-sgd-momentum", rules
    assert "weight-growth" not in rules and "loss-divergence" not in rules
    assert rep["findings"][0]["suggestions"][0]["python"] == \
        "optimizer = torch.optim.SGD(model.parameters(), lr=0.01, weight_decay=0, momentum=0.9)  # not fused=True"


@pytest.mark.parametrize("case", [dict(fused=False, init_scale=2.0**18), dict(init_scale=1024.0),
                                  dict(init_scale=1024.0, inf_at=3)],
                         ids=["unfused SGD, first steps skipped", "fused SGD, first step applied",
                              "fused SGD, a later step skipped"])
def test_momentum_filled_by_its_first_step_records_nothing(tmp_path, case):
    train(tmp_path / "run.db", **case)
    assert events(tmp_path / "run.db") == []


@pytest.mark.parametrize("case", [dict(fused=False, init_scale=2.0**18), dict(init_scale=1024.0)],
                         ids=["unfused SGD, first steps skipped", "fused SGD, first step applied"])
def test_sgd_whose_momentum_was_filled_is_healthy(tmp_path, report, case):
    train(tmp_path / "run.db", **case)
    code, rep = report(tmp_path / "run.db")
    assert code == 0, [f["rule"] for f in rep["findings"]]


def test_the_look_at_the_buffers_leaves_the_training_bit_identical(tmp_path):
    with_agent = train(tmp_path / "run.db", init_scale=1024.0)
    without = train(None, init_scale=1024.0)
    assert all(torch.equal(a, b) for a, b in zip(with_agent, without))


def test_an_empty_parameters_buffer_is_passed_over_and_the_others_are_looked_at(tmp_path):
    # torch's foreach infinity norm raises for an empty tensor: it has no identity.
    train(tmp_path / "run.db", init_scale=2.0**18, empty=True)
    assert events(tmp_path / "run.db") == [(0,)]


def test_a_look_that_raises_is_a_warning_and_the_training_goes_on(tmp_path, monkeypatch):
    from ampdiag import _fused_momentum

    def broken(self, scaler, optimizer, params):
        raise RuntimeError("a tensor type the look cannot read")

    monkeypatch.setattr(_fused_momentum.FusedMomentumProbe, "_look", broken)
    with_agent = train(tmp_path / "run.db", init_scale=1024.0)
    assert all(torch.equal(a, b) for a, b in zip(with_agent, train(None, init_scale=1024.0)))
    with sqlite3.connect(tmp_path / "run.db") as c:
        assert c.execute("SELECT detail FROM events WHERE kind = 'warning'").fetchall() == [
            ("fused SGD's new momentum buffers were not looked at: RuntimeError: a tensor type the look cannot read",)]
