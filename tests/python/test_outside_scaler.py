"""An optimizer stepped outside scaler.step() in a loop that scales its loss: the agent
records event "optimizer-outside-scaler" and the steps as they really went (scaler.step()
forgotten: steps with the scaled gradients' statistics, ended after the optimizer's step;
after scaler.unscale_(): a step with NaN/Inf gradients recorded as taken). The loops that
use the scaler as torch documents record no such event."""
import sqlite3

import pytest
import torch
from torch import nn
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

import ampdiag

EVENT = "optimizer-outside-scaler"


def rows(db, sql):
    with sqlite3.connect(db) as c:
        return c.execute(sql).fetchall()


def events(db):
    return [detail for (detail,) in rows(db, f"SELECT detail FROM events WHERE kind = '{EVENT}'")]


def model_and_data():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    return model, torch.randn(16, 8), torch.randn(16, 1)


def fp16_loss(model, x, y):
    with torch.autocast("cpu", dtype=torch.float16):
        return nn.functional.mse_loss(model(x).float(), y)


def test_a_loop_that_never_calls_scaler_step_records_its_steps_and_the_scaled_gradients(tmp_path):
    db = tmp_path / "run.db"
    model, x, y = model_and_data()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with ampdiag.attach(model, scaler, db=db):
        for _ in range(3):
            opt.zero_grad()
            scaler.scale(fp16_loss(model, x, y)).backward()
            scaled_max = max(float(p.grad.abs().max()) for p in model.parameters())
            opt.step()  # scaler.step(opt) and scaler.update() forgotten
    assert events(db) == ["SGD.step() ran on gradients still multiplied by the loss scale (1024): "
                          "scaler.step(optimizer) was not called"]
    assert rows(db, "SELECT step, skipped, scale_before, scale_after FROM steps ORDER BY step") == [
        (0, 0, 1024.0, 1024.0), (1, 0, 1024.0, 1024.0), (2, 0, 1024.0, 1024.0)]
    (recorded,) = rows(db, "SELECT MAX(absmax) FROM grad_stats WHERE step = 2")[0]
    assert recorded == pytest.approx(scaled_max, rel=1e-6)


def test_an_optimizer_stepped_after_unscale_records_a_step_with_inf_gradients_as_taken(tmp_path):
    db = tmp_path / "run.db"
    model, x, y = model_and_data()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24)  # the first steps overflow
    with ampdiag.attach(model, scaler, db=db) as handle:
        opt.zero_grad()
        scaler.scale(fp16_loss(model, x, y)).backward()
        scaler.unscale_(opt)
        opt.step()  # not scaler.step(opt): the Inf is applied
        scaler.update()
        assert not handle.last_step_skipped
    assert [d.split(":")[0] for d in events(db)] == ["SGD.step() ran after scaler.unscale_(optimizer) but outside "
                                                     "scaler.step()"]
    assert rows(db, "SELECT found_inf, skipped FROM steps") == [(1, 0)]
    assert not all(torch.isfinite(p).all() for p in model.parameters())


def test_scaler_step_with_unscale_and_clipping_records_no_event(tmp_path):
    db = tmp_path / "run.db"
    model, x, y = model_and_data()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with ampdiag.attach(model, scaler, db=db):
        for _ in range(3):
            opt.zero_grad()
            scaler.scale(fp16_loss(model, x, y)).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
    assert events(db) == []
    assert len(rows(db, "SELECT step FROM steps")) == 3


def test_a_second_model_stepped_directly_on_its_own_unscaled_loss_records_no_event(tmp_path):
    # A GAN-style loop: the discriminator trains in FP32 without the scaler, before the
    # generator's scaled loss; only the generator's optimizer goes through scaler.step().
    db = tmp_path / "run.db"
    model, x, y = model_and_data()
    critic = nn.Linear(1, 1)
    opt, critic_opt = torch.optim.SGD(model.parameters(), lr=1e-3), torch.optim.SGD(critic.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with ampdiag.attach(model, scaler, db=db):
        for _ in range(3):
            critic_opt.zero_grad()
            critic(model(x).detach()).pow(2).mean().backward()
            critic_opt.step()
            opt.zero_grad()
            scaler.scale(fp16_loss(model, x, y)).backward()
            scaler.step(opt)
            scaler.update()
    assert events(db) == []


def test_closing_the_handle_removes_its_global_optimizer_hooks(tmp_path):
    model, _, _ = model_and_data()
    before = (len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks))
    handle = ampdiag.attach(model, torch.amp.GradScaler("cpu"), db=tmp_path / "run.db")
    # Post hooks: the outside-scaler check's and the accumulation probe's.
    assert (len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks)) == (before[0] + 1, before[1] + 2)
    handle.close()
    assert (len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks)) == before
