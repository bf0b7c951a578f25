"""Damaged and hostile run.db files: every command that reads the damage exits 2 with one
line naming the file, never a verdict read around it, a huge allocation or a hang. Each
file is made here from a synthetic run (tests/fixtures), so the torch-free build runs them."""
import json
import random
import shutil
import sqlite3

import pytest

TABLES = ["meta", "layers", "modules", "steps", "grad_stats", "act_stats", "events", "replays", "grad_samples", "grad_hist_sums"]
# What `export --table` writes out (the writer's summaries are derived from grad_stats).
EXPORTED = TABLES[:8]
# A file as written before the writer kept summaries: readers scan every grad_stats row.
WITHOUT_SUMMARIES = ("DROP TABLE grad_samples", "DROP TABLE grad_hist_sums")
# The commands that read every table, and the export of one table.
READERS = [("report",), ("layers",), ("timeline",), ("info",)]


def one_line_error(result, *words):
    assert result.returncode == 2, (result.returncode, result.stdout[-400:], result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def copy_of(test_runs, tmp_path, name="hostile.db"):
    """A copy of a finished run with everything in the main file (no WAL)."""
    path = tmp_path / name
    shutil.copy(test_runs["overflow"], path)
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA journal_mode = DELETE")
    return path


def edit(path, *statements):
    db = sqlite3.connect(path)
    for sql in statements:
        db.execute(sql)
    db.commit()
    db.close()


@pytest.mark.parametrize("table", TABLES)
def test_a_table_whose_root_page_is_overwritten_is_an_error_in_every_reader(run, test_runs, tmp_path, table):
    path = copy_of(test_runs, tmp_path)
    with sqlite3.connect(path) as db:
        root = db.execute("SELECT rootpage FROM sqlite_master WHERE name = ?", (table,)).fetchone()[0]
        page_size = db.execute("PRAGMA page_size").fetchone()[0]
    data = bytearray(path.read_bytes())
    offset = (root - 1) * page_size
    data[offset : offset + page_size] = b"\xa5" * page_size
    path.write_bytes(bytes(data))
    exports = [("export", "--format", "csv", "--table", table)] if table in EXPORTED else []
    # This run recorded no histograms: only `info` reads their (empty) sums.
    readers = [("info",)] if table == "grad_hist_sums" else READERS
    for command in readers + exports:
        one_line_error(run(command[0], path, *command[1:]), str(path))


@pytest.mark.parametrize(
    "statement, words",
    [
        ("UPDATE grad_stats SET step = -1 WHERE step = 3", ["corrupt run.db", "grad_stats", "-1"]),
        (
            ("UPDATE grad_stats SET layer_id = 1000000000 WHERE step = 3 AND layer_id = 2",) + WITHOUT_SUMMARIES,
            ["corrupt run.db", "grad_stats", "layer 1000000000"],
        ),
        (
            "UPDATE grad_samples SET samples = CAST(x'00ca9a3b' || substr(samples, 5) AS BLOB) WHERE id = 3",
            ["corrupt run.db", "grad_samples", "layer 1000000000"],
        ),
        (
            "UPDATE grad_samples SET samples = substr(samples, 1, 30) WHERE id = 3",
            ["corrupt run.db", "grad_samples", "whole number"],
        ),
        ("UPDATE grad_stats SET step = 4611686018427387904 WHERE step = 59", ["corrupt run.db", "4611686018427387904"]),
        ("UPDATE grad_stats SET step = 9223372036854775807 WHERE step = 59", ["corrupt run.db", "9223372036854775807"]),
        ("UPDATE steps SET step = 9223372036854775807 WHERE step = 59", ["corrupt run.db", "steps"]),
        ("UPDATE steps SET step = -5 WHERE step = 0", ["corrupt run.db", "steps"]),
    ],
    ids=["negative step", "huge layer id", "huge layer id in a summary", "summary cut short", "step 2^62", "step INT64_MAX", "steps row at INT64_MAX", "negative steps row"],
)
def test_values_the_writer_never_writes_are_rejected(run, test_runs, tmp_path, statement, words):
    path = copy_of(test_runs, tmp_path)
    edit(path, *((statement,) if isinstance(statement, str) else statement))
    for command in [("report",), ("layers",), ("timeline",)]:
        one_line_error(run(command[0], path, *command[1:]), str(path), *words)


def test_a_histogram_blob_of_the_wrong_size_is_an_error(run, test_runs, tmp_path):
    path = copy_of(test_runs, tmp_path)
    edit(path, "UPDATE grad_stats SET histogram = x'010203' WHERE step = 3 AND layer_id = 0",
         "INSERT OR REPLACE INTO meta VALUES ('histogram', '1')")
    one_line_error(run("export", path, "--format", "json", "--table", "grad_stats"), "histogram of 3 bytes")
    one_line_error(run("report", path), "histogram of 3 bytes")


def test_an_activation_histogram_blob_of_the_wrong_size_is_an_error(run, test_runs, tmp_path):
    path = copy_of(test_runs, tmp_path)
    edit(path, "UPDATE act_stats SET histogram = x'010203' WHERE (step, fwd_order) = (SELECT step, fwd_order FROM act_stats LIMIT 1)",
         "INSERT OR REPLACE INTO meta VALUES ('histogram', '1')")
    one_line_error(run("export", path, "--format", "json", "--table", "act_stats"), "act_stats row", "histogram of 3 bytes")
    one_line_error(run("fp8", path), "act_stats row", "histogram of 3 bytes")


def test_a_table_replaced_by_an_endless_recursive_view_is_refused_at_once(run, test_runs, tmp_path):
    path = copy_of(test_runs, tmp_path)
    edit(path, "DROP TABLE steps",
         "CREATE VIEW steps AS WITH RECURSIVE n(step) AS (SELECT 0 UNION ALL SELECT step + 1 FROM n) "
         "SELECT step, 1.0 AS loss, 1 AS losses, 1.0 AS scale_before, 1.0 AS scale_after, 0 AS found_inf, 0 AS skipped, "
         "1 AS sampled, 0 AS step_ns, 0 AS agent_ns, 0.0 AS wall_time FROM n")
    for command in READERS + [("export", "--format", "csv", "--table", "steps")]:
        one_line_error(run(command[0], path, *command[1:]), "steps is a view")


def test_a_missing_table_is_named(run, test_runs, tmp_path):
    path = copy_of(test_runs, tmp_path)
    edit(path, "DROP TABLE act_stats")
    one_line_error(run("report", path), "no table act_stats")


def test_a_file_damaged_below_its_schema_is_called_damaged_not_foreign(run, test_runs, tmp_path):
    path = copy_of(test_runs, tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    one_line_error(run("info", path), "a damaged SQLite database", "truncated or corrupted")


def damaged_in_many_places(test_runs, tmp_path):
    """A run with a long events table, bytes scrambled in one of its pages until SQLite's
    quick_check reports at least three problems (a fixed seed: the same file each time)."""
    clean = copy_of(test_runs, tmp_path, "clean.db")
    edit(clean, *["INSERT INTO events (step, kind, detail, wall_time) VALUES (0, 'note', '%s', 0)" % ("x" * 500)] * 2000)
    with sqlite3.connect(clean) as db:
        page_size = db.execute("PRAGMA page_size").fetchone()[0]
    data = clean.read_bytes()
    rng = random.Random(1)
    path = tmp_path / "damaged.db"
    for _ in range(500):
        mutant = bytearray(data)
        page = rng.randrange(len(data) // page_size // 2, len(data) // page_size)
        offset = page * page_size + rng.randrange(0, 200)
        mutant[offset : offset + 8] = bytes(rng.randrange(256) for _ in range(8))
        path.write_bytes(bytes(mutant))
        try:
            with sqlite3.connect(path) as db:
                problems = [line for row in db.execute("PRAGMA quick_check") for line in row[0].splitlines()]
        except sqlite3.DatabaseError:
            continue
        if len([p for p in problems if not p.startswith("***")]) >= 3:
            return path
    pytest.fail("no mutant with three quick_check problems in 500 tries")


def test_info_on_a_damaged_file_says_so_in_one_line_and_lists_every_problem_with_verbose(run, test_runs, tmp_path):
    path = damaged_in_many_places(test_runs, tmp_path)
    result = run("info", path)
    line = one_line_error(result, str(path), "--verbose lists them")
    assert "layers:" in result.stdout and "integrity:       DAMAGED" in result.stdout  # what it could read is still shown
    verbose = run("info", path, "--verbose")
    assert verbose.returncode == 2
    lines = verbose.stderr.strip().splitlines()
    assert lines[0].startswith(line.split(" (and ")[0])
    assert len(lines) >= 3 and all(str(path) in l for l in lines), verbose.stderr


def test_info_says_which_integrity_check_ran(run, test_runs):
    path = test_runs["overflow"]
    assert "ok (SQLite quick_check; --full-check runs integrity_check)" in run("info", path).stdout
    assert "ok (SQLite integrity_check)" in run("info", path, "--full-check").stdout
    assert json.loads(run("info", path, "--full-check", "--format", "json").stdout)["integrity_check"] == "integrity_check"


def test_damage_only_the_full_check_finds_fails_info_with_full_check(run, test_runs, tmp_path):
    # A layer's name changed in the table but not in its UNIQUE index: quick_check does
    # not compare indexes with their tables.
    path = copy_of(test_runs, tmp_path)
    with sqlite3.connect(path) as db:
        root = db.execute("SELECT rootpage FROM sqlite_master WHERE name = 'layers'").fetchone()[0]
        page_size = db.execute("PRAGMA page_size").fetchone()[0]
        name = db.execute("SELECT name FROM layers WHERE id = 0").fetchone()[0].encode()
    data = bytearray(path.read_bytes())
    at = data.find(name, (root - 1) * page_size, root * page_size)
    assert at >= 0
    data[at + len(name) - 1] ^= 0x01
    path.write_bytes(bytes(data))
    assert run("info", path).returncode == 0
    one_line_error(run("info", path, "--full-check"), "integrity_check", "missing from index")
