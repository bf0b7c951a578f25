"""Writes tests/fuzz/regressions/: the hostile run.db files that once made a reader fail
(issue 9: silent verdicts, a 22 GiB allocation, signed overflow, a null memcpy, a hang),
each as small as SQLite allows (1 KiB pages). Inputs the fuzzer finds later are added to
the directory as they are. Usage: python make_regressions.py TEST_RUN_BINARY"""
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

OUT = Path(__file__).parent / "regressions"


def small_copy(src, dst):
    shutil.copy(src, dst)
    db = sqlite3.connect(dst)
    db.execute("PRAGMA journal_mode = DELETE")
    db.execute("PRAGMA page_size = 1024")
    db.execute("VACUUM")
    db.close()


def edited(base, name, *statements):
    path = OUT / name
    shutil.copy(base, path)
    db = sqlite3.connect(path)
    for sql in statements:
        db.execute(sql)
    db.commit()
    db.close()


def page_overwritten(base, name, table):
    path = OUT / name
    shutil.copy(base, path)
    with sqlite3.connect(path) as db:
        root = db.execute("SELECT rootpage FROM sqlite_master WHERE name = ?", (table,)).fetchone()[0]
        size = db.execute("PRAGMA page_size").fetchone()[0]
    data = bytearray(path.read_bytes())
    data[(root - 1) * size : root * size] = b"\xa5" * size
    path.write_bytes(bytes(data))


def main():
    OUT.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run.db"
        subprocess.run([sys.argv[1], "overflow", str(run)], check=True)
        base = Path(tmp) / "small.db"
        small_copy(run, base)
        write_all(base)


def write_all(base):
    edited(base, "negative-grad-step.db", "UPDATE grad_stats SET step = -1 WHERE step = 4")
    edited(base, "huge-layer-id.db", "UPDATE grad_stats SET layer_id = 1000000000 WHERE step = 4 AND layer_id = 2")
    edited(base, "grad-step-2-62.db", "UPDATE grad_stats SET step = 4611686018427387904 WHERE step = 59")
    edited(base, "steps-row-int64-max.db", "UPDATE steps SET step = 9223372036854775807 WHERE step = 59")
    edited(base, "short-histogram.db", "UPDATE grad_stats SET histogram = x'010203' WHERE step = 4 AND layer_id = 0",
           "INSERT OR REPLACE INTO meta VALUES ('histogram', '1')")
    edited(base, "recursive-view.db", "DROP TABLE steps",
           "CREATE VIEW steps AS WITH RECURSIVE n(step) AS (SELECT 0 UNION ALL SELECT step + 1 FROM n) "
           "SELECT step, 1.0 AS loss, 1 AS losses, 1.0 AS scale_before, 1.0 AS scale_after, 0 AS found_inf, "
           "0 AS skipped, 1 AS sampled, 0 AS step_ns, 0 AS agent_ns, 0.0 AS wall_time FROM n")
    page_overwritten(base, "grad-stats-root-overwritten.db", "grad_stats")
    page_overwritten(base, "layers-root-overwritten.db", "layers")


if __name__ == "__main__":
    main()
