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


def train_tied(db, std, steps=12, fix=""):
    torch.manual_seed(0)
    model = TiedLM(std)
    exec(fix, {"model": model, "torch": torch})

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


# Twice as large (6e4 times the standard table): the head's logits pass 65504 in FP32 too, so
# every forward overflows fp16 at the head and no pin of the head alone can help. The report
# led with bfloat16 and the head's pin with the code after it; it now leads with the head's
# re-initialisation, and the report's own line applied trains healthy.

def test_a_tied_head_whose_own_weights_overflow_it_even_in_fp32_is_re_initialised_first(tmp_path, verdict):
    code, rep = overflowing_tied_run(tmp_path, verdict)
    first = rep["findings"][0]
    assert (code, first["rule"], first["module"]) == (1, "forward-nonfinite", "head")
    assert "beyond fp16's largest value" in first["evidence"]
    assert first["suggestions"][0]["python"].startswith('model.get_submodule("head").reset_parameters()')
    assert first["suggestions"][1]["summary"].startswith("Where that gain is by design, ")


def test_the_tied_head_trains_healthy_with_the_reports_re_initialisation(tmp_path, verdict):
    _, rep = overflowing_tied_run(tmp_path, verdict)
    reset = rep["findings"][0]["suggestions"][0]["python"].splitlines()[0]
    db = tmp_path / "fixed.db"
    train_tied(db, 0.02 * 6e4, fix=reset)
    code, fixed = verdict(db)
    assert code == 0, fixed["findings"]


def overflowing_tied_run(tmp_path, verdict):
    db = tmp_path / "overflowing.db"
    train_tied(db, 0.02 * 6e4)
    return verdict(db)
