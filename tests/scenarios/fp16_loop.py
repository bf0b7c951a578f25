"""The plain fp16 loop most everyday scenarios vary: a small MLP, a real GradScaler, SGD,
ampdiag attached; the scenarios change micro-batches, clipping, zeroing, extra updates and
what runs between the steps. And its bf16 twin, without a scaler."""
import pytest
import torch
from torch import nn

import ampdiag
from conftest import rows


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 1)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def batches(n, size=32):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(size, 16, generator=g), torch.randn(size, 1, generator=g)) for _ in range(n)]


def fp16_loop(db, steps=12, micro=1, hold_min_scale=None, clip=False, set_to_none=True, model=None, two_losses=False,
              between_steps=None):
    """A plain fp16 loop with a real GradScaler; returns (the losses the user saw per step,
    skipped flags). `between_steps(step, model, x)` runs before each step (an evaluation)."""
    torch.manual_seed(0)
    model = model or Mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=1000)
    seen, skipped = [], []
    with ampdiag.attach(model, scaler, db=db) as handle:
        data = batches(steps * micro)
        for step in range(steps):
            if between_steps:
                between_steps(step, model, data[step * micro][0])
            opt.zero_grad(set_to_none=set_to_none)
            total = 0.0
            for k in range(micro):
                x, y = data[step * micro + k]
                with torch.autocast("cpu", dtype=torch.float16):
                    out = model(x).float()
                    loss = nn.functional.mse_loss(out, y) / micro
                    second = out.abs().mean() * 0.1 if two_losses else None
                scaler.scale(loss).backward(retain_graph=two_losses)
                total += loss.item()
                if two_losses:
                    scaler.scale(second).backward()
                    total += second.item()
            if clip:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            if hold_min_scale is not None and scaler.get_scale() < hold_min_scale:
                scaler.update(hold_min_scale)  # NVIDIA's recipe: never below a floor
            seen.append(total)
            skipped.append(handle.last_step_skipped)
    return seen, skipped


def bf16_loop(db, model, steps):
    """A bf16 loop without a scaler; asserts that every step recorded the one loss the user
    saw."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen = []
    with ampdiag.attach(model, optimizer=opt, db=db):
        for x, y in batches(steps):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            loss.backward()
            opt.step()
            seen.append(loss.item())
    recorded = rows(db, "SELECT loss, losses FROM steps ORDER BY step")
    assert [n for _, n in recorded] == [1] * steps
    assert [loss for loss, _ in recorded] == pytest.approx(seen)


def train(db, model, steps, loss_of, gradient=None, **scaler_options):
    """An SGD loop with a real GradScaler; `loss_of(step, model)` runs the forward (its own
    autocast) and returns the loss, or an output whose backward starts from `gradient(output)`."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu", **scaler_options)
    with ampdiag.attach(model, scaler, db=db):
        for step in range(steps):
            opt.zero_grad()
            loss = loss_of(step, model)
            scaler.scale(loss).backward(gradient(loss) if gradient else None)
            scaler.step(opt)
            scaler.update()
