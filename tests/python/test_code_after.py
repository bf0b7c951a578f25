"""The code after the module a skip names, where the gradient reaching its output held
NaN/Inf: the operations from its output to the loss (event "output-code"), the model's own
parameters beside them ("output-parameters"), where that code runs ("output-code-place": the
model's forward(), the loss, or both), and, traced at a later step, the first of them whose
backward made the NaN/Inf, with those between the output and it ("output-code-origin")."""
import sqlite3

import torch
from torch import nn

import ampdiag


def events(db, kind):
    with sqlite3.connect(db) as c:
        return [d for (d,) in c.execute("SELECT detail FROM events WHERE kind = ? ORDER BY step", (kind,))]


class Towers(nn.Module):
    """Two encoders whose normalised outputs' similarities are scaled by exp() of the
    model's own logit_scale, in its forward()."""

    def __init__(self, logit_scale):
        super().__init__()
        self.a, self.b = nn.Linear(12, 16), nn.Linear(12, 16)
        self.logit_scale = nn.Parameter(torch.tensor(logit_scale))
        self.unused_by_that_code = nn.Parameter(torch.ones(16))

    def forward(self, x):
        za = nn.functional.normalize(self.a(x), dim=-1)
        zb = nn.functional.normalize(self.b(x * self.unused_by_that_code[:12]), dim=-1)
        return nn.functional.cross_entropy(za @ zb.t() * self.logit_scale.exp(), torch.arange(len(x)))


class Gain(nn.Module):
    """An encoder's output times a gain in fp16, whose backward overflows at the first
    scales: nothing autocast keeps in fp16 between them."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(12, 8)

    def forward(self, x):
        return (self.enc(x) * 3000.0).float().mean()


class Encoder(nn.Module):
    """The Gain's encoder times the gain in its own forward(), whose output the loop's loss
    takes."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(12, 8)

    def forward(self, x):
        return self.enc(x) * 3000.0


def train(db, model, steps=6, loss_of=lambda out: out):
    torch.manual_seed(0)
    opt, scaler = torch.optim.SGD(model.parameters(), lr=1e-4), torch.amp.GradScaler("cpu")
    with ampdiag.attach(model, scaler, db=db):
        for _ in range(steps):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_of(model(torch.randn(16, 12) * 0.01))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()


def test_the_code_after_a_tower_and_the_temperature_beside_it_are_read_once(tmp_path):
    db = tmp_path / "run.db"
    train(db, Towers(11.5))
    [code] = events(db, "output-code")
    named, ops = code.split(": ", 1)
    assert named in ("a", "b")
    assert ", Mm:float16, Mul:float16," in ops
    assert events(db, "output-parameters") == [f"{named}: logit_scale: 11.5 (float32, 1 value), read by Exp"]


def test_the_origin_traced_is_the_temperatures_mul_after_the_matmul(tmp_path):
    db = tmp_path / "run.db"
    train(db, Towers(11.5))
    [origin] = events(db, "output-code-origin")
    # The product by exp(logit_scale), one value, read before backward freed it: about 98716.
    assert origin.endswith(", Mm:float16, Mul(98715.8):float16"), origin


def test_the_origin_traced_names_the_constant_it_multiplies_by(tmp_path):
    # Read as the trace is hooked, before the backward frees the Mul's saved number.
    db = tmp_path / "run.db"
    train(db, Gain())
    assert events(db, "output-code-origin") == ["enc: Mul(3000):float16"]


def test_the_origin_traced_after_a_gain_has_nothing_autocast_keeps_in_fp16_before_it(tmp_path):
    db = tmp_path / "run.db"
    train(db, Gain())
    [origin] = events(db, "output-code-origin")
    assert origin.startswith("enc: ") and "Mm" not in origin and "Addmm" not in origin, origin


def test_the_code_after_a_tower_of_a_model_that_returns_its_loss_runs_in_the_model(tmp_path):
    db = tmp_path / "run.db"
    train(db, Towers(11.5))
    [place] = events(db, "output-code-place")
    assert place.split(": ", 1)[1] == "model"


def test_the_code_after_a_module_split_between_the_models_forward_and_the_loss_says_so(tmp_path):
    db = tmp_path / "run.db"
    train(db, Encoder(), loss_of=lambda out: out.float().mean())
    assert events(db, "output-code-place") == ["enc: model, then loss"]


class TowersWithAnEmptyParameter(Towers):
    """The Towers, whose loss adds the sum of an empty parameter (a placeholder kept for a
    state dict), zero: the code after a tower reads it."""

    def __init__(self, logit_scale):
        super().__init__(logit_scale)
        self.placeholder = nn.Parameter(torch.empty(0))

    def forward(self, x):
        return super().forward(x) + self.placeholder.sum()


def test_an_empty_parameter_the_code_after_a_tower_reads_is_passed_over(tmp_path):
    # Describing it took the largest of no values, which raised inside the backward.
    db = str(tmp_path / "run.db")
    train(db, TowersWithAnEmptyParameter(11.5))
    described = events(db, "output-parameters")
    assert described and "placeholder" not in described[0]
    assert "logit_scale: 11.5" in described[0]
