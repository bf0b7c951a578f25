"""`ampdiag report --format json` on every sample's run.db names the planted culprit
first with the right rule; the pinned run reports healthy."""
import json

import pytest

EXPECTED = {
    "vit": ("overflow-origin", "block1.0.attn"),
    "linear_attention": ("forward-nonfinite", "encoder.0.linear_attn"),
    "camera": ("forward-nonfinite", "projection"),
}


@pytest.mark.parametrize("sample", sorted(EXPECTED))
def test_report_names_the_planted_culprit_first(sample, sample_dbs, run):
    result = run("report", sample_dbs[(sample, False)], "--format", "json")
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)
    assert not report["healthy"]
    first = report["findings"][0]
    rule, module = EXPECTED[sample]
    assert (first["rule"], first["module"]) == (rule, module)
    assert first["severity"] == "error"
    assert first["fails_gate"]
    assert module in first["suggestions"][0]["cpp"]
    assert "enabled=False" in first["suggestions"][0]["python"]


@pytest.mark.parametrize("sample", sorted(EXPECTED))
def test_pinned_run_reports_healthy(sample, sample_dbs, run):
    result = run("report", sample_dbs[(sample, True)], "--format", "json")
    assert result.returncode == 0, result.stdout
    report = json.loads(result.stdout)
    assert report["healthy"]
    assert all(f["severity"] == "info" for f in report["findings"])


def test_every_skipped_step_has_its_cause(sample_dbs, run):
    report = json.loads(run("report", sample_dbs[("vit", False)], "--format", "json").stdout)
    skipped = report["skipped_steps"]
    assert len(skipped) == report["runs"][0]["skipped"] > 0
    for step in skipped:
        assert step["nonfinite_layers"][0].startswith("block1.0.attn.")


def test_text_report_leads_with_the_verdict_and_the_fix(sample_dbs, run):
    result = run("report", sample_dbs[("vit", False)], "--color", "never")
    lines = result.stdout.splitlines()
    assert lines[0].startswith("UNHEALTHY")
    assert "block1.0.attn" in result.stdout.split("\n\n")[1]
    assert "\x1b[" not in result.stdout


def test_color_only_when_asked_or_on_a_terminal(sample_dbs, run):
    assert "\x1b[" in run("report", sample_dbs[("vit", False)], "--color", "always").stdout
    assert "\x1b[" not in run("report", sample_dbs[("vit", False)]).stdout  # a pipe is not a terminal


def test_markdown_and_junit_formats(sample_dbs, run, tmp_path):
    import xml.etree.ElementTree as ET

    md = run("report", sample_dbs[("vit", False)], "--format", "markdown").stdout
    assert md.startswith("# ampdiag report")
    assert "```python" in md
    out = tmp_path / "junit.xml"
    assert run("report", sample_dbs[("vit", False)], "--format", "junit", "-o", out).returncode == 1
    suite = ET.parse(out).getroot().find("testsuite")
    failed = [c.get("name") for c in suite.findall("testcase") if c.find("failure") is not None]
    assert "overflow-origin" in failed and "scale-collapse" in failed
    assert int(suite.get("failures")) == len(failed)


def test_fail_on_selects_the_gating_rules(sample_dbs, run):
    db = sample_dbs[("vit", False)]
    assert run("report", db, "--fail-on", "none").returncode == 0
    assert run("report", db, "--fail-on", "underflow").returncode == 0
    assert run("report", db, "--fail-on", "scale-collapse").returncode == 1
    bad = run("report", db, "--fail-on", "bogus")
    assert bad.returncode == 2 and "unknown rule 'bogus'" in bad.stderr


def test_thresholds_change_the_verdict(sample_dbs, run):
    db = sample_dbs[("vit", False)]
    rules = lambda *extra: {f["rule"] for f in json.loads(run("report", db, "--format", "json", *extra).stdout)["findings"]}
    assert "scale-collapse" in rules()
    # The scale bottoms out at 64 after 10 back-offs: a floor of 32 and a longer run allowed clear it.
    assert "scale-collapse" not in rules("--scale-floor", "32", "--backoff-run", "100")


def test_ranks_are_read_together(sample_dbs, run, tmp_path):
    import shutil
    import sqlite3

    paths = []
    for rank in (0, 1):
        path = tmp_path / f"run.rank{rank}.db"
        shutil.copy(sample_dbs[("vit", True)], path)
        with sqlite3.connect(path) as db:
            db.execute("UPDATE meta SET value = ? WHERE key = 'rank'", (str(rank),))
            db.execute("UPDATE meta SET value = '2' WHERE key = 'world_size'")
        paths.append(path)
    report = json.loads(run("report", *paths, "--format", "json").stdout)
    assert [r["rank"] for r in report["runs"]] == [0, 1]
    assert report["healthy"]
