"""A PPO-style actor-critic update whose value head regresses returns of around 500, not
normalised: the value loss is around 1e5, and the gradient it sends into the head passes
65504 at high scales while the head's own sum over the minibatch does down to a scale of 128.
The report said the code after the head made them and told to pin it; the loss's size makes
them, and the same loop on normalised returns is healthy."""
import torch
from torch import nn
import torch.nn.functional as F

import ampdiag


class ActorCritic(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh())
        self.pi = nn.Linear(128, 6)
        self.v = nn.Linear(128, 1)

    def forward(self, x):
        h = self.body(x)
        return self.pi(h), self.v(h).squeeze(-1)


def ppo_loop(db, normalise):
    torch.manual_seed(0)
    model = ActorCritic()
    opt = torch.optim.Adam(model.parameters(), 3e-4, eps=1e-5)
    scaler = torch.amp.GradScaler("cpu")
    with ampdiag.attach(model, scaler, opt, db=str(db)):
        for rollout in range(8):
            g = torch.Generator().manual_seed(rollout)
            obs, act = torch.randn(512, 16, generator=g), torch.randint(0, 6, (512,), generator=g)
            old_logp = torch.log_softmax(torch.randn(512, 6, generator=g), -1).gather(1, act[:, None]).squeeze(1)
            returns, adv = 500.0 * (1 + 0.3 * torch.randn(512, generator=g)), torch.randn(512, generator=g)
            if normalise:
                returns = (returns - returns.mean()) / (returns.std() + 1e-8)
            for mb in torch.randperm(512, generator=g).split(128):
                with torch.autocast("cpu", dtype=torch.float16):
                    logits, value = model(obs[mb])
                    ratio = torch.exp(torch.log_softmax(logits.float(), -1).gather(1, act[mb, None]).squeeze(1) - old_logp[mb])
                    policy = -torch.min(ratio * adv[mb], ratio.clamp(0.8, 1.2) * adv[mb]).mean()
                    loss = policy + 0.5 * F.mse_loss(value.float(), returns[mb])
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)


def test_a_value_loss_on_unnormalised_returns_is_told_to_shrink_the_loss(tmp_path, verdict):
    db = tmp_path / "run.db"
    ppo_loop(db, False)
    code, report = verdict(db)
    assert code == 1
    first = report["findings"][0]
    assert (first["rule"], first["module"]) == ("overflow-origin", "v")
    assert first["title"].startswith("v's gradients are too large for a loss scale above the floor of 128")
    assert "the gradient reaching v's output already held NaN/Inf: the loss's own" in first["evidence"]
    fix = first["suggestions"][0]
    assert fix["summary"].startswith("Shrink the loss where it is made (it is around ")
    assert "normalise the regression targets to unit spread" in fix["summary"]


def test_the_same_loop_on_normalised_returns_is_healthy(tmp_path, verdict):
    db = tmp_path / "run.db"
    ppo_loop(db, True)
    code, report = verdict(db)
    assert (code, report["healthy"]) == (0, True), report["findings"]
