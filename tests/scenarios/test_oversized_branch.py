"""A small pre-norm LM with Phi's parallel blocks (attention and MLP read one norm's output
and both add to the residual stream) whose first MLP projection starts 3e4 times too large:
its branch dwarfs the attention's in the stream, the norms after it divide every gradient
by its size, and under a loss weighted by 0.01 the attention's query and key gradients sink
below fp16's normal range. The report said to let the scale grow; it names the oversized
projection as the likely cause and re-initialises it first. At a standard initialisation the
same loop is healthy."""
import torch
from torch import nn
import torch.nn.functional as F

from tiny_lm import oversized_lm_run


class ParallelBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        h = self.norm(x)
        attention = self.o(F.scaled_dot_product_attention(self.q(h), self.k(h), self.v(h), is_causal=True))
        return x + attention + self.fc2(F.gelu(self.fc1(h)))


def lm_run(db, gain):
    oversized_lm_run(db, ParallelBlock, lambda model: model.blocks[0].fc2.weight, gain)


def test_an_oversized_branch_explains_the_underflow_beside_it_and_is_re_initialised_first(tmp_path, verdict):
    db = tmp_path / "lm.db"
    lm_run(db, 3e4)
    _, rep = verdict(db)
    first = rep["findings"][0]
    assert (first["rule"], first["severity"], first["module"]) == ("oversized-weights", "warning", "blocks.0.fc2")
    assert first["title"].endswith("likely follows from it") and "the underflow in blocks.0." in first["title"]
    underflows = [f for f in rep["findings"] if f["rule"] == "underflow" and f["severity"] == "warning"]
    assert underflows
    for finding in underflows:
        assert "blocks.0.fc2's weights start at a gain of" in finding["evidence"]
        assert finding["suggestions"][0]["summary"].startswith("Initialise blocks.0.fc2 at a standard scale")


def test_the_branch_at_a_standard_initialisation_is_healthy(tmp_path, verdict):
    db = tmp_path / "lm.db"
    lm_run(db, 1.0)
    code, rep = verdict(db)
    assert (code, rep["healthy"]) == (0, True), rep["findings"]
