"""A regression head fitting targets around 4 from a start at 0: its bias's gradients are
about 8 at first, so the scaler halves from 65536 to 8192 in three skipped steps, and within
twenty steps they shrink to about 1e-4. The first layer, fed inputs of about 1e-5, has
gradients mostly below fp16's normal range at 8192, and torch doubles the scale only once
every 2000 steps. The report said no loss scale lifts them (judging by the start's
gradients); it says to let the scale grow back sooner, and a short growth_interval does."""
import torch
from torch import nn

from conftest import amp_step


def regression_loop(db, growth_interval):
    import ampdiag
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", growth_interval=growth_interval)
    g = torch.Generator().manual_seed(0)

    def loss_of():
        x = torch.randn(128, 64, generator=g) * 1e-5
        y = 4.0 + 0.01 * torch.randn(128, 1, generator=g)
        return nn.functional.mse_loss(model(x).float(), y)

    with ampdiag.attach(model, scaler, db=db):
        for _ in range(40):
            amp_step(opt, scaler, loss_of)


def test_an_underflow_behind_a_start_that_has_passed_is_told_to_let_the_scale_grow_back(tmp_path, verdict):
    db = tmp_path / "run.db"
    regression_loop(db, growth_interval=2000)
    code, report = verdict(db)
    assert code == 0
    first = report["findings"][0]
    assert (first["rule"], first["severity"], first["layer"]) == ("underflow", "warning", "0.weight")
    assert "no loss scale lifts" not in first["title"]
    assert "the run's first steps, whose gradients were far larger, left the scale at 8192" in first["evidence"]
    fix = first["suggestions"][0]
    assert fix["summary"].startswith("Let the scale grow back sooner")
    assert "init_scale=2.0**13, growth_interval=200" in fix["python"]


def test_the_same_loop_whose_scale_grows_back_sooner_has_no_underflow(tmp_path, verdict):
    # 40 steps stand for a long run: a doubling every 3 steps instead of every 200.
    db = tmp_path / "run.db"
    regression_loop(db, growth_interval=3)
    code, report = verdict(db)
    assert (code, report["healthy"]) == (0, True), report["findings"]
    assert "underflow" not in [f["rule"] for f in report["findings"]]
