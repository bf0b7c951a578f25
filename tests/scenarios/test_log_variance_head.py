"""Heteroscedastic regression on nearly noiseless targets: a mean head and a log-variance head
under a Gaussian likelihood written as logvar + (y - mu)**2 / exp(logvar). The variance falls,
exp() of the float16 log-variance is tiny, and the gradient sent back through it passes 65504.
The scaler's first skips overflowed in the head's own backward, and the agent's one look, at
the second skip, said so for every skip: the later ones come in through the head's output.
A module judged so is looked at again, and the report names the code after it."""
import torch
from torch import nn

import ampdiag
from conftest import amp_training


class Heteroscedastic(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU())
        self.mu, self.logvar = nn.Linear(128, 1), nn.Linear(128, 1)

    def forward(self, x):
        h = self.body(x)
        return self.mu(h).squeeze(-1), self.logvar(h).squeeze(-1)


def train(db, pin):
    torch.manual_seed(0)
    model, w = Heteroscedastic(), torch.randn(8)
    if pin:
        ampdiag.pin_fp32(model.logvar)

    def loss_of(g):
        x = torch.randn(256, 8, generator=g)
        # Targets of about 0.3: fp16's rounding of mu then lets the variance fall far enough that the
        # slide takes the scale well below the floor on any CPU's kernels (at 3 it stopped at
        # the floor on one, below it on another).
        y = 0.1 * (x @ w) + 0.001 * torch.randn(256, generator=g)
        mu, logvar = model(x)
        return (0.5 * (logvar + (y - mu) ** 2 / logvar.exp())).mean()

    amp_training(db, model, torch.optim.Adam(model.parameters(), 3e-3), 120, loss_of)


def test_a_log_variance_head_whose_later_skips_come_through_its_output_is_named_so(tmp_path, verdict):
    db = tmp_path / "run.db"
    train(db, False)
    code, report = verdict(db)
    assert code == 1
    first = report["findings"][0]
    assert (first["rule"], first["module"]) == ("overflow-origin", "logvar")
    assert first["title"].endswith("they reach it through its output: the code that uses logvar's output makes them")
    assert "Exp (float16)" in first["evidence"]
    assert first["suggestions"][0]["python"].startswith("ampdiag.pin_fp32(model.logvar)")


def test_the_same_head_pinned_to_fp32_passes_the_gate_with_nothing_on_the_head(tmp_path, verdict):
    # Not always "healthy": the falling variance also scales mu's gradient by 1/exp(logvar),
    # and on some CPUs' kernels (an AMD EPYC's) mu's own fp16 backward then backs the scale
    # off to 256 by step 115, which the report rightly warns of.
    db = tmp_path / "run.db"
    train(db, True)
    code, report = verdict(db)
    assert code == 0, report["findings"]
    assert [f for f in report["findings"] if f["module"] == "logvar" or f["severity"] == "error"] == []
