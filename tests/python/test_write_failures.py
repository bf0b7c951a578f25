"""The log never kills training and never lies about what it wrote: a full disk (a file-size
limit with SIGXFSZ ignored: writes fail with EFBIG, as on a full disk), a path that cannot
be created, two writers on one file, a NUL byte in a path."""
import os
import re
import resource
import signal
import sqlite3
import subprocess
import sys
import textwrap

import pytest
import torch

import ampdiag
from conftest import SAMPLES, Tiny, train


def limit_file_size(size):
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    return apply


def python_sample(db, preexec_fn=None, steps=60):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SAMPLES), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, str(SAMPLES / "vit_overflow.py"), "--db", str(db), "--steps", str(steps)],
                          capture_output=True, text=True, timeout=300, env=env, preexec_fn=preexec_fn)


def rows_in(db):
    with sqlite3.connect(db) as c:
        return sum(c.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in ("steps", "grad_stats", "act_stats"))


def test_a_full_disk_mid_run_keeps_training_and_counts_only_committed_rows(tmp_path, ampdiag_cli):
    db = tmp_path / "run.db"
    result = python_sample(db, limit_file_size(500_000))
    assert result.returncode == 0, result.stderr
    written, dropped, lost = map(int, re.search(r"\((\d+) rows, (\d+) dropped, (\d+) lost to a write error", result.stdout).groups())
    assert written == rows_in(db)  # the status counts what the file holds
    # Every record is accounted for: per step one step row and 28 gradients, and on the 6
    # steps with full activation statistics (activation_every = 10; the forward stays finite)
    # 16 module outputs (attn and mlp in each block return their last child's output, and
    # GELU's output is bounded by its input: no rows of their own).
    assert lost > 0 and written + lost + dropped == 60 * (1 + 28) + 6 * 16
    assert result.stderr.count("ampdiag: writing") == 1  # logged once
    # The run is not finished; whether the file could also be told what it lost depends on
    # whether the last try found room (tests/agent_core covers that path deterministically).
    report = subprocess.run([ampdiag_cli, "report", db], capture_output=True, text=True)
    assert report.returncode == 2 and "--allow-partial" in report.stderr
    with sqlite3.connect(db) as c:
        recorded = c.execute("SELECT value FROM meta WHERE key = 'lost_records'").fetchone()
    if recorded:
        assert recorded[0] == str(lost) and f"{lost} records were lost" in report.stderr
        partial = subprocess.run([ampdiag_cli, "report", db, "--allow-partial"], capture_output=True, text=True)
        if written:
            assert f"WRITING FAILED: {lost} records lost" in partial.stdout
        else:  # a loaded machine: the writer's first transaction was already past the limit
            assert partial.returncode == 2 and "holds no steps" in partial.stderr


@pytest.mark.parametrize("case", ["missing directory", "a directory", "full disk"])
def test_a_db_that_cannot_be_created_stops_the_sample_with_one_line(tmp_path, case):
    db = {"missing directory": tmp_path / "nope" / "run.db", "a directory": tmp_path, "full disk": tmp_path / "run.db"}[case]
    # 3 KiB: enough for Python's and torch's own start (tempfile probes with a few bytes;
    # torch 2.5 writes a 2.3 KiB generated module at import), not for SQLite's 4 KiB page.
    result = python_sample(db, limit_file_size(3072) if case == "full disk" else None, steps=2)
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and str(db) in result.stderr, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing half-created


def test_a_second_attach_to_a_db_being_written_is_refused_and_the_first_run_keeps_its_steps(tmp_path):
    db = tmp_path / "run.db"
    first = ampdiag.attach(Tiny(), torch.amp.GradScaler("cpu"), db=db)
    with pytest.raises(ampdiag.RunDbError, match="another ampdiag writer"):
        ampdiag.attach(Tiny(), torch.amp.GradScaler("cpu"), db=db, overwrite=True)
    first.close()
    _, _, handle = train(6, attach=lambda m, s, o: ampdiag.attach(m, s, db=db, overwrite=True))
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT COUNT(*) FROM steps").fetchone()[0] == 6
    assert handle.status["dropped"] == 0 and handle.status["lost"] == 0


def test_attach_inside_the_epoch_loop_is_told_to_attach_once_and_the_first_epoch_is_kept(tmp_path):
    db = tmp_path / "run.db"
    model, scaler = Tiny(), torch.amp.GradScaler("cpu")
    train(4, attach=lambda m, s, o: ampdiag.attach(m, s, db=db))
    with pytest.raises(ampdiag.RunDbError, match=r"already exists.*attach once, before the epoch loop") as refused:
        ampdiag.attach(model, scaler, db=db)
    assert "overwrite=True would replace the epochs it holds" in str(refused.value)
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT COUNT(*) FROM steps").fetchone()[0] == 4


def test_a_db_left_by_another_process_is_refused_without_the_epoch_loop_hint(tmp_path):
    db = tmp_path / "run.db"
    subprocess.run([sys.executable, "-c", f"import sqlite3; sqlite3.connect({str(db)!r}).close()"], check=True)
    with pytest.raises(ampdiag.RunDbError, match="already exists") as refused:
        ampdiag.attach(Tiny(), torch.amp.GradScaler("cpu"), db=db)
    assert "epoch loop" not in str(refused.value)


def test_a_writer_in_another_process_holds_its_db(tmp_path):
    db = tmp_path / "run.db"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, torch, ampdiag
        from torch import nn
        h = ampdiag.attach(nn.Linear(2, 2), torch.amp.GradScaler("cpu"), db={str(db)!r})
        print("ready", flush=True)
        sys.stdin.readline()
        h.close()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(ampdiag.RunDbError, match="another ampdiag writer"):
            ampdiag.attach(Tiny(), torch.amp.GradScaler("cpu"), db=db, overwrite=True)
    finally:
        holder.communicate("\n", timeout=60)
    assert holder.returncode == 0
    with sqlite3.connect(db) as c:  # the holder's run, closed normally
        assert c.execute("SELECT value FROM meta WHERE key = 'finished_at'").fetchone()


def test_a_db_path_with_a_nul_byte_is_refused(tmp_path):
    with pytest.raises((ampdiag.RunDbError, ValueError), match="NUL|null"):
        ampdiag.attach(Tiny(), torch.amp.GradScaler("cpu"), db=str(tmp_path / "run") + "\0.db")
    assert list(tmp_path.iterdir()) == []


def test_a_finished_run_is_one_file(tmp_path):
    db = tmp_path / "run.db"
    train(3, attach=lambda m, s, o: ampdiag.attach(m, s, db=db))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.db"]  # no -wal or -shm left beside it


DEFERRED_WORKER = textwrap.dedent("""
    import multiprocessing, sys, torch, ampdiag
    sys.path.insert(0, {tests!r})
    from conftest import train

    def worker(db, out):
        # A spawned worker before init_process_group: attach() defers creating the db to
        # the first step, where it finds it held by the parent.
        try:
            params, skipped, handle = train(6, attach=lambda m, s, o: ampdiag.attach(m, s, db=db, overwrite=True))
        except Exception as e:  # what must not happen: the log stopping the training
            out.put(("raised", repr(e), {{"write_errors": -1}}))
            return
        plain, plain_skipped, _ = train(6)
        out.put((all(torch.equal(a, b) for a, b in zip(params, plain)), skipped == plain_skipped, handle.status))

    if __name__ == "__main__":
        db = {db!r}
        holder = ampdiag.attach(torch.nn.Linear(2, 2), torch.amp.GradScaler("cpu"), db=db)
        ctx = multiprocessing.get_context("spawn")
        out = ctx.Queue()
        p = ctx.Process(target=worker, args=(db, out))
        p.start()
        same, same_skips, status = out.get(timeout=240)
        p.join()
        holder.close()
        print(same, same_skips, status["write_errors"], p.exitcode)
""")


def test_a_deferred_db_that_cannot_be_created_at_the_first_step_leaves_training_untouched(tmp_path):
    script = tmp_path / "deferred.py"
    script.write_text(DEFERRED_WORKER.format(tests=str(SAMPLES.parents[1] / "tests" / "python"), db=str(tmp_path / "run.db")))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "True", "1", "0"]  # bit-identical training, one write error, exit 0
    assert result.stderr.count("ampdiag: cannot record this run") == 1
