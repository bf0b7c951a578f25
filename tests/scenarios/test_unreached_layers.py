"""A model whose frozen embedding feeds blocks checkpointed with use_reentrant=True: the
checkpoint's input needs no gradient, so torch gives the blocks none, and only the head
trains. The report said healthy; it warns that most of the values the optimizer holds never
received a gradient. With use_reentrant=False the same loop trains every block, healthy."""
import warnings

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from conftest import amp_training


class FrozenEmbedding(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.reentrant = reentrant
        self.emb = nn.Embedding(100, 64)
        self.emb.weight.requires_grad_(False)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(3))
        self.head = nn.Linear(64, 5)

    def forward(self, ids):
        h = self.emb(ids)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=self.reentrant)
        return self.head(h.mean(1))


def frozen_embedding_loop(db, reentrant):
    torch.manual_seed(0)
    model = FrozenEmbedding(reentrant)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

    def loss_of(g):
        ids, y = torch.randint(0, 100, (16, 12), generator=g), torch.randint(0, 5, (16,), generator=g)
        return nn.functional.cross_entropy(model(ids), y)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own: "None of the inputs have requires_grad=True"
        amp_training(db, model, opt, 12, loss_of)


def test_blocks_a_reentrant_checkpoint_gives_no_gradient_are_unreached_layers(tmp_path, verdict):
    db = tmp_path / "run.db"
    frozen_embedding_loop(db, reentrant=True)
    code, report = verdict(db)
    assert code == 0
    [finding] = report["findings"]
    assert (finding["rule"], finding["severity"]) == ("unreached-layers", "warning")
    assert finding["title"].startswith("6 of the 8 parameters the optimizer holds never received a gradient")
    assert "use_reentrant=False" in finding["suggestions"][0]["python"]


def test_the_same_blocks_checkpointed_without_reentrancy_train_healthy(tmp_path, verdict):
    db = tmp_path / "run.db"
    frozen_embedding_loop(db, reentrant=False)
    code, report = verdict(db)
    assert (code, report["healthy"]) == (0, True), report["findings"]
