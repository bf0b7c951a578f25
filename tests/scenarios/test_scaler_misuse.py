"""Loops that scale the loss but step the optimizer themselves, as real torch loops:
torch raises nothing, the run goes NaN, and the verdict must name the loop's mistake
first, with the fix that the same loop, corrected, confirms. And a loop that scales with
another GradScaler than the attached one, or gives it a .half() model, whose run.db holds
no step: the report's error says why, and what to do."""
import subprocess

import pytest
import torch
from torch import nn

import ampdiag
from conftest import amp_step


def scaled_backward(scaler, loss):
    scaler.scale(loss).backward()


def unscaled_backward(scaler, loss):
    scaler.scale(loss)  # its output is dropped
    loss.backward()


def train(db, step, init_scale, steps=20, backward=scaled_backward):
    """An fp16 regression loop; `backward(scaler, loss)` runs its backward and
    `step(scaler, optimizer, model)` ends each iteration."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    losses = []
    with ampdiag.attach(model, scaler, db=db):
        for _ in range(steps):
            x, y = torch.randn(32, 16), torch.randn(32, 1)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            backward(scaler, loss)
            step(scaler, opt, model)
            losses.append(loss.item())
    return losses


def forgotten(scaler, opt, model):
    opt.step()  # scaler.step(opt) and scaler.update() forgotten


def unscaled_then_stepped(scaler, opt, model):
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()  # not scaler.step(opt): a step with Inf gradients is applied
    scaler.update()


def through_the_scaler(scaler, opt, model):
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()


def test_a_loop_that_forgot_scaler_step_is_told_so_first(tmp_path, verdict):
    losses = train(tmp_path / "forgot.db", forgotten, 1024.0)
    assert any(loss != loss for loss in losses)  # the scaled updates drove it to NaN
    code, rep = verdict(tmp_path / "forgot.db")
    assert code == 1
    first = rep["findings"][0]
    assert (first["rule"], first["severity"]) == ("optimizer-outside-scaler", "error")
    assert "still multiplied by the loss scale" in first["title"] + first["evidence"]


def test_an_optimizer_stepped_after_unscale_that_applied_an_overflow_is_told_so_first(tmp_path, verdict):
    losses = train(tmp_path / "unscaled.db", unscaled_then_stepped, 2.0 ** 24)
    assert losses[-1] != losses[-1]
    code, rep = verdict(tmp_path / "unscaled.db")
    assert code == 1
    first = rep["findings"][0]
    assert (first["rule"], first["severity"]) == ("optimizer-outside-scaler", "error")
    assert "applied, not skipped" in first["title"]


def test_the_same_loop_through_scaler_step_is_healthy(tmp_path, verdict):
    losses = train(tmp_path / "fixed.db", through_the_scaler, 2.0 ** 24)
    assert all(loss == loss for loss in losses)
    code, rep = verdict(tmp_path / "fixed.db")
    assert code == 0, rep["findings"]
    assert "optimizer-outside-scaler" not in [f["rule"] for f in rep["findings"]]


def test_a_backward_on_the_unscaled_loss_is_told_so_and_the_scaled_backward_is_healthy(tmp_path, verdict):
    # The loss never holds the scale, and scaler.step() divides the gradients by 65536:
    # nothing overflows or goes NaN, and torch raises nothing.
    train(tmp_path / "loss.db", through_the_scaler, 2.0 ** 16, steps=40, backward=unscaled_backward)
    code, rep = verdict(tmp_path / "loss.db")
    assert code == 1
    first = rep["findings"][0]
    assert (first["rule"], first["severity"]) == ("unscaled-backward", "error")
    assert first["suggestions"][0]["python"].startswith("scaler.scale(loss).backward()")
    train(tmp_path / "fixed.db", through_the_scaler, 2.0 ** 16, steps=40)
    code, rep = verdict(tmp_path / "fixed.db")
    assert code == 0, rep["findings"]


def test_a_grad_scaler_made_again_in_each_epoch_is_named_in_the_reports_error(tmp_path, cli):
    # The tutorials' train_one_epoch() that makes its own GradScaler: the attached one never
    # scales or updates, so no step is recorded; the report says why instead of "the training
    # never reached scaler.update()".
    db = tmp_path / "epochs.db"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def train_one_epoch():
        scaler = torch.amp.GradScaler("cpu")
        for _ in range(5):
            x, y = torch.randn(32, 16), torch.randn(32, 1)
            amp_step(opt, scaler, lambda: nn.functional.mse_loss(model(x).float(), y))

    with ampdiag.attach(model, torch.amp.GradScaler("cpu"), db=db):
        for _ in range(3):
            train_one_epoch()
    result = subprocess.run([cli, "report", str(db)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"ampdiag report: {db}: holds no steps: 8 backwards reached the model and the GradScaler given to attach() has "
        "scaled no loss: if the loop scales its losses, it does so with another GradScaler (one made after attach(), as "
        "in a function called once per epoch); make the GradScaler once and give that one to attach()"]


def test_a_half_model_given_a_grad_scaler_is_told_to_keep_fp32_master_weights(tmp_path, cli):
    # model.half() and a GradScaler: torch refuses to unscale the fp16 gradients at the first
    # scaler.step() ("Attempting to unscale FP16 gradients."), which says nothing of the fix.
    db = tmp_path / "half.db"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        with ampdiag.attach(model, scaler, db=db):
            x, y = torch.randn(32, 16).half(), torch.randn(32, 1)
            amp_step(opt, scaler, lambda: nn.functional.mse_loss(model(x).float(), y))
    result = subprocess.run([cli, "report", str(db)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert ("the training raised ValueError: Attempting to unscale FP16 gradients. A GradScaler unscales FP32 "
            "gradients only: keep the parameters in float32 (no model.half())") in result.stderr


def test_unscaling_inside_the_accumulation_loop_is_told_to_unscale_once_after_the_last_backward(tmp_path, cli):
    # The clip recipe pasted into a gradient-accumulation loop: the second micro-batch's
    # scaler.unscale_() is refused by torch before any step ends.
    db = tmp_path / "accum.db"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called"):
        with ampdiag.attach(model, scaler, db=db):
            for _ in range(2):
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = nn.functional.mse_loss(model(torch.randn(8, 16)).float(), torch.randn(8, 1)) / 2
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    result = subprocess.run([cli, "report", str(db)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert ("unscale_() has already been called on this optimizer since the last update(). Call "
            "scaler.unscale_(optimizer) once per optimizer per step, after the step's last backward (with gradient "
            "accumulation: not inside the micro-batch loop)") in result.stderr
