"""A module whose backward goes NaN at every loss scale while its forward stays finite: the
agent replays its backward in FP32, and the report pins it only where that replay was
finite (an fp16 intermediate overflowing inside it), and points at its backward, without a
pin, where FP32 made NaN too (a gradient that is infinite in any precision)."""
from collections import OrderedDict

import torch
from torch import nn

import ampdiag
from conftest import amp_step


class TanhGelu(nn.Module):  # GPT-2's GELU as Hugging Face writes it: x ** 3 overflows fp16
    def forward(self, h):
        return 0.5 * h * (1 + torch.tanh(0.7978845608 * (h + 0.044715 * h ** 3)))


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(16, 64), TanhGelu(), nn.Linear(64, 16)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Distances(nn.Module):  # each point's distance to itself is sqrt(0)
    def __init__(self):
        super().__init__()
        self.enc, self.proj = nn.Linear(16, 32), nn.Linear(16, 16)

    def forward(self, x):
        z = self.enc(x).float()
        return self.proj(((z[:, None] - z[None]) ** 2).sum(-1).sqrt()[:, :16])


def train(db, block, readings=255.0, pin=False):
    """Raw sensor readings up to `readings` (not normalised) through `block`, a LayerNorm
    and a head: AdamW, fp16 autocast, a real GradScaler, 24 steps."""
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(block=block(), norm=nn.LayerNorm(16), head=nn.Linear(16, 1)))
    if pin:
        ampdiag.pin_fp32(model.block)  # the report's fix
    opt, scaler = torch.optim.AdamW(model.parameters(), lr=1e-3), torch.amp.GradScaler("cpu")
    with ampdiag.attach(model, scaler, db=db):
        for _ in range(24):
            x = torch.rand(32, 16) * readings
            amp_step(opt, scaler, lambda: nn.functional.mse_loss(model(x).float(), x.mean(1, keepdim=True) / readings))


def test_a_nan_an_fp16_intermediate_makes_in_backward_is_pinned_once_fp32_is_replayed_finite(tmp_path, verdict):
    db = tmp_path / "gelu.db"
    train(db, Mlp)
    code, rep = verdict(db)
    assert code == 1
    origin = next(f for f in rep["findings"] if f["rule"] == "overflow-origin")
    assert origin["module"] == "block" and origin["severity"] == "error"
    assert origin["title"].endswith("in FP32 its backward is finite (replayed)")
    assert "ampdiag.pin_fp32(model.block)" in origin["suggestions"][0]["python"]
    assert not any(s["summary"].startswith("Look first") for s in origin["suggestions"])
    collapse = next(f for f in rep["findings"] if f["rule"] == "scale-collapse")
    assert collapse["suggestions"][0]["summary"].startswith("Fix the overflow in block ")


def test_the_pin_the_replay_confirmed_trains_the_same_loop_healthy(tmp_path, verdict):
    db = tmp_path / "gelu_pinned.db"
    train(db, Mlp, pin=True)
    code, rep = verdict(db)
    assert (code, rep["healthy"]) == (0, True), [f["title"] for f in rep["findings"]]


def test_a_nan_made_in_any_precision_inside_a_module_gets_no_pin(tmp_path, verdict):
    db = tmp_path / "sqrt.db"
    train(db, Distances, readings=1.0)
    code, rep = verdict(db)
    assert code == 1
    origin = next(f for f in rep["findings"] if f["rule"] == "overflow-origin")
    assert origin["module"] == "block"
    assert origin["title"].endswith("its backward makes NaN/Inf in FP32 too (replayed)")
    assert origin["suggestions"][0]["summary"].startswith("Look first at the backward of block")
    assert not any("pin_fp32" in s["python"] for f in rep["findings"] for s in f["suggestions"])
