"""A small LM whose logits are softcapped by tanh, as nanochat's and Gemma's are, under an
lm_head whose weights start 1e4 times too large: the cap saturates, most of the head's
gradient is exactly zero in any precision and the loss stays far above chance's, yet
nothing overflows. The report called it healthy; the oversized head is now a warning, its
re-initialisation the fix, and the same loop with the head at torch's default is healthy."""
import torch
from torch import nn

from conftest import amp_training


class SoftcappedLM(nn.Module):
    def __init__(self, vocab=256, d=64, cap=15.0):
        super().__init__()
        self.cap = cap
        self.emb = nn.Embedding(vocab, d)
        self.block = nn.TransformerEncoderLayer(d, 4, 128, dropout=0.0, batch_first=True, norm_first=True)
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        logits = self.head(self.norm(self.block(self.emb(ids))))
        return self.cap * torch.tanh(logits / self.cap)


def train(db, gain):
    torch.manual_seed(0)
    model = SoftcappedLM()
    with torch.no_grad():
        model.head.weight.mul_(gain)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def loss_of(g):
        ids = torch.randint(0, 256, (8, 24), generator=g)
        return nn.functional.cross_entropy(model(ids[:, :-1]).float().flatten(0, 1), ids[:, 1:].flatten())

    amp_training(db, model, opt, 20, loss_of)


def test_an_oversized_head_that_saturates_its_softcap_is_a_warning(tmp_path, verdict):
    train(tmp_path / "run.db", 1e4)
    code, rep = verdict(tmp_path / "run.db")
    assert code == 0 and not rep["healthy"]
    first = rep["findings"][0]
    assert (first["rule"], first["severity"], first["layer"]) == ("oversized-weights", "warning", "head.weight")
    assert "of its own gradient was exactly zero, what takes its outputs saturated" in first["title"]
    assert first["suggestions"][0]["python"].startswith('model.get_submodule("head").reset_parameters()')


def test_the_same_lm_with_its_head_at_the_default_initialisation_is_healthy(tmp_path, verdict):
    train(tmp_path / "run.db", 1.0)
    code, rep = verdict(tmp_path / "run.db")
    assert (code, rep["healthy"]) == (0, True), [f["title"] for f in rep["findings"]]
