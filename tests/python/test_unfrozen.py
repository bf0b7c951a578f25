"""A parameter frozen at attach() and trained later (a backbone unfrozen after a few epochs)
gets its gradient hook when its first gradient is read: from the next step on its backward
order is recorded, so an overflow that starts in it is not placed after every other
layer's. Event "parameters-unfrozen" says so, once."""
import sqlite3

import torch
from torch import nn

import ampdiag


def finetune(db, unfreeze_at=2, steps=4):
    torch.manual_seed(0)
    backbone, head = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16)), nn.Linear(16, 1)
    model = nn.Sequential(backbone, head)
    backbone.requires_grad_(False)
    opt, scaler = torch.optim.SGD(model.parameters(), lr=1e-3), torch.amp.GradScaler("cpu")
    with ampdiag.attach(model, scaler, db=db):
        for step in range(steps):
            if step == unfreeze_at:
                backbone.requires_grad_(True)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(4, 8)).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()


def backward_order(db, step):
    with sqlite3.connect(db) as c:
        return c.execute("SELECT l.name, g.bwd_order FROM grad_stats g JOIN layers l ON l.id = g.layer_id "
                         f"WHERE g.step = {step} ORDER BY l.id").fetchall()


def test_an_unfrozen_backbones_gradients_arrive_in_backward_order_from_the_next_step(tmp_path):
    finetune(tmp_path / "run.db")
    assert [order for _, order in backward_order(tmp_path / "run.db", 2)] == [-1, -1, -1, -1, 0, 1]
    order = dict(backward_order(tmp_path / "run.db", 3))
    assert order["1.weight"] < order["0.2.weight"] < order["0.0.weight"]  # the head first, the input layer last
    with sqlite3.connect(tmp_path / "run.db") as c:
        assert c.execute("SELECT step, detail FROM events WHERE kind = 'parameters-unfrozen'").fetchall() == [
            (2, "0.0.weight was frozen at attach() and has a gradient from this step: its backward order is "
                "recorded from the next step")]


def test_a_backbone_frozen_throughout_gets_no_rows_and_no_event(tmp_path):
    finetune(tmp_path / "run.db", unfreeze_at=None)
    assert [name for name, _ in backward_order(tmp_path / "run.db", 3)] == ["1.weight", "1.bias"]
    with sqlite3.connect(tmp_path / "run.db") as c:
        assert c.execute("SELECT count(*) FROM events WHERE kind = 'parameters-unfrozen'").fetchone() == (0,)


def test_a_backbone_whose_own_optimizer_was_unscaled_without_gradients_still_gets_its_hook_when_unfrozen(tmp_path):
    # Two optimizers on one scaler; while the backbone is frozen, the loop still unscales
    # its optimizer (no gradient there: the agent looks for arrivals) and steps the head's.
    torch.manual_seed(0)
    backbone, head = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16)), nn.Linear(16, 1)
    model = nn.Sequential(backbone, head)
    backbone.requires_grad_(False)
    opt_backbone, opt_head = torch.optim.SGD(backbone.parameters(), lr=1e-3), torch.optim.SGD(head.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    db = tmp_path / "run.db"
    with ampdiag.attach(model, scaler, db=db):
        for step in range(4):
            if step == 2:
                backbone.requires_grad_(True)
            opt_backbone.zero_grad(), opt_head.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(4, 8)).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.unscale_(opt_backbone)
            if step >= 2:
                scaler.step(opt_backbone)
            scaler.step(opt_head)
            scaler.update()
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT step FROM events WHERE kind = 'parameters-unfrozen'").fetchall() == [(2,)]
