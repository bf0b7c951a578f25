"""clip_grad_norm_(error_if_nonfinite=True) between scaler.unscale_() and scaler.step(), as a
loop carried over from fp32 training writes it: the first step whose fp16 gradients overflow,
which GradScaler would skip, raises instead, and the training stops. The report must say so
(it read "healthy" on the one step before), and the same loop without the option trains
through that step and is healthy."""
import pytest
import torch
from torch import nn

import ampdiag


def train(db, error_if_nonfinite, steps=12):
    """An fp16 regression loop whose inputs are large enough that its gradients overflow a
    scale of 1024 by its second step; returns the steps it completed."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x, y = torch.randn(32, 64) * 30, torch.randn(32, 1)
    done = 0
    with ampdiag.attach(model, scaler, db=db):
        for _ in range(steps):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=error_if_nonfinite)
            scaler.step(opt)
            scaler.update()
            done += 1
    return done


def test_a_clip_that_raises_on_the_scalers_overflow_is_the_error_named_first(tmp_path, verdict):
    db = tmp_path / "raised.db"
    with pytest.raises(RuntimeError, match="non-finite, so it cannot be clipped"):
        train(db, error_if_nonfinite=True)
    code, rep = verdict(db)
    assert code == 1
    first = rep["findings"][0]
    assert (first["rule"], first["severity"]) == ("training-raised", "error")
    assert first["steps"][0] == rep["runs"][0]["steps"]  # the step after the last one recorded
    assert "no error_if_nonfinite=True" in first["suggestions"][0]["python"]


def test_the_same_loop_without_error_if_nonfinite_skips_that_step_and_is_healthy(tmp_path, healthy_through_skips):
    db = tmp_path / "skipped.db"
    assert train(db, error_if_nonfinite=False) == 12
    rep = healthy_through_skips(db)
    assert not any(f["rule"] == "training-raised" for f in rep["findings"])
