"""The C++ samples and the agent under write failures: training is never killed by the
log, a db that cannot be created is one line and exit 2 with nothing left behind, counts
are what the file holds, and a db being written is not taken over by a second writer.
A full disk is a file-size limit with SIGXFSZ ignored (writes fail with EFBIG)."""
import os
import re
import resource
import shutil
import signal
import sqlite3
import subprocess
import tempfile

import pytest

from conftest import training_in_background

# 60 steps of a step row and 28 gradient rows, and 6 activation rows on the 6 steps with full
# activation statistics (0, 10, ..., 50: activation_every = 10); the forward stays finite.
RECORDS = 60 * (1 + 28) + 6 * 6


def limit_file_size(size):
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    return apply


def vit(samples_dir, db, *args, **kwargs):
    return subprocess.run([str(samples_dir / "ampdiag_vit_overflow"), "--db", str(db), *map(str, args)],
                          capture_output=True, text=True, timeout=300, **kwargs)


def rows_in(db):
    with sqlite3.connect(db) as c:
        return sum(c.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in ("steps", "grad_stats", "act_stats"))


def test_a_full_disk_mid_run_keeps_training_and_counts_only_committed_rows(samples_dir, tmp_path, run):
    db = tmp_path / "run.db"
    result = vit(samples_dir, db, preexec_fn=limit_file_size(500_000))
    assert result.returncode == 0, result.stderr
    assert "steps 60" in result.stdout  # training ran to the end
    written, dropped, lost = map(int, re.search(r"\((\d+) rows, (\d+) dropped, (\d+) lost to a write error", result.stdout).groups())
    assert written == rows_in(db) and lost > 0
    assert written + dropped + lost == RECORDS
    assert result.stderr.count("ampdiag: writing") == 1
    info = run("info", db)
    assert "not an ampdiag run.db" not in info.stderr and "steps:" in info.stdout


def without_write_permission():
    """How this process can try a directory it may not write: as root (which may write
    anywhere), by running the sample as nobody."""
    if os.geteuid() != 0:
        return {}
    try:
        import pwd
        return {"user": pwd.getpwnam("nobody").pw_uid}
    except KeyError:
        pytest.skip("running as root and there is no 'nobody' user to drop to")


@pytest.mark.parametrize("case", ["missing directory", "a directory", "full disk", "no write permission", "64 KiB free"])
def test_a_db_that_cannot_be_created_is_one_line_and_exit_2_with_nothing_left(samples_dir, case):
    top = tempfile.mkdtemp(prefix="ampdiag-unwritable-")
    try:
        os.chmod(top, 0o755)
        db = os.path.join(top, "run.db")
        kwargs = {}
        if case == "missing directory":
            db = os.path.join(top, "nope", "run.db")
        elif case == "a directory":
            db = top
        elif case == "full disk":
            kwargs["preexec_fn"] = limit_file_size(0)
        elif case == "64 KiB free":
            kwargs["preexec_fn"] = limit_file_size(64 * 1024)
        else:
            os.chmod(top, 0o555)
            kwargs.update(without_write_permission())
        result = vit(samples_dir, db, "--steps", "2", **kwargs)
        assert result.returncode == 2, (result.returncode, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and db in lines[0] and "terminate" not in lines[0], result.stderr
        assert os.listdir(top) == []  # no half-created file that `info` would call "not an ampdiag run.db"
    finally:
        os.chmod(top, 0o755)
        shutil.rmtree(top)


def test_a_second_process_cannot_take_over_a_db_being_written(samples_dir, tmp_path, run):
    db = tmp_path / "run.db"
    first = training_in_background(samples_dir, db, 1)
    try:
        second = vit(samples_dir, db, "--steps", "2")  # the samples always overwrite
        assert second.returncode == 2 and "another ampdiag writer" in second.stderr, second.stderr
        assert rows_in(db) > 0  # the first run's steps are still there
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert run("report", db, "--allow-partial").returncode in (0, 1)
