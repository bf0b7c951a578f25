"""A RealNVP-style normalizing flow (affine couplings, tanh-bounded log-scales) trained by
maximum likelihood on data nobody standardised. Each coupling's backward multiplies the
gradient by the coupled half of its input, so on data of spread up to 14 the scaled
gradients pass 65504 in coupling after coupling and the scale collapses. The report had told
to pin the last coupling's scale net, the first to overflow: pinned, the next coupling's
overflow kept the scale where it was. No fix around one module lifts a scale that other
layers' own gradients hold below the floor, and the report now says so; bf16 trains it, and
so does fp16 on standardised data."""
import math

import torch
from torch import nn

import ampdiag

DIM = 16


class Coupling(nn.Module):
    def __init__(self, flip):
        super().__init__()
        self.flip = flip
        self.net = nn.Sequential(nn.Linear(DIM // 2, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                                 nn.Linear(128, DIM))

    def forward(self, x):
        x1, x2 = x.chunk(2, 1)
        if self.flip:
            x1, x2 = x2, x1
        log_scale, shift = self.net(x1).chunk(2, 1)
        log_scale = torch.tanh(log_scale)
        y2 = x2 * torch.exp(log_scale) + shift
        return torch.cat([y2, x1] if self.flip else [x1, y2], 1), log_scale.sum(1)


class Flow(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Coupling(i % 2 == 1) for i in range(8))

    def forward(self, x):
        log_det = 0
        for layer in self.layers:
            x, ld = layer(x)
            log_det = log_det + ld
        return x, log_det


def train_flow(db, data_scale, dtype=torch.float16, steps=30):
    torch.manual_seed(0)
    model = Flow()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    fp16 = dtype == torch.float16
    scaler = torch.amp.GradScaler("cpu", enabled=fp16)
    with ampdiag.attach(model, scaler if fp16 else None, opt, db=db):
        for step in range(steps):
            g = torch.Generator().manual_seed(step)
            x = (torch.randn(256, DIM, generator=g) * torch.linspace(0.1, 3, DIM)).cumsum(1) * data_scale
            with torch.autocast("cpu", dtype=dtype):
                z, log_det = model(x)
                nll = (0.5 * (z.float() ** 2).sum(1) + 0.5 * DIM * math.log(2 * math.pi) - log_det.float()).mean()
            scaler.scale(nll).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()


def test_a_flow_on_unstandardised_data_is_offered_no_pin_that_other_layers_would_undo(tmp_path, verdict):
    db = tmp_path / "run.db"
    train_flow(db, data_scale=2.0)
    code, rep = verdict(db)
    assert code == 1
    top = rep["findings"][0]
    assert (top["rule"], top["module"]) == ("overflow-origin", "layers.7.net.4")
    assert "so pinning layers.7.net.4 alone would leave the scale below the floor" in top["evidence"]
    assert [s["summary"][:17] for s in top["suggestions"]] == ["Train in bfloat16"]


def test_the_same_flow_in_bfloat16_is_healthy(tmp_path, verdict):
    db = tmp_path / "run.db"
    train_flow(db, data_scale=2.0, dtype=torch.bfloat16)
    code, rep = verdict(db)
    assert code == 0, rep["findings"]


def test_the_same_flow_on_standardised_data_is_healthy(tmp_path, verdict):
    db = tmp_path / "run.db"
    train_flow(db, data_scale=0.1)
    code, rep = verdict(db)
    assert code == 0, rep["findings"]
