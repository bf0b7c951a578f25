"""An RMSNorm written as Llama's, its eps set to 0, after an embedding whose padding row
padding_idx keeps at zero: at every padded position rsqrt(0) is Inf in any precision and 0
times it NaN, so the loss is NaN from the first step. The report named the norm and said to
look at its code; it now says to keep the root off 0 with an eps, and the same loop with
Llama's 1e-6 is healthy."""
import torch
from torch import nn

from conftest import amp_training


class RMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x):
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype)


class PaddedLM(nn.Module):
    def __init__(self, eps, vocab=64, d=32):
        super().__init__()
        self.emb, self.norm, self.head = nn.Embedding(vocab, d, padding_idx=0), RMSNorm(d, eps), nn.Linear(d, vocab)

    def forward(self, ids):
        return self.head(self.norm(self.emb(ids)))


def train(db, eps):
    torch.manual_seed(0)
    model = PaddedLM(eps)

    def loss_of(g):
        ids = torch.randint(1, 64, (8, 16), generator=g)
        ids[:, 12:] = 0  # right padding
        return nn.functional.cross_entropy(model(ids).float().flatten(0, 1), ids.roll(-1, 1).flatten())

    amp_training(db, model, torch.optim.AdamW(model.parameters(), lr=1e-3), 12, loss_of)


def test_a_norm_without_eps_on_padding_is_told_to_keep_its_root_off_zero(tmp_path, top_finding):
    train(tmp_path / "run.db", 0.0)
    code, first = top_finding(tmp_path / "run.db")
    assert (code, first["rule"], first["module"]) == (1, "forward-nonfinite", "norm")
    assert first["suggestions"][0]["summary"].startswith("Keep what norm's own code takes the reciprocal square root "
                                                         "of (Rsqrt) off 0"), first["suggestions"][0]["summary"]


def test_the_same_norm_with_llamas_eps_is_healthy(tmp_path, verdict):
    train(tmp_path / "run.db", 1e-6)
    code, rep = verdict(tmp_path / "run.db")
    assert (code, rep["healthy"]) == (0, True), [f["title"] for f in rep["findings"]]
