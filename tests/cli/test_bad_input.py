"""Bad input to the CLI: one clear line on stderr, exit code 2, never a crash or a hang."""
import os
import shutil
import sqlite3
import time

import pytest


def assert_one_line_error(result, *words):
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for word in words:
        assert word in lines[0], lines[0]


def test_missing_file(run, tmp_path):
    assert_one_line_error(run("report", tmp_path / "nope.db"), "nope.db", "no such file")


def test_not_a_sqlite_file(run, tmp_path):
    path = tmp_path / "notes.db"
    path.write_text("hello, this is not a database at all\n" * 20)
    assert_one_line_error(run("report", path), "not a SQLite database")


def test_a_sqlite_file_that_is_not_a_run(run, tmp_path):
    path = tmp_path / "other.db"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE t (x)")
    assert_one_line_error(run("report", path), "not an ampdiag run.db")


def test_zero_byte_file(run, tmp_path):
    path = tmp_path / "empty.db"
    path.write_bytes(b"")
    assert_one_line_error(run("report", path), "is empty")


def test_run_without_steps(run, sample_dbs, tmp_path):
    path = tmp_path / "nosteps.db"
    shutil.copy(sample_dbs[("camera", True)], path)
    with sqlite3.connect(path) as db:
        db.execute("DELETE FROM steps")
    assert_one_line_error(run("report", path), "holds no steps")


def test_truncated_run(run, sample_dbs, tmp_path):
    path = tmp_path / "truncated.db"
    data = sample_dbs[("vit", False)].read_bytes()
    path.write_bytes(data[: len(data) // 3])
    result = run("report", path)
    assert_one_line_error(result, str(path))


def test_corrupted_run(run, sample_dbs, tmp_path):
    path = tmp_path / "corrupted.db"
    data = bytearray(sample_dbs[("vit", False)].read_bytes())
    for offset in range(16384 * 2, len(data), 4096):  # scribble over pages after the first two
        data[offset : offset + 64] = os.urandom(64)
    path.write_bytes(bytes(data))
    assert_one_line_error(run("report", path), str(path))


def test_run_from_a_newer_format(run, sample_dbs, tmp_path):
    path = tmp_path / "future.db"
    shutil.copy(sample_dbs[("camera", True)], path)
    with sqlite3.connect(path) as db:
        db.execute("UPDATE meta SET value = '7' WHERE key = 'schema_version'")
    assert_one_line_error(run("report", path), "newer", "upgrade")


def _unfinished_copy(sample_dbs, tmp_path, pid):
    path = tmp_path / "live.db"
    shutil.copy(sample_dbs[("camera", True)], path)
    with sqlite3.connect(path) as db:
        db.execute("DELETE FROM meta WHERE key = 'finished_at'")
        db.execute("UPDATE meta SET value = ? WHERE key = 'pid'", (str(pid),))
    return path


def test_run_still_being_written(run, sample_dbs, tmp_path):
    path = _unfinished_copy(sample_dbs, tmp_path, os.getpid())  # a live process "writes" it
    assert_one_line_error(run("report", path), "still being written", "--allow-partial")


def test_run_whose_process_died(run, sample_dbs, tmp_path):
    path = _unfinished_copy(sample_dbs, tmp_path, 2**22 + 12345)
    assert_one_line_error(run("report", path), "was not closed", "--allow-partial")


def test_allow_partial_reports_what_is_there(run, sample_dbs, tmp_path):
    path = _unfinished_copy(sample_dbs, tmp_path, os.getpid())
    result = run("report", path, "--allow-partial")
    assert result.returncode == 0
    assert "not finished" in result.stderr


def test_unwritable_output(run, sample_dbs, tmp_path):
    assert_one_line_error(run("report", sample_dbs[("vit", True)], "-o", tmp_path / "no" / "dir" / "r.html"), "cannot write")


@pytest.mark.parametrize("args,words", [
    (["report"], ["at least one run.db"]),
    (["report", "x.db", "--format", "pdf"], ["--format must be one of"]),
    (["report", "x.db", "--skip-rate", "2"], ["--skip-rate takes a number"]),
    (["report", "x.db", "--precision-error", "-1"], ["--precision-error takes a number"]),
    (["report", "x.db", "--frobnicate"], ["unknown option"]),
    (["layers"], ["exactly one run.db"]),
    (["diff", "a.db"], ["BASE.db and NEW.db"]),
    (["export", "x.db"], ["--format csv|json is required"]),
    (["nonsense"], ["unknown command"]),
])
def test_usage_errors(run, args, words):
    assert_one_line_error(run(*args), *words)


def test_run_whose_killed_process_is_not_reaped_yet(run, sample_dbs, tmp_path):
    # A zombie: exited, its parent (this test) not waiting for it yet, as when a container's
    # init is slow to reap a killed trainer. kill(pid, 0) still finds it; it writes nothing.
    child = os.fork()
    if child == 0:
        os._exit(0)
    try:
        deadline = time.monotonic() + 10
        while _state(child) != "Z" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _state(child) == "Z"
        path = _unfinished_copy(sample_dbs, tmp_path, child)
        assert_one_line_error(run("report", path), "was not closed", "--allow-partial")
    finally:
        os.waitpid(child, 0)


def _state(pid):
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]
