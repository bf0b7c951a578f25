"""A small LM whose head shares the embedding's table (tied weights, as GPT-2, BART and T5 do).
The table is recorded once, under the embedding, whose rows are looked up and not summed
over; the head multiplies by it as a Linear over the model's width. Initialised 3e4 times
too large (Hugging Face's BART so: a loss of 36000 that did not move), the report had called
the run healthy; it now names the head's weight by its use, with the table's own name."""
import torch
from torch import nn

from conftest import amp_training


class TiedLM(nn.Module):
    def __init__(self, std):
        super().__init__()
        self.emb = nn.Embedding(128, 64)
        nn.init.normal_(self.emb.weight, std=std)
        self.block = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, 128, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.norm(self.block(self.emb(ids))))


def train_tied(db, std, steps=12):
    torch.manual_seed(0)
    model = TiedLM(std)

    def loss_of(g):
        ids = torch.randint(0, 128, (8, 24), generator=g)
        return nn.functional.cross_entropy(model(ids[:, :-1]).float().reshape(-1, 128), ids[:, 1:].reshape(-1))

    amp_training(db, model, torch.optim.AdamW(model.parameters(), 1e-3), steps, loss_of)


def test_a_tied_head_far_too_large_is_named_by_its_use(tmp_path, verdict):
    db = tmp_path / "run.db"
    train_tied(db, 0.02 * 3e4)
    code, rep = verdict(db)
    [o] = [f for f in rep["findings"] if f["rule"] == "oversized-weights"]
    assert o["title"].startswith("head.weight (the same tensor as emb.weight) starts at a gain of")
    assert o["module"] == "head"


def test_a_tied_head_at_a_standard_scale_is_not_oversized(tmp_path, verdict):
    db = tmp_path / "run.db"
    train_tied(db, 0.02)
    code, rep = verdict(db)
    assert code == 0, rep["findings"]
    assert not [f for f in rep["findings"] if f["rule"] == "oversized-weights"]
