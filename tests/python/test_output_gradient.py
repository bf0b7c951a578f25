"""The gradient that reaches the model's output in backward: NaN/Inf there was made by the
loss code's backward, before any module, and is one "output-gradient-nonfinite" event in
its step; a float16 output's Inf alone may be fp16's own overflow, and is not one."""
import sqlite3

import torch
from torch import nn

import ampdiag


def events(db):
    with sqlite3.connect(db) as c:
        return c.execute("SELECT step, detail FROM events WHERE kind = 'output-gradient-nonfinite'").fetchall()


def train(db, loss_of, autocast_dtype=None, steps=2):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with ampdiag.attach(model, scaler, db=db):
        for _ in range(steps):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16, enabled=autocast_dtype is not None):
                out = model(torch.randn(6, 8))
            scaler.scale(loss_of(out)).backward()
            scaler.step(opt)
            scaler.update()


def self_distance(out):
    z = out.float()
    return ((z[:, None] - z[None]) ** 2).sum(-1).sqrt().mean()  # sqrt(0) on the diagonal


def test_a_nan_made_by_the_losss_backward_is_one_event_a_step_with_its_counts(tmp_path):
    db = tmp_path / "run.db"
    train(db, self_distance)
    assert events(db) == [(0, "float32 [6, 4]: 24 NaN, 0 Inf of 24 values"),
                          (1, "float32 [6, 4]: 24 NaN, 0 Inf of 24 values")]


def test_the_same_through_a_float16_output_is_seen_past_the_cast(tmp_path):
    db = tmp_path / "run.db"
    train(db, self_distance, autocast_dtype=torch.float16, steps=1)
    assert events(db) == [(0, "float16 [6, 4]: 24 NaN, 0 Inf of 24 values")]


def test_a_float16_outputs_gradient_overflowing_to_inf_alone_is_fp16s_and_no_event(tmp_path):
    # 65536 x 1e6 is no float16: .float()'s backward casts it to Inf where it enters the output.
    db = tmp_path / "run.db"
    train(db, lambda out: out.float().sum() * 1e6, autocast_dtype=torch.float16, steps=1)
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT skipped FROM steps").fetchall() == [(1,)]
    assert events(db) == []


def test_a_finite_loss_gradient_is_no_event(tmp_path):
    db = tmp_path / "run.db"
    train(db, lambda out: out.float().pow(2).mean(), autocast_dtype=torch.float16)
    assert events(db) == []


class FeaturesAndLogits(nn.Module):
    """Returns the features its head takes, first, beside the logits times `gain`."""

    def __init__(self, gain):
        super().__init__()
        self.body, self.head, self.gain = nn.Linear(8, 16), nn.Linear(16, 4), gain

    def forward(self, x):
        features = self.body(x)
        return features, self.head(features) * self.gain


def train_two_outputs(db, gain, loss_of):
    torch.manual_seed(0)
    model = FeaturesAndLogits(gain)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with ampdiag.attach(model, scaler, db=db):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            _, logits = model(torch.randn(6, 8))
        scaler.scale(loss_of(logits)).backward()
        scaler.step(opt)
        scaler.update()


def test_features_returned_beside_the_logits_are_not_where_backward_starts(tmp_path):
    # The gain's fp16 backward overflows inside the model, then the head's backward hands the
    # features NaN/Inf: the loss made none of it.
    db = tmp_path / "run.db"
    train_two_outputs(db, 3000.0, lambda logits: nn.functional.cross_entropy(logits.float(), torch.arange(6) % 4))
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT skipped FROM steps").fetchall() == [(1,)]
    assert events(db) == []


def test_the_losss_nan_is_seen_at_the_logits_returned_after_the_features(tmp_path):
    db = tmp_path / "run.db"
    train_two_outputs(db, 1.0, self_distance)
    assert events(db) == [(0, "float16 [6, 4]: 24 NaN, 0 Inf of 24 values")]


class MaskAndLogits(nn.Module):
    """Returns a float mask that no gradient reaches, first, beside the logits."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return torch.ones(x.shape[0], 1), self.head(x)


def test_the_losss_nan_is_seen_past_an_output_no_gradient_reaches(tmp_path):
    db = tmp_path / "run.db"
    torch.manual_seed(0)
    model = MaskAndLogits()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with ampdiag.attach(model, scaler, db=db):
        opt.zero_grad()
        _, logits = model(torch.randn(6, 8))
        scaler.scale(self_distance(logits)).backward()
        scaler.step(opt)
        scaler.update()
    assert events(db) == [(0, "float32 [6, 4]: 24 NaN, 0 Inf of 24 values")]
