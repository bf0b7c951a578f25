"""The precision a run is judged in: bf16 loops with and without a scaler, autocast turned
on late or entered inside the model, a bfloat16 model, and torch's AMP recipe with AMP off
(a float32 run), each with its losses recorded as the user saw them."""
import json

import pytest
import torch
from torch import nn

import ampdiag
from conftest import rows, rules
from fp16_loop import Mlp, batches, bf16_loop


def test_bf16_without_a_scaler_is_healthy_and_its_loss_is_recorded(tmp_path, verdict):
    db = tmp_path / "bf16.db"
    torch.manual_seed(0)
    bf16_loop(db, Mlp(), 10)
    code, rep = verdict(db)
    assert (code, rep["healthy"]) == (0, True), rep["findings"]


def scaler_loop(db, dtype, steps=12):
    """A GradScaler loop under `dtype` autocast whose gradients are tiny: below fp16's normal
    range, well inside bf16's."""
    torch.manual_seed(0)
    model = Mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    with ampdiag.attach(model, scaler, db=db):
        for x, y in batches(steps):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=dtype):
                loss = nn.functional.mse_loss(model(x).float(), y) * 1e-9
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()


def test_bf16_autocast_with_a_grad_scaler_kept_from_fp16_is_judged_in_bf16(tmp_path, ampdiag):
    # attach() guesses float16 from the scaler; the fp16 underflow warnings that followed
    # told the user to train in bf16, which the run already did.
    db = tmp_path / "bf16_scaler.db"
    scaler_loop(db, torch.bfloat16)
    assert rows(db, "SELECT value FROM meta WHERE key = 'amp_dtype'") == [("bfloat16",)]
    # The run's settings and its loss code as first read aside, the one event is the dtype's.
    assert [kind for (kind,) in rows(db, "SELECT kind FROM events WHERE kind NOT IN ('optimizer-settings', "
                                          "'loss-code-first')")] == ["amp-dtype"]
    result = ampdiag("report", db, "--format", "json", "--fail-on", "all")
    assert result.returncode == 0, result.stdout


def test_fp16_autocast_with_a_grad_scaler_stays_judged_in_fp16(tmp_path, ampdiag):
    db = tmp_path / "fp16_scaler.db"
    scaler_loop(db, torch.float16)
    assert rows(db, "SELECT value FROM meta WHERE key = 'amp_dtype'") == [("float16",)]
    assert rows(db, "SELECT COUNT(*) FROM events WHERE kind = 'amp-dtype'") == [(0,)]
    assert "underflow" in {f["rule"] for f in json.loads(ampdiag("report", db, "--format", "json").stdout)["findings"]}


def test_bf16_log_loss_wins_over_the_backward_root(tmp_path):
    db = tmp_path / "bf16.db"
    model = Mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with ampdiag.attach(model, optimizer=opt, db=db) as handle:
        x, y = batches(1)[0]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        (loss * 3).backward()
        handle.log_loss(loss)
        opt.step()
    assert rows(db, "SELECT loss, losses FROM steps") == [(pytest.approx(loss.item()), 1)]


def amp_recipe(db, use_amp):
    """torch's AMP recipe: autocast(enabled=use_amp) and GradScaler(enabled=use_amp). With
    AMP off the scaler passes everything through."""
    torch.manual_seed(0)
    model = Mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", enabled=use_amp)
    with ampdiag.attach(model, scaler, db=db):
        for x, y in batches(12):
            with torch.autocast("cpu", dtype=torch.float16, enabled=use_amp):
                loss = nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("use_amp", [True, False])
def test_pytorchs_amp_recipe_is_healthy_with_amp_on_and_off(tmp_path, verdict, use_amp):
    # attach() had refused the disabled scaler of the AMP-off run.
    db = tmp_path / "run.db"
    amp_recipe(db, use_amp)
    code, report = verdict(db)
    assert (code, rules(report, "error"), rules(report, "warning")) == (0, [], [])
    assert rows(db, "SELECT COUNT(*) FROM steps")[0][0] == 12


def test_pytorchs_amp_recipe_with_amp_off_is_reported_as_a_float32_run(tmp_path, ampdiag):
    # It was headed "bfloat16 on cpu" (the no-scaler guess) for a run with no autocast at all.
    db = tmp_path / "run.db"
    amp_recipe(db, False)
    assert rows(db, "SELECT value FROM meta WHERE key = 'amp_dtype'") == [("float32",)]
    assert "float32 on cpu" in ampdiag("report", db).stdout


def test_autocast_turned_on_after_a_float32_warm_up_is_judged_in_float16_from_then(tmp_path, verdict):
    # It stayed "float32 on cpu" from the first forward, so the fp16 steps after the warm-up
    # were judged by float32's range.
    torch.manual_seed(0)
    model = Mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    db = tmp_path / "run.db"
    with ampdiag.attach(model, scaler, db=db):
        for step, (x, y) in enumerate(batches(6)):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16, enabled=step >= 3):
                loss = nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert rows(db, "SELECT value FROM meta WHERE key = 'amp_dtype'") == [("float16",)]
    assert rows(db, "SELECT step, detail FROM events WHERE kind = 'amp-dtype' ORDER BY step")[-1] == (
        3, "autocast turned on in float16 at step 3, after a start in float32: the run is judged in float16")
    code, rep = verdict(db)
    assert (code, rep["runs"][0]["amp_dtype"]) == (0, "float16")


class AutocastInside(Mlp):
    """A model that enters autocast in its own forward: the loop around it shows none."""

    def __init__(self, dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, x):
        with torch.autocast("cpu", dtype=self.dtype):
            return super().forward(x).float()


@pytest.mark.parametrize("dtype, judged", [(torch.bfloat16, "bfloat16"), (torch.float16, "float16")])
def test_autocast_entered_inside_the_model_gives_the_runs_precision(tmp_path, dtype, judged):
    # A GradScaler makes the guess float16; bf16 autocast inside forward was not seen.
    torch.manual_seed(0)
    model = AutocastInside(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    db = tmp_path / "run.db"
    with ampdiag.attach(model, scaler, db=db):
        for x, y in batches(3):
            loss = nn.functional.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    assert rows(db, "SELECT value FROM meta WHERE key = 'amp_dtype'") == [(judged,)]


def test_a_bfloat16_model_without_autocast_is_judged_in_bfloat16(tmp_path):
    torch.manual_seed(0)
    model = Mlp().bfloat16()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    db = tmp_path / "run.db"
    with ampdiag.attach(model, optimizer=opt, db=db):
        for x, y in batches(3):
            loss = nn.functional.mse_loss(model(x.bfloat16()).float(), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert rows(db, "SELECT value FROM meta WHERE key = 'amp_dtype'") == [("bfloat16",)]
    assert rows(db, "SELECT COUNT(*) FROM events WHERE kind = 'amp-dtype'") == [(0,)]
