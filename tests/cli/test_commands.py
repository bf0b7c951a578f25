"""The other commands: help, layers, timeline, diff, export, info."""
import csv
import io
import json
import shutil
import sqlite3

import pytest


@pytest.mark.parametrize("command", ["report", "layers", "timeline", "diff", "export", "info", "whatif", "fp8"])
def test_every_command_has_help(run, command):
    result = run(command, "--help")
    assert result.returncode == 0
    assert result.stdout.startswith(f"usage: ampdiag {command}")


def test_top_level_help_and_version(run):
    assert run("--help").stdout.startswith("ampdiag: find the layer")
    assert run("--version").stdout.startswith("ampdiag 0.1.0")


def test_version_names_the_run_db_format_the_writer_writes(run, test_runs):
    info = json.loads(run("info", test_runs["healthy"], "--format", "json").stdout)
    assert f"writes run.db format {info['format']}," in run("--version").stdout


def test_layers_sorts_least_headroom_first(run, sample_dbs):
    rows = list(csv.DictReader(io.StringIO(run("layers", sample_dbs[("vit", True)], "--csv").stdout)))
    assert len(rows) == 28  # embed 2, two blocks of 12, head 2
    least = [float(r["least_headroom_bits"]) for r in rows if r["least_headroom_bits"] != "-"]
    assert least == sorted(least)


def test_layers_sort_by_first_in_backward(run, sample_dbs):
    rows = list(csv.DictReader(io.StringIO(run("layers", sample_dbs[("vit", False)], "--csv", "--sort", "first", "--top", "1").stdout)))
    assert len(rows) == 1
    assert rows[0]["layer"].startswith("block1.0.attn.")


def test_timeline_has_a_row_per_step(run, sample_dbs):
    rows = list(csv.DictReader(io.StringIO(run("timeline", sample_dbs[("vit", False)], "--csv").stdout)))
    assert len(rows) == 60
    assert rows[0]["skipped"] == "1" and rows[0]["first_nonfinite_gradient"].startswith("block1.0.attn.")


def test_timeline_every_keeps_skipped_steps(run, sample_dbs):
    rows = list(csv.DictReader(io.StringIO(run("timeline", sample_dbs[("vit", False)], "--csv", "--every", "1000").stdout)))
    assert {r["step"] for r in rows} >= {"0", "20", "41"}


def test_timeline_spells_out_a_nan_or_inf_loss(run, sample_dbs, tmp_path):
    # A NaN loss is kept as NULL: it read "-", as if no loss had been recorded.
    path = tmp_path / "nan_loss.db"
    shutil.copy(sample_dbs[("vit", False)], path)
    with sqlite3.connect(path) as db:
        db.execute("UPDATE steps SET loss = NULL WHERE step = 0")
        db.execute("UPDATE steps SET loss = ? WHERE step = 1", (float("inf"),))
    rows = list(csv.DictReader(io.StringIO(run("timeline", path, "--csv").stdout)))
    assert (rows[0]["loss"], rows[1]["loss"]) == ("nan", "inf")
    assert float(rows[2]["loss"]) > 0


def test_diff_flags_a_regression(run, sample_dbs):
    result = run("diff", sample_dbs[("vit", True)], sample_dbs[("vit", False)])
    assert result.returncode == 1
    assert "worse" in result.stdout and "overflow-origin" in result.stdout


def test_diff_of_a_run_with_itself_is_clean(run, sample_dbs):
    result = run("diff", sample_dbs[("vit", False)], sample_dbs[("vit", False)])
    assert result.returncode == 0
    assert "no regression" in result.stdout


def test_diff_the_other_way_is_an_improvement(run, sample_dbs):
    result = run("diff", sample_dbs[("vit", False)], sample_dbs[("vit", True)], "--format", "json")
    assert result.returncode == 0
    assert json.loads(result.stdout)["regression"] is False


def test_export_steps_as_json(run, sample_dbs):
    steps = json.loads(run("export", sample_dbs[("linear_attention", False)], "--format", "json").stdout)
    assert len(steps) == 40
    assert steps[0]["loss"] is None  # NaN has no JSON form
    assert steps[0]["skipped"] == 1


def test_export_grad_stats_as_csv_to_a_file(run, sample_dbs, tmp_path):
    out = tmp_path / "grads.csv"
    assert run("export", sample_dbs[("camera", True)], "--format", "csv", "--table", "grad_stats", "-o", out).returncode == 0
    rows = list(csv.DictReader(out.open()))
    assert rows and set(rows[0]) >= {"step", "layer_id", "bwd_order", "absmax", "nan", "inf"}


def test_export_of_an_empty_table_is_its_csv_header(run, sample_dbs):
    result = run("export", sample_dbs[("vit", True)], "--format", "csv", "--table", "replays")
    assert result.returncode == 0
    assert result.stdout == "step,module,outcome,fp32_absmax,reason\n"


def test_export_of_an_empty_table_is_an_empty_json_list(run, sample_dbs):
    result = run("export", sample_dbs[("vit", True)], "--format", "json", "--table", "replays")
    assert result.returncode == 0
    assert json.loads(result.stdout) == []


@pytest.mark.parametrize(
    "table, columns",
    [
        ("steps", {"loss", "losses", "scale_before", "scale_after", "skipped"}),
        ("modules", {"path", "module_type", "inputs"}),
        ("act_stats", {"fwd_order", "micro_batch", "absmax", "amin_nz", "l2"}),
        ("grad_stats", {"bwd_order", "fp16_subnormal", "amin_nz", "l2", "histogram"}),
        ("precision_checks", {"step", "module", "dtype", "numel", "rel_error", "zeroed", "fp32_absmax"}),
        ("weight_norms", {"step", "layer_id", "l2", "absmax"}),
    ],
)
def test_export_has_every_column_of_the_table(run, sample_dbs, table, columns):
    header = run("export", sample_dbs[("vit", False)], "--format", "csv", "--table", table).stdout.splitlines()[0]
    assert set(header.split(",")) >= columns


COMMANDS_WITH_JSON = {
    "report": lambda dbs: ["report", dbs[("vit", False)]],
    "layers": lambda dbs: ["layers", dbs[("vit", False)]],
    "timeline": lambda dbs: ["timeline", dbs[("vit", False)]],
    "diff": lambda dbs: ["diff", dbs[("vit", True)], dbs[("vit", False)]],
    "export": lambda dbs: ["export", dbs[("vit", False)]],
    "info": lambda dbs: ["info", dbs[("vit", False)]],
}


@pytest.mark.parametrize("command", sorted(COMMANDS_WITH_JSON))
@pytest.mark.parametrize("output_option", ["-o", "--output"])
def test_every_command_writes_json_to_the_output_file(run, sample_dbs, tmp_path, command, output_option):
    out = tmp_path / f"{command}.json"
    result = run(*COMMANDS_WITH_JSON[command](sample_dbs), "--format", "json", output_option, out)
    assert result.returncode in (0, 1), result.stderr
    assert result.stdout == ""
    json.loads(out.read_text())


def test_diff_json_lists_what_improved(run, sample_dbs):
    result = run("diff", sample_dbs[("vit", False)], sample_dbs[("vit", True)], "--format", "json")
    assert any("overflow-origin" in line for line in json.loads(result.stdout)["improvements"])


def test_info_as_json_has_meta_row_counts_and_integrity(run, sample_dbs):
    info = json.loads(run("info", sample_dbs[("vit", False)], "--format", "json").stdout)
    assert info["finished"] is True and info["integrity"] == "ok"
    assert info["meta"]["amp_dtype"] == "float16"
    assert info["rows"]["steps"] == 60


def test_info_shows_meta_counts_and_integrity(run, sample_dbs):
    out = run("info", sample_dbs[("vit", False)]).stdout
    assert "state:           finished" in out
    assert "integrity:       ok" in out
    assert "meta amp_dtype:" in out
    assert "steps:           60" in out
