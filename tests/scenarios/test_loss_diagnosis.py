"""NaN/Inf made after the model's modules, in the loss the user computes: named as the
loss, never blamed on the layer nearest to it."""
import csv
import io
import subprocess

import torch
from torch import nn

import ampdiag
from conftest import rules


def test_a_log_of_zero_in_the_loss_is_blamed_on_the_loss_not_on_a_layer(tmp_path, verdict, cli):
    # Every fifth batch has a class whose probability the loss masks to 0: log(0) = -inf.
    db = tmp_path / "log0.db"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu")
    with ampdiag.attach(model, scaler, db=db):
        for step in range(20):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                p = torch.softmax(model(torch.randn(64, 16)).float(), -1)
            loss = -torch.log(p * (step % 5 != 3)).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    code, rep = verdict(db)
    assert code == 1
    top = rep["findings"][0]
    assert (top["rule"], top["severity"], top["module"]) == ("forward-nonfinite", "error", "")
    assert "every probed module's output is finite" in top["title"]
    assert ".float()" in top["suggestions"][0]["python"]
    assert [(rule, module) for rule, module in rules(rep, "error") if module] == []  # no layer blamed
    assert [k["step"] for k in rep["skipped_steps"]] == [3, 8, 13, 18]
    assert all(k["loss_after_modules"] for k in rep["skipped_steps"])
    out = subprocess.run([cli, "timeline", str(db), "--format", "csv"], capture_output=True, text=True, check=True).stdout
    timeline = csv.DictReader(io.StringIO(out))
    assert {row["step"]: row["first_nonfinite_forward"] for row in timeline if row["skipped"] == "1"} == \
        {"3": "(loss)", "8": "(loss)", "13": "(loss)", "18": "(loss)"}


def test_a_float16_loss_is_a_warning_with_the_fp32_loss_fix_and_the_run_stays_healthy(tmp_path, verdict):
    # `.mean()` keeps autocast's fp16: its gradient is the scale in fp16, Inf at 65536, so
    # the first step and every growth probe back to 65536 skip.
    db = tmp_path / "half_loss.db"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu", growth_interval=5)
    with ampdiag.attach(model, scaler, db=db):
        for _ in range(16):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(64, 16)).pow(2).mean()
            assert loss.dtype == torch.float16
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    code, rep = verdict(db)
    assert code == 0, rep["findings"]
    half = [f for f in rep["findings"] if f["rule"] == "half-loss"]
    assert len(half) == 1 and half[0]["severity"] == "warning"
    assert ".float()" in half[0]["suggestions"][0]["python"]
    assert all(k["scale"] == 65536 for k in rep["skipped_steps"])  # only the scale's own gradient overflowed
    assert "overflow-origin" not in {f["rule"] for f in rep["findings"]}  # not blamed on the last layer
