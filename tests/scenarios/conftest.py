"""What the scenarios share: the CLI from the build tree, its JSON report, and reading a
run.db directly."""
import json
import os
import sqlite3
import subprocess
from pathlib import Path

import pytest


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


def rows(db, sql):
    with sqlite3.connect(db) as c:
        return c.execute(sql).fetchall()


def rules(report, severity=None):
    return [(f["rule"], f["module"]) for f in report["findings"] if severity is None or f["severity"] == severity]
