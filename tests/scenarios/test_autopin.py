"""attach(autopin=N): a module whose FP32 replay confirmed it as the origin of a NaN/Inf in
forward runs in FP32 from the next step on, the report says so with the skips after it,
and nothing unconfirmed or beyond the limit is pinned."""
import torch
from torch import nn

import ampdiag as agent
from conftest import rows


class Scores(nn.Module):
    """q @ k^T times a gain that overflows fp16 (but not FP32)."""

    def __init__(self, gain):
        super().__init__()
        self.q, self.gain = nn.Linear(16, 16), gain

    def forward(self, x):
        return (self.q(x) @ x.transpose(1, 2) * self.gain).softmax(-1) @ x


class Model(nn.Module):
    def __init__(self, gains):
        super().__init__()
        self.blocks = nn.ModuleList([Scores(g) for g in gains])
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x).mean()


def train(model, db, steps=8, **options):
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    x = torch.randn(4, 8, 16)
    skips = []
    handle = agent.attach(model, scaler, db=db, **options)
    for _ in range(steps):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float()
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skips.append(scaler.get_scale() < before)
    handle.close()
    return skips


def test_a_confirmed_module_is_pinned_from_the_next_step_and_the_report_says_what_followed(tmp_path, ampdiag):
    torch.manual_seed(0)
    db = tmp_path / "auto.db"
    skips = train(Model([3e4]), db, autopin=True)
    assert skips[0] and not any(skips[1:])  # the overflow stops once blocks.0 runs in FP32
    assert rows(db, "SELECT step, detail FROM events WHERE kind = 'autopin'") == [(1, "blocks.0")]
    report = __import__("json").loads(ampdiag("report", db, "--format", "json").stdout)
    pinned = [f for f in report["findings"] if f["rule"] == "autopin"]
    assert len(pinned) == 1
    assert pinned[0]["title"] == "auto-pinned blocks.0 to FP32 at step 1; after it, 0 skips"
    assert "ampdiag.pin_fp32(model.blocks[0])" in pinned[0]["suggestions"][0]["python"]


def test_without_autopin_the_overflow_goes_on(tmp_path):
    torch.manual_seed(0)
    skips = train(Model([3e4]), tmp_path / "plain.db")
    assert all(skips)


def test_never_more_modules_than_the_limit(tmp_path):
    torch.manual_seed(0)
    db = tmp_path / "limit.db"
    # blocks.1's overflow only shows once blocks.0 no longer makes NaN of everything.
    train(Model([3e4, 3e4]), db, autopin=1)
    assert [d for (d,) in rows(db, "SELECT detail FROM events WHERE kind = 'autopin'")] == ["blocks.0"]
    assert len(rows(db, "SELECT detail FROM events WHERE kind = 'autopin-limit'")) == 1


def test_the_model_is_restored_when_the_handle_closes(tmp_path):
    torch.manual_seed(0)
    model = Model([3e4])
    forward = type(model.blocks[0]).forward
    train(model, tmp_path / "restore.db", autopin=True)
    assert "forward" not in model.blocks[0].__dict__ and type(model.blocks[0]).forward is forward


def test_autopin_needs_the_replay_that_confirms(tmp_path):
    import pytest
    with pytest.raises(ValueError, match="autopin needs activations=True and replay=True"):
        agent.attach(Model([1.0]), torch.amp.GradScaler("cpu"), db=tmp_path / "x.db", autopin=True, replay=False)
