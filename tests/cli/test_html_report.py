"""The HTML report is one self-contained file whose plots a real browser lays out."""
import re
import subprocess


def test_html_report_renders_its_plots_in_chromium(run, sample_dbs, tmp_path, chromium):
    page = tmp_path / "report.html"
    assert run("report", sample_dbs[("vit", False)], "--format", "html", "-o", page).returncode == 1
    html = page.read_text()
    assert "http://" not in html.replace("http://www.w3.org/2000/svg", "")  # nothing fetched from a network
    assert html.count("<svg") == 3
    dom = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=3000", "--dump-dom",
         page.as_uri()], capture_output=True, text=True, timeout=120).stdout
    rendered = re.search(r'data-rendered-paths="(\d+)"', dom)
    assert rendered, "the page's script did not run"
    # axes, the scale line, skipped-step ticks, reference lines, headroom lines, crosses, bars
    assert int(rendered.group(1)) >= 10


def test_html_report_screenshot(run, sample_dbs, tmp_path, chromium):
    page = tmp_path / "report.html"
    run("report", sample_dbs[("vit", False)], "--format", "html", "-o", page)
    shot = tmp_path / "report.png"
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--window-size=1150,1400", f"--screenshot={shot}", page.as_uri()],
                   capture_output=True, timeout=120)
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20000
