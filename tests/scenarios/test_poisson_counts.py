"""Count regression with PyTorch's Poisson NLL (log_input=True) on counts around 2000. The
loss leaves out Stirling's term, so it crosses 0 as it trains (around 100 while the scale
came down, -13000 later), and its gradients, exp(out) - y, are of the counts' size. The
report read the loss of 100 as too small to make gradients of 7000: "the model's own
operations make them this large", with no fix but bf16. Counts scaled down by 100 train
healthy."""
import torch
from torch import nn
import torch.nn.functional as F

from conftest import amp_training


def poisson_regression(tmp_path, verdict, counts_scale):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 1))
    w = torch.randn(16)

    def loss_of(g):
        x = torch.randn(256, 16, generator=g)
        counts = torch.poisson(2000 * torch.exp(x @ w / 8), generator=g)
        return F.poisson_nll_loss(model(x)[:, 0], counts / counts_scale, log_input=True)

    db = tmp_path / "run.db"
    amp_training(db, model, torch.optim.Adam(model.parameters(), 1e-3), 60, loss_of)
    return verdict(db)


def test_a_poisson_loss_below_0_on_large_counts_is_told_to_scale_the_counts_down(tmp_path, verdict):
    code, report = poisson_regression(tmp_path, verdict, 1.0)
    assert code == 1
    finding = next(f for f in report["findings"] if f["rule"] == "overflow-origin")
    assert "whose gradients are of the order of it" not in finding["evidence"]
    first = finding["suggestions"][0]
    assert first["summary"].startswith("Shrink the loss where it is made (it goes below 0"), first["summary"]
    assert "scale the regression targets down" in first["summary"]
    assert first["python"].startswith("y = y / y_scale")


def test_the_same_poisson_loss_on_counts_scaled_down_is_healthy(tmp_path, verdict):
    code, report = poisson_regression(tmp_path, verdict, 100.0)
    assert (code, report["healthy"]) == (0, True), report["findings"]
