"""Fixtures for the Python package tests: the package and CLI from the build tree (ctest
sets PYTHONPATH and AMPDIAG_CLI), and a tiny fp16 training loop."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "samples" / "python"


@pytest.fixture(scope="session")
def ampdiag_cli() -> str:
    cli = os.environ.get("AMPDIAG_CLI")
    if not cli or not Path(cli).exists():
        pytest.fail(f"AMPDIAG_CLI must name the built ampdiag binary (ctest sets it); got {cli!r}")
    return cli


@pytest.fixture()
def report(ampdiag_cli):
    """`ampdiag report --format json` on some dbs: (exit code, parsed report)."""

    def _report(*dbs):
        result = subprocess.run([ampdiag_cli, "report", *map(str, dbs), "--format", "json"], capture_output=True,
                                text=True, timeout=120)
        assert result.returncode in (0, 1), result.stderr
        return result.returncode, json.loads(result.stdout)

    return _report


def run_sample(name: str, *args, timeout=300):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SAMPLES), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, str(SAMPLES / name), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env, check=True)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 1)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def train(steps: int, attach=None, init_scale=1e9, model_factory=Tiny, dtype=torch.float16, optimizer_factory=sgd):
    """Trains `steps` fp16-autocast steps with a real torch.amp.GradScaler whose initial
    scale is high enough for the first steps to overflow. `attach(model, scaler, opt)` may
    return a handle, closed at the end. Returns (parameters, skipped steps, handle)."""
    torch.manual_seed(0)
    model = model_factory()
    optimizer = optimizer_factory(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=4)
    handle = attach(model, scaler, optimizer) if attach else None
    x, y = torch.randn(64, 16), torch.randn(64, 1)
    skipped = 0
    for _ in range(steps):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            loss = nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(optimizer)
        scaler.update()
        skipped += all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    if handle:
        handle.close()
    return [p.detach().clone() for p in model.parameters()], skipped, handle


@pytest.fixture()
def device_copies_on_the_host(monkeypatch):
    """The agent's device reads (_device_reads.py) on host tensors: every tensor read as a
    device one would be, copied to unpinned memory, under CUDA events that 'land' at the
    third look at them."""
    from ampdiag import _device_reads

    class LandsLate:
        def __init__(self):
            self.looks = 0

        def record(self, stream=None):
            pass

        def query(self):
            self.looks += 1
            return self.looks >= 3

        def synchronize(self):
            pass

    empty = torch.empty
    monkeypatch.setattr(_device_reads, "on_device", lambda t: True)
    monkeypatch.setattr(torch.cuda, "Event", LandsLate)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(torch, "empty", lambda *args, pin_memory=False, **kwargs: empty(*args, **kwargs))
