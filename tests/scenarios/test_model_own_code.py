"""NaN/Inf made by the model's own forward() after its last module, where every module's
output is finite: a log-sum-exp written by hand, whose fp16 sum of exponentials overflows
65504. The report blamed the loss code (the only code it knew of outside the modules);
it must name the model's own code after its last submodule, with its operations, and the
fix it gives (that code in FP32) must make the run healthy."""
import torch
from torch import nn

import ampdiag
from conftest import amp_step, amp_training


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
