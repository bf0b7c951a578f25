// The HTML report: one self-contained file (inline CSS and SVG, no network) with the
// loss-scale timeline, per-layer headroom over steps, the top offenders, the findings
// with their fixes, and every skipped step.
#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include "ampdiag/analyzer/causes.h"
#include "ampdiag/analyzer/layer_table.h"
#include "ampdiag/analyzer/render.h"
#include "markup.h"
#include "svg_plot.h"

namespace ampdiag::analyzer {

namespace {


const char* kColours[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2"};

std::string scale_plot(const std::vector<Run>& runs) {
  svg::LinePlot p;
  p.title = "Loss scale (log2) by step; red ticks: skipped steps";
  p.x_label = "step";
  p.y_label = "log2(loss scale)";
  p.markers_label = "skipped optimizer step";
  for (std::size_t r = 0; r < runs.size(); ++r) {
    svg::Series s;
    s.label = runs.size() > 1 ? "rank " + std::to_string(runs[r].rank) : "loss scale";
    s.colour = kColours[r % 6];
    for (const auto& st : runs[r].steps) {
      s.points.push_back({double(st.row.step), std::log2(std::max(st.row.scale_after, 1e-30))});
      if (st.row.skipped) p.markers_x.push_back(double(st.row.step));
    }
    p.series.push_back(std::move(s));
  }
  p.hlines.push_back({std::log2(128.0), "floor 128"});
  return svg::line_plot(p);
}

// The layers to show: the analyzer's ranking (culprits first), as `ampdiag layers` lists them.
std::vector<const LayerSummary*> offender_layers(const Report& report, const Run& run) {
  std::vector<const LayerSummary*> out;
  for (const auto& row : rank_layers(run, report)) {
    if (out.size() == 5) break;
    if (row.samples > 0) out.push_back(row.layer);
  }
  return out;
}

std::string headroom_plot(const Report& report, const Run& run) {
  svg::LinePlot p;
  p.title = "Headroom (bits below the largest fp value) by step; red crosses: non-finite gradient";
  p.x_label = "step";
  p.y_label = "headroom bits";
  int c = 0;
  for (const LayerSummary* l : offender_layers(report, run)) {
    svg::Series s;
    s.label = l->info.name;
    s.colour = kColours[c++ % 6];
    for (const auto& x : l->samples) {
      if (x.nonfinite)
        p.crosses.push_back({double(x.step), -1.0});
      else if (x.absmax > 0)
        s.points.push_back({double(x.step), headroom_bits(x.absmax, run.fp_max)});
    }
    p.series.push_back(std::move(s));
  }
  p.hlines.push_back({0.0, "overflow"});
  return svg::line_plot(p);
}

std::string offenders_chart(const Run& run) {
  std::vector<svg::Bar> bars;
  std::string unit;
  std::map<std::string, std::int64_t> modules;
  for (const auto& m : run.modules)
    if (m.first_nonfinite > 0) modules[forward_cause(run, m.info.path).module] += m.first_nonfinite;
  if (!modules.empty()) {
    for (const auto& [path, n] : modules)
      bars.push_back({path.empty() ? "(the model's own forward)" : path, double(n), "where the forward's NaN/Inf starts"});
    unit = "steps (first NaN/Inf, forward)";
  } else {
    for (const auto& l : run.layers)
      if (l.first_nonfinite > 0) bars.push_back({l.info.name, double(l.first_nonfinite), "first non-finite gradient in backward"});
    unit = "steps (first NaN/Inf, backward)";
  }
  if (bars.empty()) {
    for (const auto& l : run.layers) bars.push_back({l.info.name, double(l.nonfinite_steps), "steps with a non-finite gradient"});
    unit = "steps with NaN/Inf";
  }
  std::sort(bars.begin(), bars.end(), [](const auto& a, const auto& b) { return a.value > b.value; });
  if (bars.size() > 10) bars.resize(10);
  return svg::bar_chart("Top offenders", bars, unit);
}

}  // namespace

std::string render_html(const Report& r, const Gate& gate, const std::vector<Run>& runs) {
  std::string o = R"(<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>ampdiag report</title>
<style>
body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1100px}
h1{font-size:22px} h2{font-size:17px;margin-top:28px}
.verdict{padding:10px 14px;border-radius:6px;font-weight:600}
.bad{background:#fde2e1;color:#8a1c1c}.warn{background:#fff3cd;color:#7a5a00}.good{background:#e0f4e4;color:#1b5e20}
.finding{border:1px solid #ddd;border-radius:6px;padding:10px 14px;margin:12px 0}
.sev-error{color:#b00020;font-weight:700}.sev-warning{color:#a66b00;font-weight:700}.sev-info{color:#555}
code,pre{background:#f6f8fa;border-radius:4px} pre{padding:8px;overflow-x:auto;font-size:13px}
table{border-collapse:collapse;font-size:13px} td,th{border-bottom:1px solid #eee;padding:3px 8px;text-align:left}
.plot{display:block;margin:10px 0;background:#fff;border:1px solid #eee}
.ptitle{font-size:13px;font-weight:600}.tick{font-size:11px;fill:#555}
.axis{stroke:#888;fill:none}.ref{stroke:#999;stroke-dasharray:4 4;fill:none}
.line{fill:none;stroke-width:1.6}.marker{stroke:#d62728;stroke-width:1.5}.cross{stroke:#d62728;stroke-width:1.5;fill:none}
.bar{fill:#d62728;opacity:.8}
</style></head><body>
<h1>ampdiag report</h1>
)";
  if (r.healthy())
    o += "<p class=\"verdict good\">Healthy: no overflow, underflow or loss-scale problem found.</p>\n";
  else
    o += std::string("<p class=\"verdict ") + (gate.fails(r) ? "bad\">Unhealthy" : "warn\">Warnings") + ": " +
         std::to_string(r.findings.size()) + " finding(s); the unstable layers come first.</p>\n";
  o += "<table><tr><th>run</th><th>steps</th><th>skipped</th><th>loss scale</th><th>dtype</th><th>state</th></tr>\n";
  for (const auto& x : r.runs) {
    char scale[96];
    std::snprintf(scale, sizeof scale, "%g &rarr; %g (lowest %g)", x.first_scale, x.last_scale, x.min_scale);
    o += "<tr><td>" + escape_markup(x.path) + "</td><td>" + std::to_string(x.steps) + "</td><td>" + std::to_string(x.skipped) +
         "</td><td>" + scale + "</td><td>" + escape_markup(x.amp_dtype) + " on " + escape_markup(x.device) + "</td><td>" +
         (x.finished ? "finished" : "partial") + "</td></tr>\n";
  }
  o += "</table>\n<h2>Loss scale</h2>\n" + scale_plot(runs);
  if (!runs.empty()) o += "<h2>Per-layer headroom</h2>\n" + headroom_plot(r, runs.front()) + offenders_chart(runs.front());
  o += "<h2>Findings</h2>\n";
  if (r.findings.empty()) o += "<p>None.</p>\n";
  for (const auto& f : r.findings) {
    o += "<div class=\"finding\"><div><span class=\"sev-" + std::string(severity_name(f.severity)) + "\">" +
         severity_name(f.severity) + "</span> <code>" + escape_markup(f.rule) + "</code> " + escape_markup(f.title) + "</div>\n";
    if (!f.module.empty()) o += "<div>module: <code>" + escape_markup(f.module) + "</code></div>\n";
    if (!f.layer.empty()) o += "<div>layer: <code>" + escape_markup(f.layer) + "</code></div>\n";
    o += "<div>evidence: " + escape_markup(f.evidence) + "</div>\n";
    for (const auto& s : f.suggestions) {
      o += "<div>fix: " + escape_markup(s.summary) + "</div>\n";
      if (!s.python.empty()) o += "<pre>" + escape_markup(s.python) + "</pre>\n";
      if (!s.cpp.empty()) o += "<pre>" + escape_markup(s.cpp) + "</pre>\n";
    }
    o += "</div>\n";
  }
  if (!r.skipped.empty()) {
    o += "<h2>Skipped steps (" + std::to_string(r.skipped.size()) + ")</h2>\n<table><tr><th>rank</th><th>step</th><th>scale</th>"
         "<th>first non-finite gradient (backward order)</th><th>forward</th></tr>\n";
    for (const auto& k : r.skipped) {
      char scale[32];
      std::snprintf(scale, sizeof scale, "%g", k.scale);
      o += "<tr><td>" + std::to_string(k.rank) + "</td><td>" + std::to_string(k.step) + "</td><td>" + scale + "</td><td>" +
           escape_markup(k.nonfinite_layers.empty() ? "-" : k.nonfinite_layers.front()) +
           (k.nonfinite_layer_count > 1 ? " (+" + std::to_string(k.nonfinite_layer_count - 1) + ")" : "") + "</td><td>" +
           escape_markup(k.forward_module) + "</td></tr>\n";
    }
    o += "</table>\n";
  }
  // Lets a headless browser report how many plot paths it actually laid out.
  o += "<script>window.addEventListener('load',function(){var n=0;document.querySelectorAll('svg.plot path').forEach("
       "function(p){var b=p.getBBox();if(b.width>0||b.height>0)n++;});document.body.setAttribute('data-rendered-paths',n);});"
       "</script>\n</body></html>\n";
  return o;
}

}  // namespace ampdiag::analyzer
