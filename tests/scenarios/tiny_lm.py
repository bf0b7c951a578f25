"""A small pre-norm LM over 256 tokens whose blocks a scenario supplies, and its fp16 loop
under a loss weighted by 0.01 (an auxiliary loss's weight): what the oversized-branch
scenarios vary is the blocks and which weight starts too large."""
import torch
from torch import nn
import torch.nn.functional as F

from conftest import amp_training


class TinyLm(nn.Module):
    def __init__(self, block, d=64, depth=2):
        super().__init__()
        self.embed, self.norm, self.head = nn.Embedding(256, d), nn.LayerNorm(d), nn.Linear(d, 256)
        self.blocks = nn.ModuleList([block(d) for _ in range(depth)])  # made after the rest, as the seeds expect

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def lm_steps(db, model, steps=20):
    """`steps` fp16 steps of `model` (a TinyLm) on random token batches, with AdamW."""

    def loss_of(g):
        ids = torch.randint(0, 256, (8, 25), generator=g)
        logits = model(ids[:, :-1]).float()
        return 0.01 * F.cross_entropy(logits.reshape(-1, 256), ids[:, 1:].reshape(-1))  # an auxiliary loss's weight

    amp_training(db, model, torch.optim.AdamW(model.parameters(), 3e-4), steps, loss_of)


def oversized_lm_run(db, block, weight, gain):
    """lm_steps() of a TinyLm of `block`s, seeded 0, whose `weight(model)` is multiplied by `gain`."""
    torch.manual_seed(0)
    model = TinyLm(block)
    with torch.no_grad():
        weight(model).mul_(gain)
    lm_steps(db, model)
