"""Sharpness-aware minimisation (SAM) under a GradScaler: two forward/backward passes a step,
the first's gradients taken for an ascent step written into the parameters in place. A loop
that takes that ascent on gradients the scale overflowed puts NaN into the parameters before
any optimizer step, then steps the base optimizer itself (a second unscale_() raises, so the
scaler is left out): the report said the NaN came with the model. It now says code outside
the optimizer wrote it, after the optimizer that stepped outside the scaler. The loop that
takes the ascent only on finite gradients and updates the scaler before the second backward
is healthy."""
import torch
import torch.nn.functional as F
from torch import nn

import ampdiag


class SAM(torch.optim.Optimizer):
    """davda54/sam's optimizer, as users copy it."""

    def __init__(self, params, base_optimizer, rho=0.05, **kwargs):
        super().__init__(params, dict(rho=rho, **kwargs))
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def first_step(self):
        norm = torch.stack([p.grad.norm() for g in self.param_groups for p in g["params"] if p.grad is not None]).norm()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["old_p"] = p.data.clone()
                    p.add_(p.grad * (group["rho"] / (norm + 1e-12)))
        self.zero_grad()

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data = self.state[p]["old_p"]
        self.base_optimizer.step()


def train(db, careful):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(16, 10))
    opt = SAM(model.parameters(), torch.optim.SGD, lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24)  # the first backwards overflow as it calibrates
    g = torch.Generator().manual_seed(0)
    with ampdiag.attach(model, scaler, opt, db=db):
        for _ in range(12):
            x, y = torch.randn(16, 3, 8, 8, generator=g), torch.randint(0, 10, (16,), generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            if careful:
                if all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None):
                    opt.first_step()
                else:
                    opt.zero_grad()
                scaler.update()
            else:
                opt.first_step()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            if careful:
                scaler.step(opt)
            else:
                opt.step()  # a second scaler.unscale_(opt) would raise: the scaler is left out
            scaler.update()
            opt.zero_grad()


def test_an_ascent_on_overflowed_gradients_is_code_outside_the_optimizer_not_the_model(tmp_path, verdict):
    train(tmp_path / "run.db", careful=False)
    code, rep = verdict(tmp_path / "run.db")
    assert code == 1
    assert rep["findings"][0]["rule"] == "optimizer-outside-scaler"
    parameters = next(f for f in rep["findings"] if f["rule"] == "nonfinite-parameters")
    assert parameters["title"].endswith("before any optimizer step recorded: code outside the optimizer wrote them")
    assert "sharpness-aware (SAM) first_step()" in parameters["suggestions"][0]["summary"]


def test_the_ascent_on_finite_gradients_with_the_scaler_updated_between_is_healthy(tmp_path, verdict):
    train(tmp_path / "run.db", careful=True)
    code, rep = verdict(tmp_path / "run.db")
    assert (code, rep["healthy"]) == (0, True), [f["title"] for f in rep["findings"]]
