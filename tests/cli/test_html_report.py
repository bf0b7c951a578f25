"""The HTML report is one self-contained file whose plots a real browser lays out: every
plot readable in the runs that matter most (all gradients NaN/Inf, several ranks), round
axis ticks, full names, and the statistics the text report leaves out."""
import math
import re
import shutil
import sqlite3
import subprocess

import pytest


def html_report(run, dbs, page):
    result = run("report", *dbs, "--format", "html", "-o", page)
    assert result.returncode in (0, 1), result.stderr
    return page.read_text()


def browser_dom(chromium, page):
    """The page after Chromium ran its script: the body's data-* attributes say what it laid out."""
    dom = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=3000", "--window-size=1150,1400",
         "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120).stdout
    attributes = dict(re.findall(r'data-([a-z-]+)="(\d+)"', dom))
    assert "rendered-paths" in attributes, "the page's script did not run"
    return {k: int(v) for k, v in attributes.items()}


def plots(html):
    """{title: svg text} of every plot."""
    out = {}
    for svg in re.findall(r"<svg .*?</svg>", html, re.S):
        title = re.search(r'class="ptitle">([^<]*)<', svg)
        out[title.group(1) if title else ""] = svg
    return out


def plot(html, title_start):
    found = [svg for title, svg in plots(html).items() if title.startswith(title_start)]
    assert len(found) == 1, f"no single plot titled {title_start!r} in {list(plots(html))}"
    return found[0]


def legend_labels(svg):
    return re.findall(r'class="tick">([^<]*)<title>', svg)


def y_ticks(svg):
    """The y-axis labels, as numbers (2^k labels as k)."""
    labels = re.findall(r'class="tick" text-anchor="end">(.*?)</text>', svg)
    values = []
    for label in labels:
        power = re.fullmatch(r'2<tspan dy="-5" font-size="8">(-?[\d.]+)</tspan>', label)
        if power:
            values.append(float(power.group(1)))
        elif re.fullmatch(r"-?[\d.]+", label):
            values.append(float(label))
    return values


def is_round_step(step):
    mantissa = step / 10 ** math.floor(math.log10(step))
    return any(abs(mantissa - m) < 1e-6 for m in (1, 2, 5, 10))


def test_html_report_is_self_contained_and_renders_its_plots(run, sample_dbs, tmp_path, chromium):
    page = tmp_path / "report.html"
    html = html_report(run, [sample_dbs[("vit", False)]], page)
    assert "http://" not in html.replace("http://www.w3.org/2000/svg", "")  # nothing fetched from a network
    # loss scale, loss, headroom, L2, offenders
    assert len(plots(html)) == 5
    # axes, the scale line, skipped-step ticks, reference lines, headroom lines, crosses, bars
    assert browser_dom(chromium, page)["rendered-paths"] >= 20


def test_every_nonfinite_layer_gets_its_own_row_of_crosses_when_no_gradient_is_finite(run, sample_dbs, tmp_path, chromium):
    page = tmp_path / "report.html"
    html = html_report(run, [sample_dbs[("linear_attention", False)]], page)
    headroom = plot(html, "Headroom of the top layers")
    layers = legend_labels(headroom)
    assert len(layers) == 5 and all(name.startswith("encoder.0.linear_attn.") for name in layers)
    crosses = re.findall(r'<path class="cross" stroke="([^"]+)" d="([^"]*)">', headroom)
    assert len(crosses) == len(layers)  # one row per layer...
    assert len({colour for colour, _ in crosses}) == len(layers)  # ...in that layer's colour
    assert all(d.count("l6 6") == 40 for _, d in crosses)  # every one of the 40 steps
    assert "every sample was NaN/Inf" in headroom
    dom = browser_dom(chromium, page)
    assert dom["rendered-crosses"] == html.count('class="cross"')


def test_axis_ticks_fall_on_round_values(run, sample_dbs, tmp_path):
    for db in (sample_dbs[("vit", False)], sample_dbs[("camera", False)], sample_dbs[("linear_attention", True)]):
        html = html_report(run, [db], tmp_path / "report.html")
        for title, svg in plots(html).items():
            ticks = y_ticks(svg)
            if title.startswith("Top offenders"):
                continue
            assert len(ticks) >= 2, title
            steps = {round(b - a, 9) for a, b in zip(ticks, ticks[1:])}
            assert len(steps) == 1 and is_round_step(steps.pop()), (title, ticks)
            assert all(abs(t / (ticks[1] - ticks[0]) - round(t / (ticks[1] - ticks[0]))) < 1e-6 for t in ticks), (title, ticks)


def test_legends_carry_the_full_layer_names_and_nothing_is_cut_off(run, sample_dbs, tmp_path, chromium):
    page = tmp_path / "report.html"
    html = html_report(run, [sample_dbs[("vit", False)]], page)
    assert "block1.0.attn.qkv.bias" in legend_labels(plot(html, "Headroom of the top layers"))
    assert browser_dom(chromium, page)["cut-texts"] == 0


def as_rank(src, dst, rank, world=2, scale_factor=1.0):
    """A copy of a run.db that claims to be `rank` of a `world`-rank run (same run id)."""
    shutil.copy(src, dst)
    with sqlite3.connect(dst) as c:
        c.execute("UPDATE meta SET value = ? WHERE key = 'rank'", (str(rank),))
        c.execute("UPDATE meta SET value = ? WHERE key = 'world_size'", (str(world),))
        c.execute("UPDATE meta SET value = ? WHERE key = 'pid'", (str(1000 + rank),))
        c.execute("UPDATE steps SET scale_after = scale_after * ?", (scale_factor,))
    return dst


def test_ranks_that_share_their_loss_scale_are_one_line(run, sample_dbs, tmp_path):
    src = sample_dbs[("vit", True)]
    dbs = [as_rank(src, tmp_path / f"run.rank{r}.db", r) for r in (0, 1)]
    scale = plot(html_report(run, dbs, tmp_path / "report.html"), "Loss scale")
    assert legend_labels(scale)[0] == "loss scale, all 2 ranks"
    assert scale.count('class="line"') == 1


def test_ranks_with_different_loss_scales_are_told_apart_by_dashes(run, sample_dbs, tmp_path):
    src = sample_dbs[("vit", True)]
    dbs = [as_rank(src, tmp_path / f"run.rank{r}.db", r, scale_factor=1.0 + r) for r in (0, 1)]
    scale = plot(html_report(run, dbs, tmp_path / "report.html"), "Loss scale")
    assert legend_labels(scale)[:2] == ["loss scale, rank 0", "loss scale, rank 1"]
    lines = re.findall(r'<path class="line" stroke="[^"]+"( stroke-dasharray="[^"]+")? d=', scale)
    assert len(lines) == 2 and len(set(lines)) == 2


def test_layer_table_shows_the_smallest_nonzero_gradient_and_the_largest_norm(run, sample_dbs, tmp_path):
    html = html_report(run, [sample_dbs[("vit", True)]], tmp_path / "report.html")
    assert "<th title=\"before unscale\">smallest non-zero |g|</th>" in html
    assert re.search(r"<td>[\d.e+-]+ \(2<sup>-[\d.]+</sup>, [\d.]+ bits from flushing to 0, step \d+\)</td><td>[\d.e+-]+</td>", html)
    assert "Gradient L2 norm of the top layers" in html


def test_a_run_of_half_precision_parameters_shows_its_updates_rounded_away_and_no_scale(run, test_runs, tmp_path):
    html = html_report(run, [test_runs["half"]], tmp_path / "report.html")
    assert "<td>no loss scaler</td>" in html
    assert "updates rounded away</th></tr>" in html
    assert re.search(r"<code>head\.weight</code>.*?<td>80\.0%</td></tr>", html)
    assert "updates rounded away" not in html_report(run, [test_runs["healthy"]], tmp_path / "healthy.html")


def test_exponent_histograms_are_plotted_against_fp16s_range_when_recorded(run, samples_dir, tmp_path):
    db = tmp_path / "vit-histogram.db"
    subprocess.run([str(samples_dir / "ampdiag_vit_overflow"), "--db", str(db), "--histogram", "--steps", "20"],
                   check=True, capture_output=True, timeout=300)
    svg = plot(html_report(run, [db], tmp_path / "report.html"), "Gradient magnitudes")
    assert {"becomes 0", "fp16 subnormal", "overflows"} <= set(re.findall(r'text-anchor="middle">([^<]+)</text>', svg))
    assert legend_labels(svg)[0].startswith("block1.0.attn.")


def test_a_run_without_histograms_says_how_to_record_them(run, sample_dbs, tmp_path):
    html = html_report(run, [sample_dbs[("vit", False)]], tmp_path / "report.html")
    assert "Exponent histograms were not recorded" in html and "histogram=True" in html


def test_html_report_screenshot(run, sample_dbs, tmp_path, chromium):
    page = tmp_path / "report.html"
    html_report(run, [sample_dbs[("vit", False)]], page)
    shot = tmp_path / "report.png"
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--window-size=1150,1400", f"--screenshot={shot}", page.as_uri()],
                   capture_output=True, timeout=120)
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20000
