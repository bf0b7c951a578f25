"""Layer and module names are data. A name from the user's model (or a hostile file) may
hold quotes, backticks, newlines, NUL, terminal escape sequences and bytes that are not
UTF-8: every JSON output stays valid JSON, text never reaches the terminal raw, Markdown
and XML stay well-formed, and the suggested snippets name the module as a string literal,
never as code. Each file is a synthetic run (tests/fixtures) with its culprit renamed."""
import ast
import json
import re
import shutil
import sqlite3
import xml.etree.ElementTree as ET

import pytest

CULPRIT = "block1.0.attn"
# Closes a string and a call, clears the screen, starts a new line of code.
HOSTILE = 'block1.0.at`tn\x1b[2J"); import os #\n\r\x00'


@pytest.fixture()
def hostile_db(test_runs, tmp_path):
    path = tmp_path / "hostile.db"
    shutil.copy(test_runs["overflow"], path)
    db = sqlite3.connect(path)
    db.execute("PRAGMA journal_mode = DELETE")
    db.execute("UPDATE modules SET path = replace(path, ?1, ?2)", (CULPRIT, HOSTILE))
    db.execute("UPDATE layers SET name = replace(name, ?1, ?2), module_path = replace(module_path, ?1, ?2)", (CULPRIT, HOSTILE))
    db.execute("UPDATE replays SET module = replace(module, ?1, ?2)", (CULPRIT, HOSTILE))
    # A name that is not UTF-8 at all, as only a damaged or hostile file holds.
    db.execute("UPDATE layers SET name = CAST(x'656d626564ff2e77' AS TEXT) WHERE id = 0")
    db.commit()
    db.close()
    return path


def run_bytes(ampdiag_cli, *args):
    import subprocess

    return subprocess.run([str(ampdiag_cli), *map(str, args)], capture_output=True, timeout=60)


JSON_COMMANDS = [
    ("report", "--format", "json"),
    ("layers", "--format", "json"),
    ("timeline", "--format", "json"),
    ("info", "--format", "json"),
    ("export", "--format", "json", "--table", "layers"),
    ("export", "--format", "json", "--table", "modules"),
]


@pytest.mark.parametrize("command", JSON_COMMANDS, ids=lambda c: " ".join(c[:1] + c[-1:]))
def test_json_output_stays_valid_json(ampdiag_cli, hostile_db, command):
    result = run_bytes(ampdiag_cli, command[0], hostile_db, *command[1:])
    assert result.returncode in (0, 1), result.stderr
    json.loads(result.stdout.decode("utf-8"))  # strict: valid UTF-8 and valid JSON


def test_export_json_keeps_every_character_of_a_name(ampdiag_cli, hostile_db):
    modules = json.loads(run_bytes(ampdiag_cli, "export", hostile_db, "--format", "json", "--table", "modules").stdout)
    assert HOSTILE in [m["path"] for m in modules]  # NUL, CR and ESC included, nothing cut


TEXT_COMMANDS = [
    ("report",),
    ("report", "--format", "markdown"),
    ("report", "--color", "never"),
    ("layers",),
    ("timeline",),
    ("info",),
]


@pytest.mark.parametrize("command", TEXT_COMMANDS, ids=lambda c: " ".join(c))
def test_text_output_carries_no_control_characters(ampdiag_cli, hostile_db, command):
    result = run_bytes(ampdiag_cli, command[0], hostile_db, *command[1:])
    assert result.returncode in (0, 1), result.stderr
    text = result.stdout.decode("utf-8")  # valid UTF-8
    bad = [c for c in text if (ord(c) < 0x20 and c != "\n") or 0x7F <= ord(c) < 0xA0]
    assert not bad, bad[:5]
    if command[0] in ("report", "layers"):
        assert "\\x1b[2J" in text  # the escape is shown, not obeyed


def test_diff_text_carries_no_control_characters(ampdiag_cli, hostile_db, test_runs):
    result = run_bytes(ampdiag_cli, "diff", test_runs["healthy"], hostile_db)
    text = result.stdout.decode("utf-8")
    assert result.returncode in (0, 1) and "\x1b" not in text and "\r" not in text


def report_json(ampdiag_cli, path):
    return json.loads(run_bytes(ampdiag_cli, "report", path, "--format", "json").stdout)


def pin_suggestion(ampdiag_cli, path):
    finding = next(f for f in report_json(ampdiag_cli, path)["findings"] if f["rule"] == "overflow-origin")
    assert finding["module"] == HOSTILE
    return finding["suggestions"][0]


def test_python_snippet_names_the_module_in_a_string_literal(ampdiag_cli, hostile_db):
    snippet = pin_suggestion(ampdiag_cli, hostile_db)["python"]
    tree = ast.parse(snippet)  # still valid Python: nothing was injected
    names = [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)]
    assert HOSTILE in names
    assert not any(isinstance(node, ast.Import) for node in ast.walk(tree))


def decode_cpp_literal(literal):
    out, i = bytearray(), 1
    while literal[i] != '"':
        if literal[i] == "\\":
            if literal[i + 1] in "01234567":
                out.append(int(literal[i + 1 : i + 4], 8))
                i += 4
            else:
                out += literal[i + 1].encode()
                i += 2
        else:
            out += literal[i].encode()
            i += 1
    return bytes(out), i + 1


def test_cpp_snippet_names_the_module_in_a_string_literal(ampdiag_cli, hostile_db):
    snippet = pin_suggestion(ampdiag_cli, hostile_db)["cpp"]
    first = snippet.index("pins({") + len("pins({")
    value, end = decode_cpp_literal(snippet[first:])
    assert value == HOSTILE.encode()
    assert snippet[first + end :].startswith("});")
    assert snippet.count("\n") == 2  # no line was added by the name


def test_markdown_names_are_code_spans_that_hold_the_whole_name(ampdiag_cli, hostile_db):
    text = run_bytes(ampdiag_cli, "report", hostile_db, "--format", "markdown").stdout.decode()
    module_line = next(line for line in text.splitlines() if line.startswith("- module: "))
    assert re.fullmatch(r"- module: (`+)[^`].*[^`]\1", module_line), module_line
    assert "``block1.0.at`tn\\x1b[2J\"); import os #\\x0a\\x0d\\x00``" in module_line


def test_junit_and_html_stay_well_formed(ampdiag_cli, hostile_db, tmp_path):
    junit = tmp_path / "r.xml"
    run_bytes(ampdiag_cli, "report", hostile_db, "--format", "junit", "-o", junit)
    ET.parse(junit)  # XML 1.0 forbids control characters: the parser rejects them
    html = tmp_path / "r.html"
    run_bytes(ampdiag_cli, "report", hostile_db, "--format", "html", "-o", html)
    assert "\x1b" not in html.read_text(encoding="utf-8")
