"""Regression on unnormalised targets (house prices around 3e5), as a real fp16 loop: the
loss is ~9e10 and the last layer's true gradients ~6e5, beyond fp16's range at any scale of
1 or more. The scaler settles below 1; the verdict must say the gradients are too large
unscaled and to shrink the loss, not to look for a sqrt in the backward. The same loop on
targets in units of their spread confirms the fix: healthy."""
import pytest
import torch
from torch import nn

import ampdiag
from conftest import amp_step

MEAN, SPREAD = 3e5, 5e4


def train(db, normalise, steps=40):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with ampdiag.attach(model, scaler, db=db):
        for _ in range(steps):
            x, y = torch.randn(256, 16), MEAN + SPREAD * torch.randn(256, 1)
            if normalise:
                y = (y - MEAN) / SPREAD
            amp_step(opt, scaler, lambda: nn.functional.mse_loss(model(x).float(), y))
    return scaler.get_scale()


def test_gradients_beyond_fp16_unscaled_are_told_to_shrink_the_loss(tmp_path, verdict):
    assert train(tmp_path / "prices.db", normalise=False) < 1.0
    code, rep = verdict(tmp_path / "prices.db")
    assert code == 1
    origin = next(f for f in rep["findings"] if f["rule"] == "overflow-origin")
    assert "exceed fp16's range even unscaled" in origin["title"]
    assert origin["suggestions"][0]["summary"].startswith("Shrink the loss where it is made")
    assert not any("sqrt" in s["summary"] for s in origin["suggestions"])


def test_the_same_loop_on_normalised_targets_is_healthy(tmp_path, verdict):
    assert train(tmp_path / "normalised.db", normalise=True) >= 1024.0
    code, rep = verdict(tmp_path / "normalised.db")
    assert code == 0, rep["findings"]


def train_oversized(db, layer, factor, classes, reset):
    """An MLP whose `layer` (a Sequential index) is `factor` times its initial size, trained
    on unit regression targets (classes=0: one output, MSE) or on `classes` labels
    (cross-entropy); `reset`: that layer re-initialised with reset_parameters(), as the
    report's first fix says."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, max(classes, 1)))
    with torch.no_grad():
        model[layer].weight.mul_(factor)
    if reset:
        model.get_submodule(str(layer)).reset_parameters()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu")
    with ampdiag.attach(model, scaler, db=db):
        for _ in range(40):
            x = torch.randn(256, 16)
            if classes:
                y = torch.randint(0, classes, (256,))
                amp_step(opt, scaler, lambda: nn.functional.cross_entropy(model(x).float(), y))
            else:
                y = torch.randn(256, 1)
                amp_step(opt, scaler, lambda: nn.functional.mse_loss(model(x).float(), y))


def train_hot_head(db, reset):
    """Unit targets, a last layer 1e4 times its initial size."""
    train_oversized(db, 4, 1e4, 0, reset)


def test_a_head_initialised_too_large_is_reset_first_and_named_beside_the_targets(tmp_path, verdict):
    # The loss is as large as with house prices, made by the model's outputs, which
    # normalising the targets would not shrink; the head's weights read at step 0 say why.
    train_hot_head(tmp_path / "hot_head.db", reset=False)
    code, rep = verdict(tmp_path / "hot_head.db")
    assert code == 1
    origin = next(f for f in rep["findings"] if f["rule"] == "overflow-origin")
    assert "exceed fp16's range even unscaled" in origin["title"]
    assert origin["suggestions"][0]["summary"].startswith("Initialise 4 at a standard scale")
    assert origin["suggestions"][0]["python"].startswith('model.get_submodule("4").reset_parameters()')
    assert "the model's outputs are large too (4's, the last module's" in origin["suggestions"][1]["summary"]


def test_the_head_reset_as_the_report_says_is_healthy(tmp_path, verdict):
    train_hot_head(tmp_path / "reset.db", reset=True)
    code, rep = verdict(tmp_path / "reset.db")
    assert code == 0, rep["findings"]


def train_hot_first_layer(db, reset, factor=2e4):
    """A classifier whose first Linear is `factor` times its initial size: every output after
    it, the loss (cross-entropy over 4 classes: no targets to normalise) and the gradients of
    the layers after it are that large."""
    train_oversized(db, 0, factor, 4, reset)


# At 6000 times, the last skip is at the floor itself (128), which leaves the scale at 64.
@pytest.mark.parametrize("factor", [2e4, 6000.0], ids=["below_the_floor", "at_the_floor"])
def test_gradients_too_large_after_a_first_layer_initialised_too_large_reset_that_layer_first(tmp_path, verdict,
                                                                                              factor):
    train_hot_first_layer(tmp_path / "hot_first.db", reset=False, factor=factor)
    code, rep = verdict(tmp_path / "hot_first.db")
    assert code == 1
    origin = next(f for f in rep["findings"] if f["rule"] == "overflow-origin" and f["severity"] == "error")
    assert "too large for a loss scale above the floor" in origin["title"]
    first = origin["suggestions"][0]
    assert first["summary"].startswith("Initialise 0 at a standard scale")
    assert "what it makes is about that many times its input" in first["summary"]


def test_the_first_layer_reset_as_the_report_says_is_healthy(tmp_path, verdict):
    train_hot_first_layer(tmp_path / "reset_first.db", reset=True)
    code, rep = verdict(tmp_path / "reset_first.db")
    assert code == 0, rep["findings"]
