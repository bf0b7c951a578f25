"""A neural ODE classifier: RK4 at a fixed step runs one function 24 times a forward, so its
layers' gradients arrive only after the backward of every call. With the function's output
layer 3000 times too large, its fp16 backward overflows in the later calls (the first in
backward), and the NaN/Inf then reaches the outputs of its earlier calls from its own
backward, not from the code after it. The look at the gradient reaching its output judges
the call that receives its gradient first; the report had said the code after it made them,
with a look for sqrt of 0 and no word of the layer. Now the layer's re-initialisation leads
the top finding: the layer is inside the function, and the function's gradients in the steps
that stayed finite came within a factor of three of 65504 (the look for a singular function
had led before that, with the re-initialisation as the other case)."""
import torch
from torch import nn
import torch.nn.functional as F

from conftest import amp_training, rows


class OdeFunction(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.l1, self.l2 = nn.Linear(d, 128), nn.Linear(128, d)

    def forward(self, h):
        return self.l2(torch.tanh(self.l1(h)))


class OdeClassifier(nn.Module):
    def __init__(self, steps=6):
        super().__init__()
        self.enc, self.f, self.norm, self.head = nn.Linear(32, 64), OdeFunction(), nn.LayerNorm(64), nn.Linear(64, 10)
        self.steps = steps

    def forward(self, x):
        h, dt = self.enc(x), 1.0 / self.steps
        for _ in range(self.steps):
            k1 = self.f(h)
            k2 = self.f(h + dt / 2 * k1)
            k3 = self.f(h + dt / 2 * k2)
            k4 = self.f(h + dt * k3)
            h = h + dt / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
        return self.head(self.norm(h))


def train(db, gain, steps=24):
    torch.manual_seed(0)
    model = OdeClassifier()
    with torch.no_grad():
        model.f.l2.weight.mul_(gain)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def loss_of(g):
        return F.cross_entropy(model(torch.randn(64, 32, generator=g)).float(), torch.randint(0, 10, (64,), generator=g))

    amp_training(db, model, opt, steps, loss_of)


def test_an_ode_functions_oversized_layer_is_re_initialised_not_blamed_on_the_code_after_it(tmp_path, verdict):
    db = tmp_path / "ode.db"
    train(db, gain=3000.0)
    assert ("module-output-gradient", "f.l2: nonfinite") not in rows(db, "SELECT kind, detail FROM events")
    code, rep = verdict(db)
    assert code == 1
    top = rep["findings"][0]
    assert top["rule"] == "overflow-origin" and top["module"] in ("f", "f.l2")
    assert "reach it through its output" not in top["title"]
    fixes = [fix["summary"] for fix in top["suggestions"]]
    # f.l2, inside f, starts 3000 times too large and f's finite gradients come near 65504:
    # the re-initialisation leads, the look for a singular function is the other case.
    assert fixes[0].startswith("Initialise f.l2 at a standard scale"), fixes
    assert "into the rest of f," in fixes[0] or top["module"] == "f.l2"
    assert any(fix.startswith("If the gain is not the whole cause, look at the backward of f") for fix in fixes[1:])


def test_the_same_ode_classifier_at_a_standard_scale_trains_healthy(tmp_path, verdict):
    db = tmp_path / "ode_healthy.db"
    train(db, gain=1.0)
    code, rep = verdict(db)
    assert code == 0, rep["findings"]
