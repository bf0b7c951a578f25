"""A top-1 mixture of experts (Switch-style routing): each step only some experts get
tokens, so the others' gradients stay None, or zeros, and experts are first called at
different steps."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampdiag


class Expert(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class MoE(nn.Module):
    def __init__(self, d=32, h=64, n=8):
        super().__init__()
        self.router = nn.Linear(d, n)
        self.experts = nn.ModuleList(Expert(d, h) for _ in range(n))

    def forward(self, x):
        gate, idx = self.router(x).float().softmax(-1).max(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            sel = (idx == e).nonzero(as_tuple=True)[0]
            if sel.numel():
                out = out.index_add(0, sel, (expert(x[sel]) * gate[sel, None].to(x.dtype)).to(out.dtype))
        return out


class Net(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.inp = nn.Linear(16, d)
        self.moe = MoE(d)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        h = self.inp(x)
        return self.head(self.norm(h) + self.moe(h))


def train(db, dtype=torch.float16, set_to_none=True, expert_gain=1.0, steps=60):
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():
        model.moe.experts[3].fc1.weight.mul_(expert_gain)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)
    g = torch.Generator().manual_seed(0)
    with ampdiag.attach(model, scaler, db=db):
        for _ in range(steps):
            opt.zero_grad(set_to_none=set_to_none)
            x = torch.randn(6, 16, generator=g)  # six tokens for eight experts: some idle every step
            with torch.autocast("cpu", dtype=dtype):
                loss = F.mse_loss(model(x).float(), x[:, :1] * 0.5)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
    return db


@pytest.mark.parametrize("dtype,set_to_none", [(torch.float16, True), (torch.float16, False), (torch.bfloat16, True)],
                         ids=["fp16-none", "fp16-zeros", "bf16"])
def test_a_healthy_mixture_of_experts_with_idle_experts_is_healthy(tmp_path, verdict, dtype, set_to_none):
    code, rep = verdict(train(tmp_path / "moe.db", dtype, set_to_none))
    assert code == 0, rep["findings"]
    assert [f for f in rep["findings"] if f["severity"] != "info"] == [], rep["findings"]


def test_an_expert_with_oversized_weights_is_named_and_the_steps_that_route_to_it_are_told_apart(tmp_path, verdict):
    code, rep = verdict(train(tmp_path / "moe.db", expert_gain=3000.0))
    assert code == 1
    oversized = [f for f in rep["findings"] if f["rule"] == "oversized-weights"]
    assert [f["module"] for f in oversized] == ["moe.experts.3.fc1"], rep["findings"]
    # The loss is large only in the steps routed to that expert, which the sampled steps
    # may never see: not the targets, the same every step.
    shrink = next(f for f in rep["findings"] if f["rule"] == "overflow-origin")["suggestions"][0]["summary"]
    assert "in the steps where its gradients overflowed, against" in shrink
    assert "a branch or an expert only they take" in shrink and "normalise the regression targets" not in shrink
