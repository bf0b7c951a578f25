"""Gradients not zeroed between optimizer steps: the agent records event
"gradients-not-zeroed" once, at the first step whose probe parameter (the smallest
trainable one) still held the previous step's gradient; the zeroing loops torch documents
(set_to_none either way, accumulation over micro-batches) record none, nor does a
trainable parameter that no optimizer holds."""
import sqlite3

import torch
from torch import nn

import ampdiag

EVENT = "gradients-not-zeroed"


def events(db):
    with sqlite3.connect(db) as c:
        return c.execute(f"SELECT step, detail FROM events WHERE kind = '{EVENT}'").fetchall()


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def fp16_run(db, net, zero, steps=4, micro=1, params=None):
    """`zero(opt, net)` runs at the start of each optimizer step."""
    opt = torch.optim.SGD(params if params is not None else net.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    with ampdiag.attach(net, scaler, db=db):
        for _ in range(steps):
            zero(opt, net)
            for _ in range(micro):
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = nn.functional.mse_loss(net(x).float(), y) / micro
                scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return events(db)


def never(opt, net):
    pass


def test_a_loop_that_never_zeroes_its_gradients_is_recorded_at_its_second_step(tmp_path):
    assert fp16_run(tmp_path / "run.db", model(), never) == [
        (1, "2.bias's gradient still held the previous optimizer step's values when this step's first gradient "
            "arrived: the gradients were not zeroed between steps")]


def test_zeroing_to_none_or_to_zeros_records_nothing(tmp_path):
    assert fp16_run(tmp_path / "none.db", model(), lambda opt, net: opt.zero_grad()) == []
    assert fp16_run(tmp_path / "zeros.db", model(), lambda opt, net: opt.zero_grad(set_to_none=False)) == []
    assert fp16_run(tmp_path / "model.db", model(), lambda opt, net: net.zero_grad()) == []


def test_accumulating_micro_batches_within_a_step_records_nothing(tmp_path):
    assert fp16_run(tmp_path / "run.db", model(), lambda opt, net: opt.zero_grad(), micro=4) == []


def test_a_trainable_parameter_no_optimizer_holds_keeps_its_gradient_unjudged(tmp_path):
    # The smallest trainable parameter (the head's bias) is left out of the optimizer, which
    # zeroes only its own: the bias's gradient adds up by design, nothing applies it.
    net = model()
    params = [p for name, p in net.named_parameters() if name != "2.bias"]
    assert fp16_run(tmp_path / "run.db", net, lambda opt, n: opt.zero_grad(), params=params) == []


def test_a_bf16_loop_without_a_scaler_that_never_zeroes_is_recorded(tmp_path):
    db = tmp_path / "run.db"
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    with ampdiag.attach(net, optimizer=opt, db=db):
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.mse_loss(net(x).float(), y)
            loss.backward()
            opt.step()
    assert [step for step, _ in events(db)] == [1]
