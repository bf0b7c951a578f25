"""NaN/Inf made by the model's own forward() after its last module, where every module's
output is finite: a log-sum-exp written by hand, whose fp16 sum of exponentials overflows
65504. The report blamed the loss code (the only code it knew of outside the modules);
it must name the model's own code after its last submodule, with its operations, and the
fix it gives (that code in FP32) must make the run healthy. Where that code reads a parameter
of the model's own (CLIP's temperature), the evidence names it with its value. A VAE's
reparameterisation between two of its modules is read as the code that made the decoder's
input, its exp() bounded first; a logvar head far too large before it explains it. A dVAE's
Gumbel-softmax at a small temperature divides its float16 logits past 65504: that division is
named with its constant, and done in FP32 as the report says, nothing overflows."""
import math

import torch
from torch import nn

import ampdiag
from conftest import amp_step, amp_training, rows


class EnergyModel(nn.Module):
    def __init__(self, fp32_tail, d=1024):
        super().__init__()
        self.fp32_tail = fp32_tail
        self.body = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        with torch.no_grad():
            self.norm.weight.fill_(3.0)  # exp() of its outputs sums past 65504 over 1024 features

    def forward(self, x):
        h = self.norm(torch.relu(self.body(x)))
        if self.fp32_tail:
            with torch.autocast(device_type="cpu", enabled=False):
                return torch.log(torch.exp(h.float()).sum(-1))
        return torch.log(torch.exp(h).sum(-1))


def energy_loop(db, fp32_tail, steps=12):
    torch.manual_seed(0)
    model = EnergyModel(fp32_tail)

    def loss_of(g):
        x, y = torch.randn(32, 1024, generator=g), torch.randn(32, generator=g)
        return nn.functional.mse_loss(model(x).float(), y)

    amp_training(db, model, torch.optim.SGD(model.parameters(), lr=1e-3), steps, loss_of)


def test_an_overflow_in_the_models_own_code_after_its_last_module_names_that_code(tmp_path, verdict):
    db = tmp_path / "run.db"
    energy_loop(db, fp32_tail=False)
    code, rep = verdict(db)
    first = rep["findings"][0]
    assert (code, first["rule"], first["module"], first["confirmation"]) == (1, "forward-nonfinite", "", "confirmed")
    assert "its own forward() makes it after norm, its last submodule" in first["title"]
    assert "Exp" in first["evidence"] and "Sum" in first["evidence"]
    assert "loss code" not in first["title"]


def test_that_code_in_fp32_as_the_report_says_is_healthy(tmp_path, verdict):
    db = tmp_path / "run.db"
    energy_loop(db, fp32_tail=True)
    code, rep = verdict(db)
    assert code == 0, rep["findings"]


class MaskedPolicy(nn.Module):
    """Illegal actions masked with -inf after the head, in the model's own forward."""

    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Sequential(nn.Linear(16, 64), nn.ReLU()), nn.Linear(64, 10)

    def forward(self, x, legal):
        return self.head(self.body(x)).masked_fill(~legal, float("-inf"))


def test_a_mask_the_model_applies_after_its_last_module_is_by_design_and_healthy(tmp_path, verdict):
    torch.manual_seed(0)
    model = MaskedPolicy()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    db = tmp_path / "run.db"
    with ampdiag.attach(model, scaler, db=db):
        for _ in range(6):
            x, legal = torch.randn(32, 16), torch.rand(32, 10) > 0.3
            legal[:, 0] = True
            amp_step(opt, scaler,
                     lambda: nn.functional.cross_entropy(model(x, legal).float(), torch.zeros(32, dtype=torch.long)))
    code, rep = verdict(db)
    assert code == 0
    [mask] = rep["findings"]
    assert (mask["severity"], mask["module"]) == ("info", "")
    assert "by design (a -inf mask)" in mask["title"]
    assert "unconfirmed: the model's own forward() makes NaN/Inf" in mask["evidence"]
    assert "in 0 steps" not in mask["evidence"]


class Clip(nn.Module):
    """Two towers and a learnable temperature whose exp() scales the cosine similarities.
    `log_init=False`: logit_scale initialised to 1/0.07 instead of log(1/0.07), a slip that
    makes exp(logit_scale) 1.6e6 and the logits overflow fp16. `clamped`: CLIP's bound on it
    before the exp(), at ln(100)."""

    def __init__(self, log_init, clamped=False):
        super().__init__()
        self.clamped = clamped
        self.image = nn.Sequential(nn.Linear(48, 64), nn.GELU(), nn.Linear(64, 32))
        self.text = nn.Sequential(nn.Embedding(200, 64), nn.Flatten(), nn.Linear(64 * 6, 32))
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07) if log_init else 1 / 0.07))

    def forward(self, image, tokens):
        i = nn.functional.normalize(self.image(image), dim=-1)
        t = nn.functional.normalize(self.text(tokens), dim=-1)
        scale = self.logit_scale.clamp(max=math.log(100)) if self.clamped else self.logit_scale
        return scale.exp() * i @ t.t()


def clip_loop(db, log_init, steps=8, clamped=False):
    torch.manual_seed(0)
    model = Clip(log_init, clamped)

    def loss_of(g):
        logits = model(torch.randn(16, 48, generator=g), torch.randint(0, 200, (16, 6), generator=g))
        y = torch.arange(16)
        return (nn.functional.cross_entropy(logits, y) + nn.functional.cross_entropy(logits.t(), y)) / 2

    amp_training(db, model, torch.optim.AdamW(model.parameters(), lr=1e-3), steps, loss_of)


def test_a_temperature_the_models_own_code_reads_is_named_with_its_value(tmp_path, verdict):
    clip_loop(tmp_path / "run.db", log_init=False)
    code, rep = verdict(tmp_path / "run.db")
    assert code == 1
    own_code = next(f for f in rep["findings"] if f["rule"] == "forward-nonfinite" and f["module"] == "")
    assert own_code is rep["findings"][0] and "its last submodule" in own_code["title"]
    assert "own parameters (held by no submodule) that code reads: logit_scale: 14.29 (float32, 1 value), read by Exp" \
        in own_code["evidence"]
    bound = own_code["suggestions"][0]
    assert bound["summary"].startswith("Bound logit_scale before its exp(): at 14.3, exp() gives 1.61e+06")
    assert "self.logit_scale.clamp(max=math.log(100)).exp()" in bound["python"]


def test_the_bound_the_report_offers_a_temperature_makes_its_loop_healthy(tmp_path, verdict):
    # The slip left as it is, with the clamp the report's first fix gives.
    clip_loop(tmp_path / "run.db", log_init=False, clamped=True)
    code, rep = verdict(tmp_path / "run.db")
    assert code == 0, rep["findings"]


def test_a_temperature_initialised_as_its_log_is_healthy(tmp_path, verdict):
    db = tmp_path / "run.db"
    clip_loop(db, log_init=True)
    code, rep = verdict(db)
    assert code == 0, rep["findings"]


class Vae(nn.Module):
    """A VAE whose reparameterisation, exp(0.5 * logvar), runs in its own forward() between
    the logvar head and the decoder."""

    def __init__(self, logvar_gain):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(64, 128), nn.ReLU())
        self.mu, self.logvar = nn.Linear(128, 16), nn.Linear(128, 16)
        self.dec = nn.Sequential(nn.Linear(16, 128), nn.ReLU(), nn.Linear(128, 64))
        with torch.no_grad():
            self.logvar.weight.mul_(logvar_gain)

    def forward(self, x):
        h = self.enc(x)
        mu, logvar = self.mu(h), self.logvar(h)
        return self.dec(mu + torch.exp(0.5 * logvar) * torch.randn_like(mu)), mu, logvar


def vae_loop(db, logvar_gain):
    torch.manual_seed(0)
    model = Vae(logvar_gain)

    def loss_of(g):
        x = torch.rand(32, 64, generator=g)
        recon, mu, logvar = model(x)
        kl = -0.5 * (1 + logvar.float() - mu.float() ** 2 - logvar.float().exp()).sum(-1).mean()
        return nn.functional.mse_loss(recon.float(), x) + 1e-3 * kl

    amp_training(db, model, torch.optim.Adam(model.parameters(), lr=1e-3), 12, loss_of)


def test_a_logvar_head_far_too_large_explains_the_overflow_in_the_reparameterisation_after_it(tmp_path, verdict):
    db = tmp_path / "vae.db"
    vae_loop(db, logvar_gain=200.0)
    code, report = verdict(db)
    assert code == 1
    own = next(f for f in report["findings"] if f["rule"] == "forward-nonfinite")
    assert own["module"] == "" and own["title"].endswith("between logvar and dec.0"), own["title"]
    oversized = next(f for f in report["findings"] if f["rule"] == "oversized-weights")
    assert oversized["severity"] == "warning"
    assert oversized["title"].endswith("the overflow in the model's own forward() after logvar likely follows from it")
    assert "reset_parameters()" in oversized["suggestions"][0]["python"]


def test_the_reparameterisations_exp_is_read_in_the_models_own_code_and_bounded_first(tmp_path, verdict):
    db = tmp_path / "vae.db"
    vae_loop(db, logvar_gain=200.0)
    _, report = verdict(db)
    own = next(f for f in report["findings"] if f["rule"] == "forward-nonfinite")
    assert "the code that made dec.0's input, read at step 0: Mul, Exp, Mul, Add (all float16)" in own["evidence"]
    assert own["suggestions"][0]["summary"].startswith(
        "Bound what the model's own forward() passes to exp() between logvar and dec.0 (Exp, float16)")


def test_the_logvar_head_at_its_standard_initialisation_trains_healthy(tmp_path, verdict):
    db = tmp_path / "vae_reset.db"
    vae_loop(db, logvar_gain=1.0)
    code, report = verdict(db)
    assert (code, report["healthy"]) == (0, True), report["findings"]


class GumbelDvae(nn.Module):
    """A dVAE's quantiser: the encoder's logits through F.gumbel_softmax at temperature `tau`
    in its own forward(), then a codebook. `fp32_logits`: the logits cast to float32 first."""

    def __init__(self, tau, fp32_logits=False):
        super().__init__()
        self.tau, self.fp32_logits = tau, fp32_logits
        self.enc = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 512))
        self.codebook = nn.Linear(512, 128, bias=False)
        self.dec = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 64))

    def forward(self, x):
        logits = self.enc(x)
        z = nn.functional.gumbel_softmax(logits.float() if self.fp32_logits else logits, tau=self.tau)
        return self.dec(self.codebook(z))


def gumbel_loop(db, fp32_logits):
    torch.manual_seed(0)
    model = GumbelDvae(1e-4, fp32_logits)

    def loss_of(g):
        x = torch.randn(128, 64, generator=g)
        return nn.functional.mse_loss(model(x).float(), x)

    amp_training(db, model, torch.optim.AdamW(model.parameters(), lr=1e-3), 10, loss_of)


def test_a_gumbel_softmax_at_a_small_temperature_is_told_to_divide_in_fp32(tmp_path, verdict):
    db = tmp_path / "dvae.db"
    gumbel_loop(db, fp32_logits=False)
    code, report = verdict(db)
    assert code == 1
    own = next(f for f in report["findings"] if f["rule"] == "forward-nonfinite")
    assert own["module"] == "" and own["title"].endswith("between enc.2 and codebook"), own["title"]
    assert "the code that made codebook's input, read at step 0: Add, Div, Softmax (all float16)" in own["evidence"]
    first = own["suggestions"][0]
    assert first["summary"].startswith("Compute in FP32 what the model's own forward() divides between enc.2 and "
                                       "codebook: in float16 the division by 0.0001 (Div) multiplies what it divides "
                                       "by 10000"), first["summary"]
    assert "F.gumbel_softmax(logits.float(), tau)" in first["summary"]


def test_the_gumbel_softmax_on_float32_logits_as_the_report_says_trains_without_an_overflow(tmp_path, verdict):
    db = tmp_path / "dvae.db"
    gumbel_loop(db, fp32_logits=True)
    code, report = verdict(db)
    # A softmax that sharp passes the encoder gradients too small for fp16 (warned as
    # underflow), which is the temperature's, not an overflow.
    assert code == 0 and [f for f in report["findings"] if f["severity"] != "warning" or f["rule"] != "underflow"] == []
    assert rows(db, "SELECT COUNT(*) FROM steps WHERE skipped = 1")[0][0] == 0
