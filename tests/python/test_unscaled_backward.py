"""backward() on the loss given to scaler.scale() instead of on its output: the gradients
never hold the scale that scaler.step() divides out. The agent records event
"unscaled-backward" once, at the step it first happened; backward on scale()'s output, in
any of the forms torch documents, records none."""
import sqlite3

import torch
from torch import nn

import ampdiag

EVENT = "unscaled-backward"


def events(db):
    with sqlite3.connect(db) as c:
        return c.execute(f"SELECT step, detail FROM events WHERE kind = '{EVENT}'").fetchall()


def run(db, backward, steps=3, scaler=None):
    """A small fp16 loop whose backward is `backward(scaler, loss, model)`."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = scaler or torch.amp.GradScaler("cpu", init_scale=1024.0)
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    with ampdiag.attach(model, scaler, db=db):
        for _ in range(steps):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            backward(scaler, loss, model)
            scaler.step(opt)
            scaler.update()
    return events(db)


def test_backward_on_the_loss_given_to_scale_is_recorded_once_with_the_scale(tmp_path):
    def wrong(scaler, loss, model):
        scaler.scale(loss)
        loss.backward()

    assert run(tmp_path / "run.db", wrong) == [
        (0, "backward() ran on the loss given to scaler.scale() (scale 1024), not on its output")]


def test_a_scale_set_as_a_large_power_of_two_is_written_whole_as_the_report_prints_it(tmp_path):
    # init_scale=2**24 was written "1.67772e+07", which is not the number the user set.
    def wrong(scaler, loss, model):
        scaler.scale(loss)
        loss.backward()

    assert run(tmp_path / "run.db", wrong, scaler=torch.amp.GradScaler("cpu", init_scale=2.0 ** 24)) == [
        (0, "backward() ran on the loss given to scaler.scale() (scale 16777216), not on its output")]


def test_torch_autograd_backward_on_that_loss_is_the_same_mistake(tmp_path):
    def wrong(scaler, loss, model):
        scaler.scale(loss)
        torch.autograd.backward([loss])

    assert [step for step, _ in run(tmp_path / "run.db", wrong)] == [0]


def test_backward_on_scales_output_records_nothing(tmp_path):
    assert run(tmp_path / "run.db", lambda scaler, loss, model: scaler.scale(loss).backward()) == []


def test_two_scaled_losses_through_retain_graph_record_nothing(tmp_path):
    def two(scaler, loss, model):
        scaler.scale(loss).backward(retain_graph=True)
        scaler.scale(loss * 0.1).backward()

    assert run(tmp_path / "run.db", two) == []


def test_the_gradient_penalty_recipe_records_nothing(tmp_path):
    # PyTorch's recipe: gradients of the scaled loss through autograd.grad, then backward
    # on the scaled penalised loss.
    def penalty(scaler, loss, model):
        params = list(model.parameters())
        grads = torch.autograd.grad(scaler.scale(loss), params, create_graph=True)
        inv = 1.0 / scaler.get_scale()
        norm = torch.stack([(g * inv).pow(2).sum() for g in grads]).sum().sqrt()
        scaler.scale(loss + norm).backward()

    assert run(tmp_path / "run.db", penalty) == []


def test_a_second_models_own_unscaled_backward_is_not_the_loops(tmp_path):
    # Another model's loss, never given to scale(), goes backward on its own.
    other = nn.Linear(4, 1)

    def with_other(scaler, loss, model):
        other(torch.randn(2, 4)).sum().backward()
        scaler.scale(loss).backward()

    assert run(tmp_path / "run.db", with_other) == []
