"""A GPT-2-style language model whose output head shares the embedding's weight: the tied
tensor's gradient arrives only after the embedding's backward, the last. Where the head's
backward overflows fp16 (its weight gradient, from a final LayerNorm with a large gain), the
report must name the head, as it does for the same model untied, not the LayerNorm whose
gradient arrived before the tied one."""
import pytest
import torch
from torch import nn

from conftest import amp_training


class TinyLM(nn.Module):
    """`tie`: the head holds the embedding's weight; "functional": no head module, the
    logits are F.linear(h, self.emb.weight) in the model's own forward."""

    def __init__(self, tie, vocab=64, d=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.body = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d))
        self.norm = nn.LayerNorm(d)
        self.head = None if tie == "functional" else nn.Linear(d, vocab, bias=False)
        if tie is True:
            self.head.weight = self.emb.weight
        with torch.no_grad():
            self.norm.weight.fill_(100.0)  # large features into the head

    def forward(self, ids):
        h = self.norm(self.body(self.emb(ids)))
        return nn.functional.linear(h, self.emb.weight) if self.head is None else self.head(h)


def lm_loop(db, tie, steps=12):
    torch.manual_seed(0)
    model = TinyLM(tie)

    def loss_of(g):
        ids = torch.randint(0, 64, (8, 16), generator=g)
        return nn.functional.cross_entropy(model(ids).float().view(-1, 64), ids.view(-1))

    amp_training(db, model, torch.optim.AdamW(model.parameters(), lr=1e-4), steps, loss_of)


def test_logits_from_the_embeddings_weight_in_the_models_own_forward_are_named_as_that_code(tmp_path, verdict):
    # Without a head module the embedding's gradient arrives last, and the report named
    # body.2, below the logits, for their overflow.
    db = tmp_path / "lm.db"
    lm_loop(db, "functional")
    _, rep = verdict(db)
    origins = [f for f in rep["findings"] if f["rule"] == "overflow-origin"]
    assert origins and (origins[0]["module"], origins[0]["layer"]) == ("", "emb.weight"), origins
    assert origins[0]["steps"][0] == 0
    assert "used by the model's own forward() besides its module" in origins[0]["evidence"]


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_the_heads_overflow_is_named_as_the_head_tied_or_not(tmp_path, verdict, tie):
    db = tmp_path / "lm.db"
    lm_loop(db, tie)
    _, rep = verdict(db)
    origins = [f for f in rep["findings"] if f["rule"] == "overflow-origin"]
    assert origins and origins[0]["module"] == "head", origins
    assert origins[0]["layer"] == ("emb.weight" if tie else "head.weight")
    assert "norm" not in [f["module"] for f in origins]
    assert origins[0]["steps"][0] == 0
