"""A recurrent model written by hand: a cell called once per time step in a Python loop,
whose state is amplified each call (a recurrent weight with a gain of 1.3 and no saturating
nonlinearity). In fp16 it overflows at the 39th of 40 calls. The report named the cell's
Linear as a plain fp16 overflow and offered to pin it to FP32, which only moves the Inf to
the head, where the state arrives larger still; it must name the growth, put bounding the
state first, and that fix must make the run healthy."""
import torch
from torch import nn

from conftest import amp_training


class Cell(nn.Module):
    def __init__(self, bounded, d=64):
        super().__init__()
        self.bounded = bounded
        self.inp, self.rec = nn.Linear(8, d), nn.Linear(d, d, bias=False)
        with torch.no_grad():
            nn.init.orthogonal_(self.rec.weight, gain=1.3)

    def forward(self, x, h):
        out = self.rec(h) + self.inp(x)
        return torch.tanh(out) if self.bounded else out


class Recurrent(nn.Module):
    def __init__(self, bounded):
        super().__init__()
        self.cell, self.out = Cell(bounded), nn.Linear(64, 1)

    def forward(self, xs):
        h = torch.zeros(xs.shape[0], 64)
        for t in range(xs.shape[1]):
            h = self.cell(xs[:, t], h)
        return self.out(h)


def recurrent_loop(db, bounded, steps=8):
    torch.manual_seed(0)
    model = Recurrent(bounded)

    def loss_of(g):
        xs, y = torch.randn(16, 40, 8, generator=g), torch.randn(16, 1, generator=g)
        return nn.functional.mse_loss(model(xs), y)

    amp_training(db, model, torch.optim.Adam(model.parameters(), lr=1e-3), steps, loss_of)


def test_a_state_amplified_each_call_is_named_for_its_growth_with_bounding_it_first(tmp_path, verdict):
    db = tmp_path / "run.db"
    recurrent_loop(db, bounded=False)
    code, rep = verdict(db)
    first = rep["findings"][0]
    assert (code, first["rule"], first["module"]) == (1, "forward-nonfinite", "cell.rec")
    assert first["title"].startswith("cell.rec's output grows about 1.3")
    assert "with each of its calls in a forward, and overflows fp16 at call" in first["title"]
    assert "it ran 40 times" in first["evidence"]
    assert first["suggestions"][0]["summary"].startswith("Keep the state that cell.rec is called on from growing")


def test_the_state_bounded_as_the_report_says_is_healthy(tmp_path, verdict):
    db = tmp_path / "run.db"
    recurrent_loop(db, bounded=True)
    code, rep = verdict(db)
    assert code == 0, rep["findings"]


class SharedBlocks(nn.Module):
    """ALBERT's cross-layer sharing: one residual block run six times, its second Linear 40
    times too large, so the residual stream overflows fp16 a few passes in."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Linear(16, 64), nn.Linear(64, 4)
        self.fc1, self.fc2 = nn.Linear(64, 256), nn.Linear(256, 64)
        with torch.no_grad():
            self.fc2.weight.mul_(40)
            self.emb.weight.mul_(20)

    def forward(self, x):
        h = self.emb(x)
        for _ in range(6):
            h = h + self.fc2(nn.functional.gelu(self.fc1(h)))
        return self.head(h)


def test_a_shared_block_says_at_which_of_its_passes_it_went_nonfinite(tmp_path, verdict):
    torch.manual_seed(0)
    model = SharedBlocks()

    def loss_of(g):
        return nn.functional.cross_entropy(model(torch.randn(32, 16, generator=g)), torch.randint(0, 4, (32,), generator=g))

    amp_training(tmp_path / "run.db", model, torch.optim.Adam(model.parameters(), lr=1e-4), 4, loss_of)
    code, rep = verdict(tmp_path / "run.db")
    first = rep["findings"][0]
    assert (code, first["rule"], first["module"]) == (1, "forward-nonfinite", "fc2")
    assert "it ran 6 times in step 0's forward and went NaN/Inf at call " in first["evidence"]
    assert "grows about" not in first["title"]
