"""torch's AMP recipe turns AMP off with `GradScaler(enabled=use_amp)`: a disabled scaler
passes everything through. attach() takes it (it used to refuse it, which stopped the
recipe's fp32 run): training is unchanged, the run is recorded as one without a scaler,
each optimizer found in scaler.step() from its first step on, with one event saying so,
and close() gives the scaler its own step() back."""
import sqlite3

import pytest
import torch
from torch import nn

import ampdiag


def recipe(db=None, use_amp=False, steps=6, optimizers=1):
    """The recipe's loop: autocast and the scaler both enabled by use_amp."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    groups = [list(model[0].parameters()), list(model[2].parameters())] if optimizers == 2 else [model.parameters()]
    opts = [torch.optim.SGD(g, lr=0.05) for g in groups]
    scaler = torch.amp.GradScaler("cpu", enabled=use_amp)
    handle = ampdiag.attach(model, scaler, db=db, overwrite=True) if db else None
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    losses = []
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.float16, enabled=use_amp):
            loss = nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        for opt in opts:
            scaler.step(opt)
        scaler.update()
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    if handle:
        handle.close()
    return [p.detach().clone() for p in model.parameters()], losses, scaler


def rows(db, sql):
    with sqlite3.connect(db) as c:
        return c.execute(sql).fetchall()


def test_the_recipe_with_amp_off_trains_bit_identically_with_ampdiag_attached(tmp_path):
    without, _, _ = recipe()
    with_agent, _, _ = recipe(tmp_path / "run.db")
    for a, b in zip(with_agent, without):
        assert torch.equal(a, b)


def test_every_step_is_recorded_from_the_first_with_its_loss_and_no_scale(tmp_path):
    _, losses, _ = recipe(tmp_path / "run.db")
    recorded = rows(tmp_path / "run.db", "SELECT step, loss, scale_before, scale_after, skipped FROM steps ORDER BY step")
    assert [r[0] for r in recorded] == list(range(6))
    assert [r[1] for r in recorded] == losses
    assert {r[2:] for r in recorded} == {(1.0, 1.0, 0)}
    assert rows(tmp_path / "run.db", "SELECT COUNT(DISTINCT step) FROM grad_stats")[0][0] == 6


def test_the_disabled_scaler_is_said_once(tmp_path):
    recipe(tmp_path / "run.db")
    assert rows(tmp_path / "run.db", "SELECT step FROM events WHERE kind = 'scaler-disabled'") == [(0,)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="torch disables a cuda GradScaler only without a cuda device")
def test_a_scaler_torch_disabled_for_a_device_it_lacks_says_which(tmp_path):
    # timm's NativeScaler() makes torch.amp.GradScaler("cuda"), which torch turns off here.
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.warns(UserWarning, match="CUDA is not available"):
        scaler = torch.amp.GradScaler("cuda")
    with ampdiag.attach(model, scaler, db=tmp_path / "run.db"):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(4, 8)).float().mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    [(detail,)] = rows(tmp_path / "run.db", "SELECT detail FROM events WHERE kind = 'scaler-disabled'")
    assert detail.startswith("the GradScaler made for cuda is disabled: torch turns it off where no cuda device is "
                             "available, and the model trains on cpu"), detail


def test_two_optimizers_stepped_through_the_disabled_scaler_end_one_step_each_cycle(tmp_path):
    recipe(tmp_path / "run.db", optimizers=2)
    assert rows(tmp_path / "run.db", "SELECT COUNT(*) FROM steps")[0][0] == 6


def test_close_gives_the_scaler_its_own_step_and_update_back(tmp_path):
    _, _, scaler = recipe(tmp_path / "run.db")
    assert "step" not in scaler.__dict__ and "update" not in scaler.__dict__


def test_a_second_model_on_the_same_disabled_scaler_is_told_to_attach_one_module_dict(tmp_path):
    # As with an enabled scaler: the second handle wrapped the first one's step() and update().
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    first = ampdiag.attach(nn.Linear(4, 4), scaler, db=tmp_path / "a.db")
    with pytest.raises(RuntimeError, match=r"attach one torch.nn.ModuleDict holding them all"):
        ampdiag.attach(nn.Linear(4, 1), scaler, db=tmp_path / "b.db")
    first.close()
    ampdiag.attach(nn.Linear(4, 1), scaler, db=tmp_path / "c.db").close()  # free again once closed
    assert "step" not in scaler.__dict__ and "update" not in scaler.__dict__
