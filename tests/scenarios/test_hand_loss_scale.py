"""A loss scale set by hand, as apex-era loops wrote it without torch's GradScaler:
(loss * S).backward(), the gradients divided by S before the optimizer's step. Without a
GradScaler the agent reads the gradients at that step, after the division: the shares it read
are the same at S = 1, 1024 or 65536, and the report had told such a loop to "use a loss
scaler". It now tells it to use torch's GradScaler in place of the scale by hand, as
information; at S = 1 (no scale at all) the underflow stays a warning."""
import torch
from torch import nn

import ampdiag


def train_scaled_by_hand(db, loss_scale, steps=12):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with ampdiag.attach(model, optimizer=opt, db=db):
        for step in range(steps):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(64, 32, generator=g), torch.randn(64, 1, generator=g) * 1e-3
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            (loss * loss_scale).backward()
            for p in model.parameters():
                p.grad.div_(loss_scale)
            opt.step()
            opt.zero_grad()


def test_a_loss_scaled_by_hand_is_told_to_use_a_grad_scaler_in_its_place(tmp_path, verdict):
    db = tmp_path / "run.db"
    train_scaled_by_hand(db, 1024.0)
    code, rep = verdict(db)
    assert code == 0
    [u] = [f for f in rep["findings"] if f["rule"] == "underflow"]
    assert u["severity"] == "info"
    assert "the loss code multiplies the loss by 1024 before backward()" in u["evidence"]
    assert u["suggestions"][0]["summary"].startswith("Use torch.amp.GradScaler in place of the loss scale of 1024")


def test_the_same_loop_with_no_scale_is_told_to_add_a_loss_scaler(tmp_path, verdict):
    db = tmp_path / "run.db"
    train_scaled_by_hand(db, 1.0)
    code, rep = verdict(db)
    [u] = [f for f in rep["findings"] if f["rule"] == "underflow"]
    assert u["severity"] == "warning"
    assert u["suggestions"][0]["summary"].startswith("Use a loss scaler")
