"""A learning rate too high, as a real fp16 loop: the loss grows by orders of magnitude
while finite, then the first Linear overflows fp16 and the loss goes NaN. The verdict must
name the divergence first, with the overflow after it only where it showed; the same loop
with a tenth of the learning rate confirms the fix: healthy."""
import torch
from torch import nn

import ampdiag


def train(db, lr, steps=40):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 1))
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")
    losses = []
    with ampdiag.attach(model, scaler, db=db):
        for _ in range(steps):
            x = torch.randn(64, 32)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x).float(), x[:, :1] * 3)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
    return losses


def test_a_diverging_loss_is_named_before_the_module_that_overflowed(tmp_path, verdict):
    losses = train(tmp_path / "diverged.db", lr=0.5)
    assert losses[-1] != losses[-1] and max(l for l in losses if l == l) > 1000 * losses[0]
    code, rep = verdict(tmp_path / "diverged.db")
    assert code == 1
    first = rep["findings"][0]
    assert (first["rule"], first["severity"]) == ("loss-divergence", "error")
    culprits = [f for f in rep["findings"] if f["rule"] == "forward-nonfinite"]
    assert culprits and all(f["severity"] != "error" for f in culprits)
    assert culprits[0]["suggestions"][0]["summary"].startswith("The loss was diverging (see loss-divergence)")


def test_whatif_does_not_offer_a_scaler_setting_for_a_diverging_run(tmp_path, ampdiag):
    train(tmp_path / "diverged.db", lr=0.5)
    result = ampdiag("whatif", tmp_path / "diverged.db")
    assert result.returncode == 0, result.stderr
    assert "Recommended: keep the recorded configuration: the loss diverged" in result.stdout


def test_the_html_report_plots_a_diverging_loss_on_a_log_scale(tmp_path, ampdiag):
    # On a linear axis the loss sat flat at zero until it exploded.
    train(tmp_path / "diverged.db", lr=0.5)
    page = tmp_path / "report.html"
    result = ampdiag("report", tmp_path / "diverged.db", "--format", "html", "-o", page)
    assert result.returncode == 1, result.stderr
    assert "log scale: it spans a factor of" in page.read_text()


def test_the_same_loop_with_a_tenth_of_the_learning_rate_is_healthy(tmp_path, verdict):
    losses = train(tmp_path / "fixed.db", lr=0.05)
    assert all(l == l for l in losses)
    code, rep = verdict(tmp_path / "fixed.db")
    assert code == 0, rep["findings"]


class Grown(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 128), nn.ReLU())
        self.head = nn.Linear(128, 10)
        self.extra = None

    def forward(self, x):
        h = self.body(x)
        return self.head(self.extra(h) if self.extra is not None else h)


def grow(db, gain, steps=40, at=15):
    """A block grown into the model at step `at`, its weights times `gain`, given to the
    optimizer; AdamW at an ordinary learning rate."""
    torch.manual_seed(0)
    model = Grown()
    opt, scaler = torch.optim.AdamW(model.parameters(), lr=1e-3), torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(1)
    with ampdiag.attach(model, scaler, db=db):
        for step in range(steps):
            if step == at:
                model.extra = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 128))
                with torch.no_grad():
                    model.extra[0].weight.mul_(gain)
                    model.extra[2].weight.mul_(gain)
                opt.add_param_group({"params": model.extra.parameters()})
            x, y = torch.randn(64, 32, generator=g), torch.randint(0, 10, (64,), generator=g)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()


def test_a_loss_that_rose_when_a_block_was_grown_in_is_put_on_the_block_not_the_learning_rate(tmp_path, verdict):
    grow(tmp_path / "grown.db", gain=300.0)
    code, rep = verdict(tmp_path / "grown.db")
    assert code == 1
    first = rep["findings"][0]
    assert (first["rule"], first["severity"]) == ("loss-divergence", "error")
    assert first["title"].startswith("The loss rose at step 15, the step parameters were added to the model "
                                     "(extra.0.weight, extra.0.bias, extra.2.weight and 1 more)")
    assert "learning rate" not in first["suggestions"][0]["summary"]
    oversized = [f for f in rep["findings"] if f["rule"] == "oversized-weights"]
    assert oversized and oversized[0]["module"] in ("extra.0", "extra.2")


def test_the_same_block_grown_in_at_its_default_initialisation_is_healthy(tmp_path, verdict):
    grow(tmp_path / "grown.db", gain=1.0)
    code, rep = verdict(tmp_path / "grown.db")
    assert code == 0, rep["findings"]
