"""PyTorch's gradient-penalty recipe: scaler.scale(loss) goes to torch.autograd.grad with
create_graph=True, a penalty is built from the gradients, and backward() receives the
penalised loss. The step's loss is that one, once; and the run says that its loss holds
the scaled gradients (event "scaled-gradients-in-loss"), which overflow at a high scale.
Where no backward follows (gradient surgery), the losses given to autograd.grad are the
step's."""
import sqlite3

import pytest
import torch
from torch import nn

import ampdiag


def penalised_steps(db, steps=3):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    seen = []
    with ampdiag.attach(model, scaler, db=db):
        for _ in range(steps):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(4, 8)).float().pow(2).mean()
            scaled = torch.autograd.grad(scaler.scale(loss), list(model.parameters()), create_graph=True)
            penalty = torch.stack([(g / scaler.get_scale()).pow(2).sum() for g in scaled]).sum()
            total = loss + penalty
            scaler.scale(total).backward()
            scaler.step(opt)
            scaler.update()
            seen.append(total.item())
    return seen


def test_the_scaled_loss_given_to_autograd_grad_is_not_counted_and_the_penalised_loss_is(tmp_path):
    db = tmp_path / "run.db"
    seen = penalised_steps(db)
    with sqlite3.connect(db) as c:
        recorded = c.execute("SELECT loss, losses FROM steps ORDER BY step").fetchall()
    assert [n for _, n in recorded] == [1, 1, 1]
    assert [loss for loss, _ in recorded] == seen


def test_a_create_graph_backward_from_the_scaled_loss_is_one_event(tmp_path):
    db = tmp_path / "run.db"
    penalised_steps(db)
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT step FROM events WHERE kind = 'scaled-gradients-in-loss'").fetchall() == [(0,)]


def test_a_plain_backward_is_no_scaled_gradients_event(tmp_path):
    db = tmp_path / "run.db"
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with ampdiag.attach(model, scaler, db=db):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(4, 8)).float().mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT COUNT(*) FROM events WHERE kind = 'scaled-gradients-in-loss'").fetchone() == (0,)


def test_close_gives_torch_its_autograd_grad_back(tmp_path):
    original = torch.autograd.grad
    handle = ampdiag.attach(nn.Linear(2, 1), torch.amp.GradScaler("cpu"), db=tmp_path / "run.db")
    assert torch.autograd.grad is not original
    handle.close()
    assert torch.autograd.grad is original


def test_a_step_whose_gradients_all_come_from_autograd_grad_records_those_losses(tmp_path):
    # Gradient surgery (PCGrad): each task's gradients from torch.autograd.grad on its scaled
    # loss, combined by hand into .grad; no backward() gives the step a loss.
    db = tmp_path / "run.db"
    torch.manual_seed(0)
    trunk, heads = nn.Linear(8, 16), nn.ModuleList([nn.Linear(16, 1), nn.Linear(16, 1)])
    model = nn.ModuleDict({"trunk": trunk, "heads": heads})
    params = list(model.parameters())
    opt, scaler = torch.optim.SGD(params, lr=1e-3), torch.amp.GradScaler("cpu", init_scale=256.0)
    seen = []
    with ampdiag.attach(model, scaler, db=db):
        for _ in range(3):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                h = trunk(torch.randn(4, 8))
                losses = [head(h).float().pow(2).mean() for head in heads]
            parts = [torch.autograd.grad(scaler.scale(loss), params, retain_graph=True, allow_unused=True)
                     for loss in losses]
            for p, *grads in zip(params, *parts):
                p.grad = sum(g for g in grads if g is not None)
            scaler.step(opt)
            scaler.update()
            seen.append(sum(loss.item() for loss in losses))
    with sqlite3.connect(db) as c:
        recorded = c.execute("SELECT loss, losses FROM steps ORDER BY step").fetchall()
    assert [n for _, n in recorded] == [2, 2, 2]
    assert [loss for loss, _ in recorded] == pytest.approx(seen)
