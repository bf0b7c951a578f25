"""The loss a step records is the sum of the distinct losses given to scaler.scale(): a loss
scaled twice (once to log the scaled value, once to backpropagate it) counts once; two
different losses count both."""
import sqlite3

import pytest
import torch
from torch import nn

import ampdiag


def recorded_losses(db, losses_of, steps=3):
    """losses_of(model, scaler) runs a step's forward and backward; returns the loss the
    user saw per step and the (loss, losses) rows."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt, scaler = torch.optim.SGD(model.parameters(), lr=1e-3), torch.amp.GradScaler("cpu", init_scale=256.0)
    seen = []
    with ampdiag.attach(model, scaler, db=db):
        for _ in range(steps):
            opt.zero_grad()
            seen.append(losses_of(model, scaler))
            scaler.step(opt)
            scaler.update()
    with sqlite3.connect(db) as c:
        return seen, c.execute("SELECT loss, losses FROM steps ORDER BY step").fetchall()


def forward(model):
    with torch.autocast("cpu", dtype=torch.float16):
        return model(torch.randn(4, 8)).float().pow(2).mean()


def test_a_loss_scaled_once_to_log_it_and_once_to_backpropagate_counts_once(tmp_path):
    def logged_then_backpropagated(model, scaler):
        loss = forward(model)
        scaler.scale(loss).item()  # the scaled loss, logged
        scaler.scale(loss).backward()
        return loss.item()

    seen, rows = recorded_losses(tmp_path / "run.db", logged_then_backpropagated)
    assert [n for _, n in rows] == [1, 1, 1]
    assert [loss for loss, _ in rows] == pytest.approx(seen)


def test_two_different_losses_each_scaled_count_both(tmp_path):
    def two_losses(model, scaler):
        first, second = forward(model), forward(model)
        scaler.scale(first).backward()
        scaler.scale(second).backward()
        return first.item() + second.item()

    seen, rows = recorded_losses(tmp_path / "run.db", two_losses)
    assert [n for _, n in rows] == [2, 2, 2]
    assert [loss for loss, _ in rows] == pytest.approx(seen)
