"""Every view names what the report names: the timeline's forward cause, the layers
table's ranking, and a run that only underflows is told about underflow, not overflow."""
import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

import ampdiag

SAMPLES = Path(__file__).resolve().parents[2] / "samples" / "python"


def test_timeline_and_layers_name_the_reports_culprit(tmp_path, ampdiag, verdict):
    db = tmp_path / "la.db"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SAMPLES), os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, str(SAMPLES / "linear_attention_nan.py"), "--db", str(db), "--steps", "6"],
                   check=True, capture_output=True, env=env, timeout=300)
    _, rep = verdict(db)
    culprit = rep["findings"][0]["module"]
    assert culprit == "encoder.0.linear_attn"
    timeline = list(csv.DictReader(io.StringIO(ampdiag("timeline", db, "--format", "csv").stdout)))
    assert {row["first_nonfinite_forward"] for row in timeline} == {culprit}
    assert {s["forward_module"] for s in rep["skipped_steps"]} == {culprit}
    layers = json.loads(ampdiag("layers", db, "--format", "json").stdout)
    assert layers[0]["module"].startswith(culprit + ".")  # the culprit's parameters rank first


def test_a_run_that_only_underflows_is_told_to_raise_the_scale_not_to_find_an_overflow(tmp_path, verdict):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=10000)  # a scale far too low
    db = tmp_path / "under.db"
    with ampdiag.attach(model, scaler, db=db):
        for _ in range(6):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(64, 32)).float().pow(2).mean() * 1e-4  # tiny gradients
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    code, rep = verdict(db)
    found = {f["rule"]: f for f in rep["findings"]}
    assert "underflow" in found and "overflow-origin" not in found
    advice = " ".join(s["summary"] for f in rep["findings"] for s in f["suggestions"])
    assert "overflow" not in advice.lower()
    assert "init_scale" in json.dumps(found["underflow"]["suggestions"]) + json.dumps(found["scale-collapse"]["suggestions"])
