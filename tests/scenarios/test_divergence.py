"""A learning rate too high, as a real fp16 loop: the loss grows by orders of magnitude
while finite, then the first Linear overflows fp16 and the loss goes NaN. The verdict must
name the divergence first, with the overflow after it only where it showed; the same loop
with a tenth of the learning rate confirms the fix: healthy."""
import torch
from torch import nn

import ampdiag


def train(db, lr, steps=40):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 1))
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")
    losses = []
    with ampdiag.attach(model, scaler, db=db):
        for _ in range(steps):
            x = torch.randn(64, 32)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x).float(), x[:, :1] * 3)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
    return losses


def test_a_diverging_loss_is_named_before_the_module_that_overflowed(tmp_path, verdict):
    losses = train(tmp_path / "diverged.db", lr=0.5)
    assert losses[-1] != losses[-1] and max(l for l in losses if l == l) > 1000 * losses[0]
    code, rep = verdict(tmp_path / "diverged.db")
    assert code == 1
    first = rep["findings"][0]
    assert (first["rule"], first["severity"]) == ("loss-divergence", "error")
    culprits = [f for f in rep["findings"] if f["rule"] == "forward-nonfinite"]
    assert culprits and all(f["severity"] != "error" for f in culprits)
    assert culprits[0]["suggestions"][0]["summary"].startswith("The loss was diverging (see loss-divergence)")


def test_whatif_does_not_offer_a_scaler_setting_for_a_diverging_run(tmp_path, ampdiag):
    train(tmp_path / "diverged.db", lr=0.5)
    result = ampdiag("whatif", tmp_path / "diverged.db")
    assert result.returncode == 0, result.stderr
    assert "Recommended: keep the recorded configuration: the loss diverged" in result.stdout


def test_the_html_report_plots_a_diverging_loss_on_a_log_scale(tmp_path, ampdiag):
    # On a linear axis the loss sat flat at zero until it exploded.
    train(tmp_path / "diverged.db", lr=0.5)
    page = tmp_path / "report.html"
    result = ampdiag("report", tmp_path / "diverged.db", "--format", "html", "-o", page)
    assert result.returncode == 1, result.stderr
    assert "log scale: it spans a factor of" in page.read_text()


def test_the_same_loop_with_a_tenth_of_the_learning_rate_is_healthy(tmp_path, verdict):
    losses = train(tmp_path / "fixed.db", lr=0.05)
    assert all(l == l for l in losses)
    code, rep = verdict(tmp_path / "fixed.db")
    assert code == 0, rep["findings"]
