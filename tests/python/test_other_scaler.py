"""A loop that scales its losses with another GradScaler than the one given to attach() (one
made per epoch): event "scaler-unused" once, after 8 backwards reached the model with the
attached scaler unused, and one line on stderr. A GAN whose generator's scaler backpropagates
through the attached discriminator, after the attached scaler has been used, is not that."""
import sqlite3

import torch
from torch import nn

import ampdiag
from test_stale_gradients import gan_run, model

EVENT = "scaler-unused"


def events(db):
    with sqlite3.connect(db) as c:
        return c.execute(f"SELECT step, detail FROM events WHERE kind = '{EVENT}'").fetchall()


def per_epoch_scaler_run(db, epochs=3, steps=4):
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    with ampdiag.attach(net, torch.amp.GradScaler("cpu"), db=db):
        for _ in range(epochs):
            scaler = torch.amp.GradScaler("cpu")  # the epoch's own, never attached
            for _ in range(steps):
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = nn.functional.mse_loss(net(x).float(), y)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
    return events(db)


def test_a_scaler_made_per_epoch_after_attach_is_recorded_once_and_said_on_stderr(tmp_path, capfd):
    assert [step for step, _ in per_epoch_scaler_run(tmp_path / "run.db")] == [0]
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("ampdiag: ")]
    assert lines == ["ampdiag: 8 backwards reached the model and the GradScaler given to attach() has scaled no loss: "
                     "if the loop scales its losses, it does so with another GradScaler (one made after attach(), as "
                     "in a function called once per epoch); make the GradScaler once and give that one to attach()"]


def test_fewer_backwards_than_the_threshold_record_nothing(tmp_path):
    assert per_epoch_scaler_run(tmp_path / "run.db", epochs=1, steps=7) == []


def test_another_scalers_backward_after_the_attached_one_was_used_records_nothing(tmp_path):
    gan_run(tmp_path / "run.db", lambda opt: opt.zero_grad(), steps=10)
    assert events(tmp_path / "run.db") == []
