"""Gradient clipping with a GradScaler: clip_grad_norm_ before scaler.unscale_() clips the
gradients while they are still multiplied by the loss scale. Nothing goes NaN/Inf and
torch raises nothing; every update is cut to max_norm / scale and the loss hardly falls.
The report names it, and its fix (unscale first) trains the same loop."""
import torch
from torch import nn

import ampdiag
from conftest import rules


def clipping_loop(db, unscale_first, steps=60):
    """An fp16 regression loop that clips to max_norm 1; returns its last loss."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 32, generator=g)
    y = x[:, :1] * 2 + 0.1 * torch.randn(512, 1, generator=g)
    with ampdiag.attach(model, scaler, db=db):
        for _ in range(steps):
            i = torch.randint(0, 512, (64,), generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x[i]).float(), y[i])
            opt.zero_grad()
            scaler.scale(loss).backward()
            if unscale_first:
                scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
    return loss.item()


def test_clipping_before_unscale_is_named_with_the_clip_and_the_order_that_fixes_it(tmp_path, verdict):
    clipping_loop(tmp_path / "clip.db", unscale_first=False)
    code, rep = verdict(tmp_path / "clip.db")
    assert code == 1
    assert rules(rep, "error") == [("clip-before-unscale", "")]
    finding = rep["findings"][0]
    assert "max_norm=1)" in finding["evidence"]
    assert "scaler.unscale_(optimizer)\ntorch.nn.utils.clip_grad_norm_" in finding["suggestions"][0]["python"].replace(
        "  # the gradients' true values, before the clip", "")


def test_unscaling_before_the_clip_as_the_report_says_is_healthy_and_trains(tmp_path, verdict):
    wrong = clipping_loop(tmp_path / "wrong.db", unscale_first=False)
    right = clipping_loop(tmp_path / "right.db", unscale_first=True)
    code, rep = verdict(tmp_path / "right.db")
    assert code == 0, rep["findings"]
    assert "clip-before-unscale" not in [rule for rule, _ in rules(rep)]
    assert right < wrong / 5  # the clipped-while-scaled updates barely moved the model
