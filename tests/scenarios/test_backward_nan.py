"""A module whose backward goes NaN at every loss scale while its forward stays finite: the
agent replays its backward in FP32, and the report pins it only where that replay was
finite (an fp16 intermediate overflowing inside it), and points at its backward, without a
pin, where FP32 made NaN too (a gradient that is infinite in any precision). And a module
without parameters, which gets no replay, whose custom backward takes exp() of its fp16
input: the NaN shows first in the layer before it, and the report pins the module too."""
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


class SoftplusByHand(torch.autograd.Function):
    """A custom activation whose backward takes exp() of its input as it came: in fp16 that
    is Inf above 11, and Inf / Inf is NaN."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.log1p(torch.exp(-x.abs())) + x.clamp(min=0)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        e = torch.exp(x)
        return grad * e / (1 + e)


class Act(nn.Module):
    def forward(self, x):
        return SoftplusByHand.apply(x)


def custom_backward(db, pin=False):
    """fc1 (its bias at 12), act, fc2: SGD, fp16 autocast, a real GradScaler, 24 steps."""
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(fc1=nn.Linear(32, 64), act=Act(), fc2=nn.Linear(64, 1)))
    with torch.no_grad():
        model.fc1.bias.fill_(12.0)
        model.fc1.weight.mul_(0.1)
        model.fc2.weight.mul_(0.01)
    if pin:
        ampdiag.pin_fp32(model.act)  # the report's fix
    opt, scaler = torch.optim.SGD(model.parameters(), lr=1e-5), torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(1)
    with ampdiag.attach(model, scaler, db=db):
        for _ in range(24):
            x, y = torch.randn(32, 32, generator=g), torch.randn(32, 1, generator=g)
            amp_step(opt, scaler, lambda: nn.functional.mse_loss(model(x), y))


def test_a_module_without_parameters_whose_backward_overflows_fp16_is_offered_its_pin(tmp_path, verdict):
    db = tmp_path / "custom.db"
    custom_backward(db)
    code, rep = verdict(db)
    assert code == 1
    origin = next(f for f in rep["findings"] if f["rule"] == "overflow-origin")
    assert origin["module"] == "fc1" and origin["severity"] == "error"
    assert "the backward also ran through act, which holds no parameters" in origin["evidence"]
    pins = [s for s in origin["suggestions"] if "ampdiag.pin_fp32(model.act)" in s["python"]]
    assert len(pins) == 1 and pins[0]["summary"].startswith("If instead a value inside act's backward passes fp16")


def test_that_module_pinned_as_the_report_says_trains_the_same_loop_healthy(tmp_path, verdict):
    db = tmp_path / "custom_pinned.db"
    custom_backward(db, pin=True)
    code, rep = verdict(db)
    assert code == 0, [f["title"] for f in rep["findings"]]


class MaskedSqrt(nn.Module):
    """A square root made "safe" with torch.where, as the report's first fix writes it when
    `clamped`: else its gradient at the masked (negative) values is 0 times NaN."""

    def __init__(self, clamped):
        super().__init__()
        self.clamped = clamped

    def forward(self, x):
        return torch.where(x > 0, (x.clamp_min(1e-12) if self.clamped else x).sqrt(), 0.0)


def masked_sqrt(db, clamped):
    """fc1, a masked square root, fc2: SGD, fp16 autocast, a real GradScaler, 24 steps."""
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(fc1=nn.Linear(16, 64), act=MaskedSqrt(clamped), fc2=nn.Linear(64, 1)))
    opt, scaler = torch.optim.SGD(model.parameters(), lr=1e-3), torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(1)
    with ampdiag.attach(model, scaler, db=db):
        for _ in range(24):
            x, y = torch.randn(32, 16, generator=g), torch.rand(32, 1, generator=g)
            amp_step(opt, scaler, lambda: nn.functional.mse_loss(model(x).float(), y))


def test_a_square_root_masked_with_where_is_looked_at_first_with_the_clamp_before_the_select(tmp_path, verdict):
    db = tmp_path / "masked.db"
    masked_sqrt(db, clamped=False)
    code, rep = verdict(db)
    assert code == 1
    origin = next(f for f in rep["findings"] if f["rule"] == "overflow-origin")
    assert origin["module"] == "fc1" and "act, which holds no parameters" in origin["evidence"]
    look = origin["suggestions"][0]
    assert look["summary"].startswith("Look first at the backward of act, fc1")
    assert "Behind a torch.where that masks such values" in look["summary"]


def test_the_clamp_before_the_select_as_the_report_writes_it_trains_the_same_loop_healthy(tmp_path, verdict):
    db = tmp_path / "clamped.db"
    masked_sqrt(db, clamped=True)
    code, rep = verdict(db)
    assert code == 0, [f["title"] for f in rep["findings"]]
