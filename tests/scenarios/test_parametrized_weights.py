"""A weight_norm layer whose magnitude starts 3e4 times too large (a checkpoint saved at
another scale): the report named it, and its fix called reset_parameters(), which writes into
the weight the parametrization computes, a copy, so nothing changed. Its fix assigns the new
weight through the parametrization, and run as the report gives it, the loop is healthy."""
import math

import torch
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

from conftest import amp_training


def wn_model(gain):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), weight_norm(nn.Linear(128, 128)), nn.GELU(), nn.Linear(128, 10))
    with torch.no_grad():
        model[2].parametrizations.weight.original0.mul_(gain)
    return model


def train(db, model):
    def loss_of(g):
        x, y = torch.randn(64, 32, generator=g), torch.randint(0, 10, (64,), generator=g)
        return nn.functional.cross_entropy(model(x), y)

    amp_training(db, model, torch.optim.AdamW(model.parameters(), lr=1e-3), 30, loss_of)


def test_a_weight_norm_layer_far_too_large_is_reinitialised_through_its_parametrization(tmp_path, verdict):
    model = wn_model(3e4)
    train(tmp_path / "bad.db", model)
    _, report = verdict(tmp_path / "bad.db")
    oversized = [f for f in report["findings"] if f["rule"] == "oversized-weights"]
    assert [f["module"] for f in oversized] == ["2"], report["findings"]
    fix = oversized[0]["suggestions"][0]
    assert "reset_parameters" not in fix["python"]

    model = wn_model(3e4)
    exec(fix["python"], {"torch": torch, "math": math, "model": model})
    assert model[2].weight.abs().max() < 1.0  # the originals were set, not a computed copy
    train(tmp_path / "fixed.db", model)
    code, fixed = verdict(tmp_path / "fixed.db")
    assert (code, fixed["healthy"]) == (0, True), fixed["findings"]
    assert not [f for f in fixed["findings"] if f["rule"] == "oversized-weights"]
