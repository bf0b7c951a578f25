"""A classifier whose cross-entropy is multiplied by 1e6 "to keep small gradients from
underflowing", on top of the GradScaler: its gradients pass 65504 even unscaled and the
scale falls below 1. The report led with normalising regression targets; it leads with
taking the factor out, read from the loss code, and without it the same loop is healthy."""
import torch
from torch import nn

from conftest import amp_training


def factor_loop(db, factor):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10))

    def loss_of(g):
        x, y = torch.randn(64, 32, generator=g), torch.randint(0, 10, (64,), generator=g)
        return nn.functional.cross_entropy(model(x), y) * factor

    amp_training(db, model, torch.optim.AdamW(model.parameters(), lr=1e-3), 30, loss_of)


def test_a_large_factor_on_the_loss_is_told_to_be_taken_out(tmp_path, verdict):
    db = tmp_path / "run.db"
    factor_loop(db, 1e6)
    code, report = verdict(db)
    assert code == 1
    first = report["findings"][0]
    assert (first["rule"], first["module"]) == ("overflow-origin", "4")
    assert first["title"].startswith("4's gradients exceed fp16's range even unscaled")
    fix = first["suggestions"][0]["summary"]
    assert fix.startswith("Take out the loss code's multiplication by 1e+06 (Mul, float32), which makes every "
                          "gradient 1e+06 times larger: the loss is around ")
    assert "without the factor of 1e+06" in first["suggestions"][0]["python"]


def test_the_same_loop_without_the_factor_is_healthy(tmp_path, verdict):
    db = tmp_path / "run.db"
    factor_loop(db, 1.0)
    code, report = verdict(db)
    assert (code, report["healthy"]) == (0, True), report["findings"]
