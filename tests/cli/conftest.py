"""Shared fixtures for the `ampdiag` CLI tests: the binaries under test, run.db files made
by really running the C++ samples (once per session; they need LibTorch), and synthetic
run.db files written by ampdiag_test_run (no LibTorch: the torch-free build runs those)."""
import os
import shutil
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest


def _binary(variable: str) -> Path:
    path = os.environ.get(variable)
    if not path or not Path(path).exists():
        pytest.fail(f"{variable} must name a built binary (ctest sets it); got {path!r}")
    return Path(path)


@pytest.fixture(scope="session")
def ampdiag_cli() -> Path:
    return _binary("AMPDIAG_CLI")


@pytest.fixture(scope="session")
def samples_dir() -> Path:
    if not os.environ.get("AMPDIAG_SAMPLES_DIR"):
        pytest.skip("the C++ samples need LibTorch; this is the torch-free build")
    return _binary("AMPDIAG_SAMPLES_DIR")


@pytest.fixture(scope="session")
def test_runs(tmp_path_factory) -> dict:
    """{"overflow": path, "healthy": path, "half": path}: synthetic runs (see tests/fixtures):
    the first has block1.0.attn overflowing until the scale collapses, the second is
    healthy, the third has fp16 parameters whose head.weight updates mostly round away."""
    make = _binary("AMPDIAG_TEST_RUN")
    out = tmp_path_factory.mktemp("test_runs")
    runs = {}
    for kind in ("overflow", "healthy", "half"):
        runs[kind] = out / f"{kind}.db"
        subprocess.run([str(make), kind, str(runs[kind])], check=True, capture_output=True, timeout=60)
    return runs


SAMPLES = {
    # name: (binary, module to pin)
    "vit": ("ampdiag_vit_overflow", "block1.0.attn"),
    "linear_attention": ("ampdiag_linear_attention_nan", "encoder.0.linear_attn"),
    "camera": ("ampdiag_camera_projection", "projection"),
}


@pytest.fixture(scope="session")
def sample_dbs(samples_dir, tmp_path_factory) -> dict:
    """{(sample, pinned): path of its run.db}, each produced by running the sample."""
    out = tmp_path_factory.mktemp("samples")
    dbs = {}
    for name, (binary, pin) in SAMPLES.items():
        for pinned in (False, True):
            db = out / f"{name}{'-pinned' if pinned else ''}.db"
            cmd = [str(samples_dir / binary), "--db", str(db)] + (["--pin-fp32", pin] if pinned else [])
            subprocess.run(cmd, check=True, capture_output=True, timeout=300)
            dbs[(name, pinned)] = db
    return dbs


@pytest.fixture()
def run(ampdiag_cli):
    """Runs `ampdiag ARGS...`; returns the CompletedProcess (text mode, 60 s limit)."""

    def _run(*args, **kwargs):
        return subprocess.run([str(ampdiag_cli), *map(str, args)], capture_output=True, text=True, timeout=60, **kwargs)

    return _run


@pytest.fixture(scope="session")
def chromium() -> str:
    path = shutil.which("chromium")
    if not path:
        pytest.fail("Debian's chromium is needed for the HTML test: run scripts/bootstrap")
    return path


def committed_steps(db) -> int:
    """Steps a run being written has committed; 0 before SQLite has written its schema
    (the writer creates and locks the file first)."""
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=2) as c:
            return c.execute("SELECT COUNT(*) FROM steps").fetchone()[0]
    except sqlite3.Error:
        return 0


def training_in_background(samples_dir, db, at_least):
    """The ViT sample on a very long run, returned once it has committed `at_least` steps
    (or after 120 s, or when it exits): the caller kills it."""
    proc = subprocess.Popen([str(samples_dir / "ampdiag_vit_overflow"), "--db", str(db), "--steps", "1000000"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while committed_steps(db) < at_least and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    return proc
