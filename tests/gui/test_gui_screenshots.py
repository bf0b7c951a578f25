"""ampdiag-gui, rendered offscreen under Xvfb (Mesa) from synthetic runs: the pixels of
its screenshot, not just that a file exists."""
import os
import re
import shutil
import struct
import subprocess
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

SKIPPED_MARKER = (235, 50, 50)  # gui/src/app.cpp: kSkipped
SCALE_LINE, FLOOR = (90, 170, 255), (200, 160, 60)  # gui/src/style.h
NONFINITE = (230, 0, 230)  # gui/src/app.cpp: kNonfinite


def binary(variable):
    path = os.environ.get(variable)
    if not path or not Path(path).exists():
        pytest.fail(f"{variable} must name a built binary (ctest sets it); got {path!r}")
    return path


def read_png(path):
    """RGB pixels of an 8-bit RGB PNG (what the GUI writes), as an array [y, x, 3]."""
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width, height = 8, b"", 0, 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        body = data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour = struct.unpack(">IIBB", body[:10])
            assert (depth, colour) == (8, 2), "8-bit RGB expected"
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(height, width * 3 + 1)
    # The GUI writes unfiltered rows (filter type 0), which need no decoding.
    assert np.all(raw[:, 0] == 0), "rows with PNG filters: the GUI should write filter type 0"
    return raw[:, 1:].reshape(height, width, 3).astype(np.int32)


@pytest.fixture(scope="module")
def dbs(tmp_path_factory):
    """{"overflow": path, "healthy": path}: synthetic runs (tests/fixtures)."""
    make = binary("AMPDIAG_TEST_RUN")
    out = tmp_path_factory.mktemp("runs")
    runs = {}
    for kind in ("overflow", "healthy"):
        runs[kind] = out / f"{kind}.db"
        subprocess.run([make, kind, runs[kind]], check=True, timeout=60)
    return runs


@pytest.fixture(scope="module")
def shots(dbs, tmp_path_factory):
    if not shutil.which("xvfb-run"):
        pytest.fail("xvfb-run is needed for the GUI tests: run scripts/bootstrap")
    out = tmp_path_factory.mktemp("shots")
    shots = {}
    for kind in ("overflow", "healthy"):
        pixels, plots = screenshot(out, dbs[kind])
        shots[kind] = (pixels, plots["timeline"], plots["heatmap"])
    return shots


def screenshot(tmp_path, db, *args):
    png = tmp_path / "shot.png"
    result = subprocess.run(["xvfb-run", "-a", "-s", "-screen 0 1280x800x24", binary("AMPDIAG_GUI"), db, "--size",
                             "1000x700", "--screenshot", png, *args], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    plots = {}
    for line in result.stdout.splitlines():
        name, _, fields = line.partition(": ")  # "timeline plot: x0=...", "shown rank: rank=1"
        plots[name.split(" ")[0]] = {k: (float(v) if re.fullmatch(r"[\d.]+", v) else v) for k, v in re.findall(r"(\w+)=(\S+)", fields)}
        plots[name.split(" ")[0]]["line"] = fields
    return read_png(png), plots


def x_of(step, g):
    span = g["last_step"] - g["first_step"] + 1
    return g["x0"] + (step - g["first_step"] + 0.5) * (g["x1"] - g["x0"]) / span


def is_colour(pixel, colour):
    return bool(np.all(np.abs(pixel - np.array(colour)) <= 8))


def marker_columns(pixels, geometry):
    """x of every pixel column under the plot that holds the skipped-step marker colour."""
    strip = pixels[int(geometry["y1"]) + 1 : int(geometry["y1"]) + 16, :, :]
    hits = np.all(np.abs(strip - np.array(SKIPPED_MARKER)) <= 8, axis=2).any(axis=0)
    return np.nonzero(hits)[0]


def test_the_screenshot_is_the_requested_size(shots):
    pixels = shots["overflow"][0]
    assert pixels.shape == (700, 1000, 3)


def test_a_skipped_step_is_marked_at_its_x(shots):
    pixels, g, _ = shots["overflow"]
    columns = marker_columns(pixels, g)
    for step in (0, 4, 52):  # the test run skips every 4th step from 0 to 52
        assert np.any(np.abs(columns - x_of(step, g)) <= 2), (step, x_of(step, g), columns[:20])
    assert not np.any(np.abs(columns - x_of(2, g)) <= 2)


def test_a_healthy_run_shows_no_skipped_marker(shots):
    pixels, g, _ = shots["healthy"]
    assert len(marker_columns(pixels, g)) == 0


def test_the_culprit_is_the_heatmaps_top_row_and_non_finite_at_a_skipped_step(shots):
    pixels, _, h = shots["overflow"]
    assert h["top_row"] == "block1.0.attn.qkv.bias"
    y = int(h["y0"] + h["row_height"] / 2)
    assert is_colour(pixels[y, int(x_of(4, h))], NONFINITE)
    assert not is_colour(pixels[y, int(x_of(2, h))], NONFINITE)  # a step that was not skipped
    below = int(h["y0"] + h["row_height"] * 2.5)  # a layer that never overflows (third row)
    assert not is_colour(pixels[below, int(x_of(4, h))], NONFINITE)


def test_a_healthy_heatmap_holds_no_non_finite_cell(shots):
    pixels, _, h = shots["healthy"]
    area = pixels[int(h["y0"]) : int(h["y1"]), int(h["x0"]) : int(h["x1"])]
    assert not np.any(np.all(np.abs(area - np.array(NONFINITE)) <= 8, axis=2))


def detail_ticks(pixels, d):
    """x of the columns with a NaN/Inf tick along the top of the layer detail plot."""
    strip = pixels[int(d["y0"]) : int(d["y0"]) + 8, int(d["x0"]) : int(d["x1"])]
    return np.nonzero(np.all(np.abs(strip - np.array(NONFINITE)) <= 8, axis=2).any(axis=0))[0] + int(d["x0"])


def test_the_selected_layer_shows_its_non_finite_steps_in_the_detail_plot(tmp_path, dbs):
    db = dbs["overflow"]
    pixels, plots = screenshot(tmp_path, db, "--select", "block1.0.attn.qkv.bias", "--step", "4")
    d = plots["detail"]
    assert d["layer"] == "block1.0.attn.qkv.bias"
    ticks = detail_ticks(pixels, d)
    assert np.any(np.abs(ticks - x_of(4, d)) <= 3) and not np.any(np.abs(ticks - x_of(2, d)) <= 1)
    pixels, plots = screenshot(tmp_path, db, "--select", "head.bias")
    assert plots["detail"]["layer"] == "head.bias" and len(detail_ticks(pixels, plots["detail"])) == 0


def test_bad_input_is_one_line_and_exit_2(tmp_path, dbs):
    gui = binary("AMPDIAG_GUI")
    db = dbs["overflow"]
    for args in ([], [str(tmp_path / "missing.db")], ["x.db", "--size", "10x10"], ["x.db", "--nope"],
                 [str(db), "--select", "no.such.layer"], [str(db), "--step", "-3"]):
        result = subprocess.run([gui, *args], capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, (args, result.stderr)


def test_follow_shows_steps_written_while_the_window_is_open(tmp_path):
    db = tmp_path / "live.db"
    writer = subprocess.Popen([binary("AMPDIAG_TEST_RUN"), "slow", db])
    try:
        while not db.exists():
            time.sleep(0.05)
        time.sleep(0.5)  # a few steps in
        pixels, plots = screenshot(tmp_path, db, "--follow", "--after", "4")
        first_view = plots["timeline"]["last_step"]
        writer.wait(timeout=60)
    finally:
        writer.kill()
    # Opened after ~25 steps; after 4 s of following, well over a hundred more are shown,
    # merged in from what the file gained, never by loading it whole again.
    assert first_view >= 100, plots["timeline"]
    assert plots["live"]["merged"] >= 2 and plots["live"]["whole"] == 0, plots["live"]
    assert len(marker_columns(pixels, plots["timeline"])) > 0
    # The what-if summary follows too: its count of recorded skips is the run's now.
    assert plots["what-if"]["line"].endswith(f": {int(plots['steps']['skipped'])} skipped"), (plots["what-if"], plots["steps"])


def test_the_layers_panel_shows_updates_rounded_away_only_for_half_precision_parameters(tmp_path, dbs):
    half = tmp_path / "half.db"
    subprocess.run([binary("AMPDIAG_TEST_RUN"), "half", half], check=True, timeout=60)
    _, plots = screenshot(tmp_path, half)
    assert plots["layers"]["line"].split("|")[-1] == "updates rounded away"
    assert plots["heatmap"]["top_row"] == "head.weight"  # the stalled-updates finding names it first
    _, plots = screenshot(tmp_path, dbs["healthy"])
    assert "updates rounded away" not in plots["layers"]["line"]


def colour_in(pixels, geometry, colour):
    plot = pixels[int(geometry["y0"]) : int(geometry["y1"]), int(geometry["x0"]) : int(geometry["x1"])]
    return bool(np.all(np.abs(plot - np.array(colour)) <= 8, axis=2).any())


def test_a_run_without_a_scaler_shows_its_loss_not_a_constant_scale_under_the_floor(tmp_path, dbs):
    half = tmp_path / "half.db"
    subprocess.run([binary("AMPDIAG_TEST_RUN"), "half", half], check=True, timeout=60)
    pixels, plots = screenshot(tmp_path, half)
    timeline = plots["timeline"]
    plot = pixels[int(timeline["y0"]) : int(timeline["y1"]), int(timeline["x0"]) : int(timeline["x1"])]
    assert ((plot[:, :, 1] - plot[:, :, 0] > 60) & (plot[:, :, 1] - plot[:, :, 2] > 40)).any()  # the loss: green
    assert not colour_in(pixels, timeline, SCALE_LINE) and not colour_in(pixels, timeline, FLOOR)
    pixels, plots = screenshot(tmp_path, dbs["healthy"])  # with a scaler: the scale and its floor
    assert colour_in(pixels, plots["timeline"], SCALE_LINE) and colour_in(pixels, plots["timeline"], FLOOR)


def test_the_heatmap_measures_headroom_against_the_runs_own_dtype(tmp_path, dbs):
    bf16 = tmp_path / "bf16.db"
    subprocess.run([binary("AMPDIAG_TEST_RUN"), "bf16", bf16], check=True, timeout=60)
    _, plots = screenshot(tmp_path, bf16)
    assert plots["heatmap-title"]["line"] == "Layers x steps: headroom below the bf16 maximum (magenta: NaN/Inf)"
    _, plots = screenshot(tmp_path, dbs["healthy"])
    assert "below the fp16 maximum" in plots["heatmap-title"]["line"]


def test_rank_files_are_shown_one_rank_at_a_time(tmp_path):
    make = binary("AMPDIAG_TEST_RUN")
    r0, r1 = tmp_path / "run.rank0.db", tmp_path / "run.rank1.db"
    subprocess.run([make, "healthy", r0, "0", "2"], check=True, timeout=60)
    subprocess.run([make, "overflow", r1, "1", "2"], check=True, timeout=60)
    for rank, broken in ((1, True), (0, False)):
        pixels, plots = screenshot(tmp_path, r0, r1, "--rank", str(rank))
        assert plots["shown"]["rank"] == rank
        h = plots["heatmap"]
        top = pixels[int(h["y0"] + h["row_height"] / 2), int(x_of(4, h))]
        assert is_colour(top, NONFINITE) == broken
        assert (len(marker_columns(pixels, plots["timeline"])) > 0) == broken
    result = subprocess.run([binary("AMPDIAG_GUI"), r0, r1, "--rank", "5"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "rank 5" in result.stderr


def test_rank_files_open_at_the_rank_the_findings_are_about(tmp_path):
    make = binary("AMPDIAG_TEST_RUN")
    r0, r1 = tmp_path / "run.rank0.db", tmp_path / "run.rank1.db"
    subprocess.run([make, "healthy", r0, "0", "2"], check=True, timeout=60)
    subprocess.run([make, "overflow", r1, "1", "2"], check=True, timeout=60)
    _, plots = screenshot(tmp_path, r0, r1)
    assert plots["shown"]["rank"] == 1  # as the HTML report's layers


def test_the_loss_is_drawn_only_when_asked(tmp_path, dbs):
    loss_colour = np.array((120, 220, 140))  # gui/src/app.cpp: the loss line
    for args, drawn in (([], False), (["--loss"], True)):
        pixels, plots = screenshot(tmp_path, dbs["overflow"], *args)
        t = plots["timeline"]
        area = pixels[int(t["y0"]) : int(t["y1"]), int(t["x0"]) : int(t["x1"])]
        assert bool(np.any(np.all(np.abs(area - loss_colour) <= 30, axis=2))) == drawn


def run_window(tmp_path, *args):
    """The GUI's screenshot run with `args`: (exit status, stdout, stderr, pixels)."""
    png = tmp_path / "window.png"
    result = subprocess.run(["xvfb-run", "-a", "-s", "-screen 0 1280x800x24", binary("AMPDIAG_GUI"), *map(str, args), "--size",
                             "1000x700", "--screenshot", png], capture_output=True, text=True, timeout=120)
    return result.returncode, result.stdout, result.stderr, read_png(png) if result.returncode == 0 else None


def test_a_file_that_cannot_be_opened_is_shown_in_the_window_which_stays_on_its_run(tmp_path, dbs):
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"not a database at all")
    rc, out, err, pixels = run_window(tmp_path, dbs["overflow"], "--drop", bad)
    assert rc == 0, err
    assert f"files shown: {dbs['overflow']}" in out
    error = next(line for line in out.splitlines() if line.startswith("open error: "))
    assert str(bad) in error and "not a SQLite database" in error
    # The CLI says the same about the same file.
    assert pixels is not None


def test_a_dropped_run_replaces_the_shown_one(tmp_path, dbs):
    rc, out, err, pixels = run_window(tmp_path, dbs["overflow"], "--drop", dbs["healthy"])
    assert rc == 0, err
    assert f"files shown: {dbs['healthy']}" in out and "open error" not in out
    heat = next(line for line in out.splitlines() if line.startswith("heatmap plot: "))
    g = {k: float(v) for k, v in re.findall(r"(x0|y0|x1|y1)=([\d.]+)", heat)}
    area = pixels[int(g["y0"]) : int(g["y1"]), int(g["x0"]) : int(g["x1"])]
    assert not np.any(np.all(np.abs(area - np.array(NONFINITE)) <= 8, axis=2)), "the healthy run has no NaN/Inf cell"


def test_bench_frames_prints_load_time_and_frame_percentiles(tmp_path, dbs):
    result = subprocess.run(["xvfb-run", "-a", "-s", "-screen 0 1280x800x24", binary("AMPDIAG_GUI"), dbs["overflow"],
                             "--bench-frames", "20", "--size", "800x600"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert re.search(r"load and analysis: [\d.]+ s; first frame drawn [\d.]+ s after start", result.stdout)
    assert re.search(r"20 frames at 800x600 .*median [\d.]+, p90 [\d.]+, p99 [\d.]+, max [\d.]+", result.stdout)


def test_the_underflow_channel_colours_by_share_and_keeps_non_finite_cells(tmp_path, dbs):
    pixels, plots = screenshot(tmp_path, dbs["overflow"], "--underflow")
    h = plots["heatmap"]
    top = pixels[int(h["y0"] + h["row_height"] / 2)]
    assert is_colour(top[int(x_of(4, h))], NONFINITE)
    # A finite cell of the top row: no zeros or subnormals in this run, the palette's dark end.
    assert is_colour(top[int(x_of(2, h))], (30, 45, 70))


def test_a_selected_step_shows_where_its_values_sit_in_the_exponent_histogram(tmp_path):
    db = tmp_path / "hist.db"
    subprocess.run([binary("AMPDIAG_TEST_RUN"), "histogram", db], check=True, timeout=60)
    pixels, plots = screenshot(tmp_path, db, "--select", "block1.0.attn.qkv.bias", "--step", "2")
    h = plots["histogram"]
    assert h["step"] == 2 and h["x1"] > h["x0"] + 60, h
    bar = np.array((90, 170, 255))  # gui/src/style.h: kScaleLine

    def has_bar(b):  # bin b of 63 (rundb/rows.h): 2^e <= |g| < 2^(e+1), e = b - 41
        x = int(h["x0"] + (b + 0.5) * (h["x1"] - h["x0"]) / 63)
        column = pixels[int(h["y0"]) : int(h["y1"]), x - 1 : x + 2]
        return bool(np.any(np.all(np.abs(column - bar) <= 10, axis=2)))

    assert has_bar(50), "abs-max 1000 is in 2^9..2^10"
    assert has_bar(31), "the smallest values, 1e-3, are in 2^-10..2^-9"
    assert not has_bar(10) and not has_bar(58)


def test_a_run_without_histograms_says_so_instead_of_drawing_one(tmp_path, dbs):
    pixels, plots = screenshot(tmp_path, dbs["overflow"], "--select", "block1.0.attn.qkv.bias", "--step", "2")
    assert plots["histogram"]["x1"] == plots["histogram"]["x0"]
