"""BLIP-2's Q-Former in miniature: learned query tokens that Hugging Face initialises to
zeros (for loading pretrained weights), a LayerNorm with BERT's eps of 1e-12, self-attention
over the queries, then cross-attention to the image. The self-attention of zeros is zeros,
so the norm after it normalises an input with no spread, and its backward multiplies the
gradient by 1/sqrt(eps) = 1e6: the scale fell to 1 with every step skipped, and the report
named the attention output with only a pin. It now names the flat norm and leads with the
query tokens' initialisation, with which the same loop is healthy."""
import torch
from torch import nn

from conftest import amp_training


class QueryPooler(nn.Module):
    def __init__(self, zero_queries):
        super().__init__()
        self.query_tokens = nn.Parameter(torch.zeros(1, 8, 64) if zero_queries else torch.randn(1, 8, 64) * 0.02)
        self.encoder = nn.Linear(48, 64)
        self.norm = nn.LayerNorm(64, eps=1e-12)
        self.self_attn = nn.MultiheadAttention(64, 4, batch_first=True)
        self.output = nn.ModuleDict(dict(dense=nn.Linear(64, 64), norm=nn.LayerNorm(64, eps=1e-12)))
        self.cross_attn = nn.MultiheadAttention(64, 4, batch_first=True)
        self.head = nn.Linear(64, 10)
        for attn in (self.self_attn, self.cross_attn):
            nn.init.zeros_(attn.in_proj_bias)
            nn.init.zeros_(attn.out_proj.bias)
        nn.init.zeros_(self.output["dense"].bias)

    def forward(self, patches):
        image = self.encoder(patches)
        q = self.norm(self.query_tokens.expand(len(patches), -1, -1))
        q = self.output["norm"](self.output["dense"](self.self_attn(q, q, q, need_weights=False)[0]) + q)
        q = q + self.cross_attn(q, image, image, need_weights=False)[0]
        return self.head(q.mean(1))


def train(db, zero_queries):
    torch.manual_seed(0)
    model = QueryPooler(zero_queries)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def loss_of(g):
        patches, labels = torch.randn(8, 16, 48, generator=g), torch.randint(0, 10, (8,), generator=g)
        return nn.functional.cross_entropy(model(patches).float(), labels)

    amp_training(db, model, opt, 12, loss_of)


def test_query_tokens_of_zeros_under_a_norm_lead_with_their_initialisation(tmp_path, verdict):
    train(tmp_path / "run.db", True)
    code, rep = verdict(tmp_path / "run.db")
    assert code == 1
    first = rep["findings"][0]
    assert first["rule"] == "overflow-origin"
    assert "output.norm (LayerNorm)" in first["evidence"] and "normalised an input with next to no spread" in first["evidence"]
    assert first["suggestions"][0]["summary"].startswith("Initialise query_tokens away from zero")
    assert first["suggestions"][0]["python"].startswith('torch.nn.init.normal_(model.get_parameter("query_tokens"), std=0.02)')


def test_the_same_queries_initialised_as_the_fix_says_train_healthy(tmp_path, verdict):
    train(tmp_path / "run.db", False)
    code, rep = verdict(tmp_path / "run.db")
    assert (code, rep["healthy"]) == (0, True), [f["title"] for f in rep["findings"]]
