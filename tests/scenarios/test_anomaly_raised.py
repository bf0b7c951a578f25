"""torch.autograd.set_detect_anomaly(True), which users turn on to find where a NaN comes
from, in an fp16 loop with a GradScaler: the scaler's first step at a scale too high
overflows on purpose (it then skips the step and lowers the scale), anomaly detection raises
at the NaN that overflow makes in the backward, and the training stops with torch's
"Function 'AddmmBackward0' returned nan values". The report must say it was the scaler's to
skip, and the same loop without anomaly detection trains through and is healthy."""
import subprocess

import pytest
import torch
from torch import nn

import ampdiag
from conftest import amp_step


def train(db, anomaly, steps=12):
    """A healthy MLP whose scaler starts at 2^24, which its gradients overflow; returns the
    steps it completed."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)

    def loss():
        x = torch.randn(64, 32)
        return nn.functional.mse_loss(model(x).float(), x[:, :1])

    done = 0
    with torch.autograd.set_detect_anomaly(anomaly), ampdiag.attach(model, scaler, db=db):
        for _ in range(steps):
            amp_step(opt, scaler, loss)
            done += 1
    return done


def test_anomaly_detection_raising_on_the_scalers_overflow_says_to_turn_it_off(tmp_path, cli):
    # It raised in the first step's backward: the run.db holds no step, and the report's
    # error says why and what to do.
    db = tmp_path / "raised.db"
    with pytest.warns(UserWarning), pytest.raises(RuntimeError, match="returned nan values"):
        train(db, anomaly=True)
    result = subprocess.run([cli, "report", str(db), "--fail-on", "error"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "holds no steps: before its first step was recorded, the training raised RuntimeError: Function '" in result.stderr
    assert "Turn anomaly detection off (torch.autograd.set_detect_anomaly(False)) with a GradScaler" in result.stderr


def test_the_same_loop_without_anomaly_detection_skips_those_steps_and_is_healthy(tmp_path, healthy_through_skips):
    db = tmp_path / "skipped.db"
    assert train(db, anomaly=False) == 12
    healthy_through_skips(db)
