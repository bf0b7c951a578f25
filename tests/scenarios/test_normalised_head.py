"""An ArcFace head (additive angular margin, scale 64) whose class centres are normalised in
the forward, F.normalize(W) from 0.01 * randn, under SGD at 0.1: W's gradient is 1 / |W|
times larger, so W grows about 30x in its first steps while the scaler calibrates, and then
the run trains, its loss falling. The report failed it as weights grown by a learning rate
far too large; the growth harmed nothing, and the run is healthy."""
import math

import torch
from torch import nn
import torch.nn.functional as F

from conftest import amp_training


class ArcFace(nn.Module):
    def __init__(self, dim, classes, scale=64.0, margin=0.5):
        super().__init__()
        self.W = nn.Parameter(torch.randn(classes, dim) * 0.01)
        self.scale, self.margin = scale, margin

    def forward(self, x, y):
        cos = F.linear(F.normalize(x), F.normalize(self.W))
        sin = torch.sqrt((1.0 - cos * cos).clamp_min(1e-6))
        phi = cos * math.cos(self.margin) - sin * math.sin(self.margin)
        target = F.one_hot(y, cos.shape[1]).to(cos.dtype)
        return self.scale * (target * phi + (1 - target) * cos)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 128))
        self.head = ArcFace(128, 50)

    def forward(self, x, y):
        return self.head(self.body(x), y)


def test_an_arcface_head_whose_normalised_centres_grow_while_the_scale_calibrates_is_healthy(tmp_path, verdict):
    torch.manual_seed(0)
    model, centres = Net(), torch.randn(50, 32)

    def loss_of(g):
        y = torch.randint(0, 50, (128,), generator=g)
        x = centres[y] + 0.3 * torch.randn(128, 32, generator=g)
        return F.cross_entropy(model(x, y), y)

    db = tmp_path / "run.db"
    amp_training(db, model, torch.optim.SGD(model.parameters(), 0.1, momentum=0.9), 40, loss_of)
    code, report = verdict(db)
    assert (code, report["healthy"]) == (0, True), report["findings"]
    growth = [f for f in report["findings"] if f["rule"] == "weight-growth"]
    assert [(f["severity"], f["module"]) for f in growth] == [("info", "head")]
