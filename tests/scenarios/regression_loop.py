"""A small fp16 regression loop that learns (its targets are a function of its inputs),
with a real GradScaler and ampdiag attached: the scenarios change only whether it zeroes
its gradients (and where, over micro-batches) and what runs between backward and
scaler.step()."""
import torch
from torch import nn

import ampdiag


def regression_loop(db, steps, zero_grad=True, between=None, micro=1, zero_each_micro_batch=False):
    """`between(scaler, optimizer, model)` runs after each step's backwards, before
    scaler.step(). Each step accumulates `micro` micro-batches, zeroing once before them, or
    before each with `zero_each_micro_batch`. Returns (the last loss, the final loss scale)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 32, generator=g)
    y = x[:, :1] * 2 + 0.1 * torch.randn(512, 1, generator=g)
    with ampdiag.attach(model, scaler, db=db):
        for _ in range(steps):
            for k in range(micro):
                i = torch.randint(0, 512, (64,), generator=g)
                if zero_grad and (k == 0 or zero_each_micro_batch):
                    opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = nn.functional.mse_loss(model(x[i]).float(), y[i])
                    loss = loss / micro if micro > 1 else loss
                scaler.scale(loss).backward()
            if between is not None:
                between(scaler, opt, model)
            scaler.step(opt)
            scaler.update()
    return loss.item(), scaler.get_scale()
