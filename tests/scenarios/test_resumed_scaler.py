"""A run resumed from a checkpoint whose scaler state carries the scale an earlier, broken
run collapsed to: the recording starts low and nothing in it overflows. It is not a
collapse the recording saw; it is a warning that points at the restored scale."""
import torch
from torch import nn

import ampdiag
from conftest import rules


def model_and_optimizer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def train(model, opt, scaler, steps, gain=1.0):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(32, 16, generator=g) * gain, torch.randn(32, 1, generator=g)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


def checkpoint_of_a_collapsed_run():
    """The first run: its inputs were 1e5 too large (fp16 overflows in forward at any
    scale), and in 20 steps its scale halved from 65536 to 1/16; its checkpoint keeps that."""
    model, opt = model_and_optimizer()
    scaler = torch.amp.GradScaler("cpu")
    train(model, opt, scaler, 20, gain=1e5)
    assert scaler.get_scale() == 2.0 ** -4
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "scaler": scaler.state_dict()}


def resume(db, checkpoint):
    """The fixed run, resumed from the checkpoint and attached from its first step."""
    model, opt = model_and_optimizer()
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["optimizer"])
    scaler = torch.amp.GradScaler("cpu")
    scaler.load_state_dict(checkpoint["scaler"])
    with ampdiag.attach(model, scaler, db=db):
        train(model, opt, scaler, 30)
    return scaler


def test_a_scale_restored_below_1_is_a_warning_that_names_the_restored_scale_and_fails_no_gate(tmp_path, verdict):
    scaler = resume(tmp_path / "resumed.db", checkpoint_of_a_collapsed_run())
    assert scaler.get_scale() == 2.0 ** -4  # nothing overflowed, and 30 steps are too few to grow
    code, rep = verdict(tmp_path / "resumed.db")
    assert code == 0, rep["findings"]
    collapse = [f for f in rep["findings"] if f["rule"] == "scale-collapse"]
    assert [f["severity"] for f in collapse] == ["warning"]
    assert "from the first step" in collapse[0]["title"] and "fell" not in collapse[0]["title"]
    assert "load_state_dict" in collapse[0]["evidence"]
    assert "init_scale=2.0**16" in collapse[0]["suggestions"][0]["python"]


def test_the_same_checkpoint_with_its_scale_reset_has_no_scale_finding(tmp_path, verdict):
    checkpoint = checkpoint_of_a_collapsed_run()
    checkpoint["scaler"]["scale"] = 2.0 ** 16  # what the warning's fix says
    resume(tmp_path / "reset.db", checkpoint)
    code, rep = verdict(tmp_path / "reset.db")
    assert code == 0, rep["findings"]
    assert "scale-collapse" not in [rule for rule, _ in rules(rep)]
