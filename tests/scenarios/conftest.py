"""What the scenarios share: the CLI from the build tree, its JSON report, reading a run.db
directly, and the step of the standard fp16 AMP loop."""
import json
import os
import sqlite3
import subprocess
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def cli() -> str:
    path = os.environ.get("AMPDIAG_CLI")
    if not path or not Path(path).exists():
        pytest.fail(f"AMPDIAG_CLI must name the built ampdiag binary (ctest sets it); got {path!r}")
    return path


@pytest.fixture()
def ampdiag(cli):
    """Runs `ampdiag ARGS...` and returns the CompletedProcess (text mode)."""

    def _run(*args):
        return subprocess.run([cli, *map(str, args)], capture_output=True, text=True, timeout=120)

    return _run


@pytest.fixture()
def verdict(ampdiag):
    """`ampdiag report DBS --format json --fail-on error`: (exit code, report)."""

    def _verdict(*dbs):
        result = ampdiag("report", *dbs, "--format", "json", "--fail-on", "error")
        assert result.returncode in (0, 1), result.stderr
        return result.returncode, json.loads(result.stdout)

    return _verdict


@pytest.fixture()
def top_finding(verdict):
    """The run at `db`'s exit code under --fail-on error and its report's first finding."""

    def _top(db):
        code, rep = verdict(db)
        assert rep["findings"], "a healthy report has no first finding"
        return code, rep["findings"][0]

    return _top


@pytest.fixture()
def healthy_through_skips(verdict):
    """Asserts that the run at `db` skipped at least one step and is healthy (exit 0 under
    --fail-on error); returns its report."""

    def _check(db):
        code, rep = verdict(db)
        assert code == 0, rep["findings"]
        assert rep["runs"][0]["skipped"] >= 1
        return rep

    return _check


def rows(db, sql):
    with sqlite3.connect(db) as c:
        return c.execute(sql).fetchall()


def rules(report, severity=None):
    return [(f["rule"], f["module"]) for f in report["findings"] if severity is None or f["severity"] == severity]


def amp_step(opt, scaler, loss_of):
    """One step of the loop torch's AMP recipe writes: zero_grad(), the loss `loss_of()`
    makes under fp16 autocast, the scaler's backward, step() and update(). Returns the loss."""
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = loss_of()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    return loss


def amp_training(db, model, opt, steps, loss_of, **options):
    """`steps` amp_step()s of `model` under ampdiag.attach(**options) with a fresh GradScaler,
    each loss made by `loss_of(generator)` from one generator seeded 0 (the batches)."""
    import ampdiag  # here, since this file's fixture `ampdiag` (the CLI) takes the name
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    with ampdiag.attach(model, scaler, db=db, **options):
        for _ in range(steps):
            amp_step(opt, scaler, lambda: loss_of(g))
