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
#include "ampdiag/rundb/rows.h"
#include "markup.h"
#include "svg_plot.h"

namespace ampdiag::analyzer {

namespace {


const char* kColours[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2"};
// Ranks whose lines differ are told apart by dashes as well, since they often overlap.
const char* kDashes[] = {"", "7 4", "2 3", "10 3 2 3"};
constexpr std::size_t kPlotLayers = 5, kTableLayers = 10, kHistogramLayers = 3;

std::string sprint(const char* f, double v) {
  char b[64];
  std::snprintf(b, sizeof b, f, v);
  return b;
}

std::string rank_list(const std::vector<const Run*>& group) {
  std::string o = group.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < group.size(); ++i) o += (i ? ", " : "") + std::to_string(group[i]->rank);
  return o;
}

// Ranks of one run normally share their loss scale (the scaler's found_inf is
// all-reduced): they are one line, not several drawn on top of each other.
std::vector<std::vector<const Run*>> same_scale_groups(const std::vector<Run>& runs) {
  auto same = [](const Run& a, const Run& b) {
    if (a.steps.size() != b.steps.size()) return false;
    for (std::size_t i = 0; i < a.steps.size(); ++i)
      if (a.steps[i].row.step != b.steps[i].row.step || a.steps[i].row.scale_after != b.steps[i].row.scale_after ||
          a.steps[i].row.skipped != b.steps[i].row.skipped)
        return false;
    return true;
  };
  std::vector<std::vector<const Run*>> groups;
  for (const auto& run : runs) {
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return same(*g.front(), run); });
    if (it == groups.end()) groups.push_back({&run});
    else it->push_back(&run);
  }
  return groups;
}

std::string scale_plot(const std::vector<Run>& runs) {
  svg::LinePlot p;
  p.title = "Loss scale by step (after update())";
  p.x_label = "step";
  p.y_label = "loss scale";
  p.y_axis = svg::YAxis::kPowerOfTwo;
  p.markers_label = "skipped optimizer step";
  const auto groups = same_scale_groups(runs);
  std::set<std::int64_t> skipped;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    svg::Series s;
    s.label = runs.size() == 1 ? "loss scale"
              : groups.size() == 1 ? "loss scale, all " + std::to_string(runs.size()) + " ranks"
                                   : "loss scale, " + rank_list(groups[g]);
    s.colour = kColours[g % 6];
    s.dash = kDashes[g % 4];
    for (const Run* run : groups[g])
      for (const auto& st : run->steps)
        if (st.row.skipped) skipped.insert(st.row.step);
    for (const auto& st : groups[g].front()->steps)
      s.points.push_back({double(st.row.step), std::log2(std::max(st.row.scale_after, 1e-30))});
    p.series.push_back(std::move(s));
  }
  for (std::int64_t step : skipped) p.markers_x.push_back(double(step));
  p.hlines.push_back({std::log2(128.0), "floor 128"});
  return svg::line_plot(p);
}

// The loss as the agent recorded it; empty when it recorded none.
std::string loss_plot(const std::vector<Run>& runs) {
  svg::LinePlot p;
  p.title = "Loss by step (the sum of the step's losses)";
  p.x_label = "step";
  p.y_label = "loss";
  bool any = false;
  for (std::size_t r = 0; r < runs.size(); ++r) {
    svg::Series s;
    s.label = runs.size() > 1 ? "loss, rank " + std::to_string(runs[r].rank) : "loss";
    s.colour = kColours[r % 6];
    s.dash = kDashes[r % 4];
    for (const auto& st : runs[r].steps) {
      if (!runs[r].loss_known(st.row)) continue;
      any = true;
      if (std::isfinite(st.row.loss)) s.points.push_back({double(st.row.step), st.row.loss});
      else s.nonfinite_x.push_back(double(st.row.step));
    }
    p.series.push_back(std::move(s));
  }
  p.empty_note = "every recorded loss was NaN/Inf";
  // A loss spanning orders of magnitude (a divergence) is flat at zero on a linear axis
  // until it explodes: then the axis is logarithmic.
  double lo = INFINITY, hi = 0.0;
  for (const auto& s : p.series)
    for (const auto& [x, y] : s.points) {
      lo = std::min(lo, y);
      hi = std::max(hi, y);
    }
  if (lo > 0.0 && hi >= 1000.0 * lo) {
    p.y_axis = svg::YAxis::kPowerOfTwo;
    p.title = "Loss by step (the sum of the step's losses; log scale: it spans a factor of " + sprint("%.2g", hi / lo) + ")";
    for (auto& s : p.series)
      for (auto& point : s.points) point.second = std::log2(point.second);
  }
  return any ? svg::line_plot(p) : "";
}

// The layers to plot: the analyzer's ranking (culprits first), as `ampdiag layers` lists them.
std::vector<LayerRowSummary> top_layers(const Report& report, const Run& run, std::size_t count) {
  std::vector<LayerRowSummary> out;
  for (const auto& row : rank_layers(run, report)) {
    if (out.size() == count) break;
    if (row.samples > 0) out.push_back(row);
  }
  return out;
}

// One series per plotted top layer, named and coloured as every plot names them; `add`
// turns each of the layer's samples into points.
template <typename Add>
std::vector<svg::Series> top_layer_series(const Report& report, const Run& run, Add add) {
  std::vector<svg::Series> out;
  for (const auto& row : top_layers(report, run, kPlotLayers)) {
    svg::Series s;
    s.label = row.layer->info.name;
    s.colour = kColours[out.size() % 6];
    for (const auto& x : row.layer->samples) add(s, x);
    out.push_back(std::move(s));
  }
  return out;
}

std::string rank_note(const std::vector<Run>& runs, const Run& run) {
  return runs.size() > 1 ? " (rank " + std::to_string(run.rank) + ")" : "";
}

std::string headroom_plot(const Report& report, const std::vector<Run>& runs, const Run& run) {
  svg::LinePlot p;
  p.title = "Headroom of the top layers: bits below " + sprint("%g", run.fp_max) + ", before unscale" + rank_note(runs, run);
  p.x_label = "step";
  p.y_label = "headroom (bits)";
  p.y_include = {0.0, 4.0};  // a readable axis even when no sample was finite
  p.empty_note = "no finite gradient in these layers: every sample was NaN/Inf (crosses below)";
  p.series = top_layer_series(report, run, [&](svg::Series& s, const GradSample& x) {
    if (x.nonfinite) s.nonfinite_x.push_back(double(x.step));
    else if (x.absmax > 0) s.points.push_back({double(x.step), headroom_bits(x.absmax, run.fp_max)});
  });
  p.hlines.push_back({0.0, "overflow"});
  return svg::line_plot(p);
}

// The gradients' L2 norms with the loss scale taken out: a culprit's norm often climbs
// for many steps before its first overflow. Empty when no sample has a norm.
std::string l2_plot(const Report& report, const std::vector<Run>& runs, const Run& run) {
  std::map<std::int64_t, double> scale;
  for (const auto& s : run.steps) scale[s.row.step] = s.row.scale_before;
  svg::LinePlot p;
  p.title = "Gradient L2 norm of the top layers, after unscale" + rank_note(runs, run);
  p.x_label = "step";
  p.y_label = "L2 norm";
  p.y_axis = svg::YAxis::kPowerOfTwo;
  bool any = false;
  p.series = top_layer_series(report, run, [&](svg::Series& s, const GradSample& x) {
    const auto it = scale.find(x.step);
    if (x.nonfinite || !(x.l2 > 0) || it == scale.end() || !(it->second > 0)) return;
    s.points.push_back({double(x.step), std::log2(double(x.l2) / it->second)});
    any = true;
  });
  return any ? svg::line_plot(p) : "";
}

std::string offenders_chart(const Run& run) {
  std::vector<svg::Bar> bars;
  std::string unit;
  // Where each step's forward went NaN/Inf as the skipped-steps list says it (step_cause):
  // a corrupted batch is the input's, and a -inf mask absorbed by the model is nobody's.
  std::map<std::string, std::int64_t> modules;
  for (const auto& s : run.steps) {
    const StepCause cause = step_cause(run, s);
    if (cause.forward == ForwardSource::kModule)
      ++modules[cause.forward_module.empty() ? "(the model's own forward)" : cause.forward_module];
    else if (cause.forward == ForwardSource::kInput)
      ++modules["(the model's input)"];
    else if (cause.forward == ForwardSource::kLossBackward)
      ++modules["(the loss's backward)"];
    else if (cause.forward == ForwardSource::kLoss)
      ++modules["(the loss code)"];  // backward starts at the last layer: its gradient is first, not the cause
    else if (cause.forward == ForwardSource::kUpdate)
      ++modules["(the parameters)"];
  }
  if (!modules.empty()) {
    for (const auto& [path, n] : modules) bars.push_back({path, double(n), "where the forward's NaN/Inf starts"});
    unit = "steps (first NaN/Inf, forward)";
  } else {
    for (const auto& l : run.layers)
      if (l.first_nonfinite > 0) bars.push_back({l.info.name, double(l.first_nonfinite), "first non-finite gradient in backward"});
    unit = "steps (first NaN/Inf, backward)";
  }
  if (bars.empty()) {
    for (const auto& l : run.layers)
      if (l.nonfinite_steps > 0) bars.push_back({l.info.name, double(l.nonfinite_steps), "steps with a non-finite gradient"});
    unit = "steps with NaN/Inf";
  }
  if (bars.empty()) return "";
  std::sort(bars.begin(), bars.end(), [](const auto& a, const auto& b) { return a.value > b.value; });
  if (bars.size() > 10) bars.resize(10);
  return svg::bar_chart("Top offenders", bars, unit);
}

std::string bits(double v) {
  if (std::isinf(v)) return v < 0 ? "NaN/Inf" : "-";
  return sprint("%.1f", v);
}

// The ranking as a table, with the statistics the plots leave out: the smallest non-zero
// magnitude (how close the smallest gradients come to flushing) and the largest norm.
std::string layer_table(const Report& report, const Run& run) {
  std::map<std::int64_t, double> scale;
  for (const auto& s : run.steps) scale[s.row.step] = s.row.scale_before;
  const bool fp16 = run.fp16();
  // Only runs that measured their half-precision parameters' updates have the last column.
  const bool updates = run.measured_updates();
  std::string o =
      "<table><tr><th>layer</th><th>NaN/Inf steps</th><th>first in backward</th><th>least headroom</th>"
      "<th>median headroom</th><th>zeros</th>" +
      std::string(fp16 ? "<th>fp16 subnormal</th>" : "") +
      "<th title=\"before unscale\">smallest non-zero |g|</th><th title=\"after unscale\">largest L2</th>" +
      std::string(updates ? "<th title=\"of its measured updates\">updates rounded away</th>" : "") + "</tr>\n";
  for (const auto& row : top_layers(report, run, kTableLayers)) {
    const LayerSummary& l = *row.layer;
    double l2 = 0;
    for (const auto& x : l.samples) {
      const auto it = scale.find(x.step);
      if (!x.nonfinite && it != scale.end() && it->second > 0) l2 = std::max(l2, double(x.l2) / it->second);
    }
    std::string least = "-";
    if (l.least_nonzero > 0) {
      least = sprint("%.3g", l.least_nonzero) + " (2<sup>" + sprint("%.1f", std::log2(l.least_nonzero)) + "</sup>";
      // fp16's smallest subnormal is 2^-24: below it a value becomes zero.
      if (fp16) {
        const double above = std::log2(l.least_nonzero) + 24.0;
        least += above < 0.05 ? std::string(", fp16's smallest subnormal") : ", " + sprint("%.1f", above) + " bits from flushing to 0";
      }
      least += ", step " + std::to_string(l.least_nonzero_step) + ")";
    }
    o += "<tr><td><code>" + escape_markup(l.info.name) + "</code></td><td>" + std::to_string(l.nonfinite_steps) + "</td><td>" +
         std::to_string(l.first_nonfinite) + "</td><td>" + bits(row.least_headroom) + "</td><td>" + bits(row.median_headroom) +
         "</td><td>" + sprint("%.1f%%", row.zeros * 100) + "</td>" + (fp16 ? "<td>" + sprint("%.1f%%", row.subnormal * 100) + "</td>" : "") +
         "<td>" + least + "</td><td>" + (l2 > 0 ? sprint("%.3g", l2) : "-") + "</td>" +
         (updates ? "<td>" + (std::isnan(row.stalled_updates) ? std::string("-") : sprint("%.1f%%", row.stalled_updates * 100)) + "</td>"
                  : std::string()) +
         "</tr>\n";
  }
  return o + "</table>\n";
}

// Where the top layers' gradient magnitudes sit against fp16's range, from the exponent
// histograms the agent recorded (summed over the run's finite samples).
std::string histograms(const Report& report, const Run& run) {
  svg::HistogramPlot p;
  p.title = "Gradient magnitudes of the top layers (exponent histogram, all finite samples)";
  p.min_exp = rundb::kHistMinExp;
  p.max_exp = rundb::kHistMaxExp;
  int c = 0;
  for (const auto& row : rank_layers(run, report)) {
    if (p.curves.size() == kHistogramLayers) break;
    const auto& h = row.layer->histogram;
    std::uint64_t total = 0;
    for (auto v : h) total += v;
    if (total == 0) continue;
    svg::HistogramPlot::Curve curve{row.layer->info.name, kColours[c++ % 6], {}};
    for (auto v : h) curve.share.push_back(double(v) / double(total));
    p.curves.push_back(std::move(curve));
  }
  if (p.curves.empty()) {
    const bool recorded = run.meta_or("histogram", "0") == "1";
    return std::string("<p class=\"note\">") +
           (recorded ? "No finite non-zero gradient values to histogram."
                     : "Exponent histograms were not recorded: <code>attach(..., histogram=True)</code> in Python, "
                       "<code>AgentOptions::histogram</code> in C++.") +
           "</p>\n";
  }
  if (run.fp16()) {
    // fp16: subnormals from 2^-24 to 2^-14, nothing finite from 65520 (rounds to Inf).
    p.bands.push_back({-1e9, -24, "becomes 0", "#d62728"});
    p.bands.push_back({-24, -14, "fp16 subnormal", "#ff7f0e"});
    p.bands.push_back({16, 1e9, "overflows", "#d62728"});
  }
  return svg::histogram_plot(p);
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
.bar{fill:#d62728;opacity:.8}.grid{stroke:#f0f0f0;fill:none}.lane{stroke-width:1;opacity:.3;fill:none}
.band{opacity:.12}.note{color:#666;fill:#888;font-size:13px}
</style></head><body>
<h1>ampdiag report</h1>
)";
  if (r.healthy())
    o += "<p class=\"verdict good\">Healthy: no overflow, underflow or loss-scale problem found.</p>\n";
  else
    o += std::string("<p class=\"verdict ") + (gate.fails(r) ? "bad\">Unhealthy" : "warn\">Warnings") + ": " +
         escape_markup(findings_summary(r, gate)) +
         // Only where one leads: a loop mistake (a clip before unscale) names no layer.
         (!r.findings.front().module.empty() || !r.findings.front().layer.empty() ? "; the unstable layers come first"
                                                                                   : "") +
         ".</p>\n";
  o += "<table><tr><th>run</th><th>steps</th><th>skipped</th><th>loss scale</th><th>dtype</th><th>state</th></tr>\n";
  for (const auto& x : r.runs) {
    char scale[96];
    if (x.has_scaler)
      std::snprintf(scale, sizeof scale, "%g &rarr; %g (lowest %g)", x.first_scale, x.last_scale, x.min_scale);
    else
      std::snprintf(scale, sizeof scale, "no loss scaler");
    const std::string dropped = dropped_batches_text(x);  // "3 batches dropped by the loop (...), "
    o += "<tr><td>" + escape_markup(x.path) + "</td><td>" + std::to_string(x.steps) + "</td><td>" + std::to_string(x.skipped) +
         (dropped.empty() ? "" : "; " + escape_markup(dropped.substr(0, dropped.size() - 2))) + "</td><td>" + scale + "</td><td>" + escape_markup(x.amp_dtype) + " on " + escape_markup(x.device) + "</td><td>" +
         (x.finished ? "finished" : "partial") +
         (x.write_error.empty() ? std::string()
                                : "; writing it failed, " + std::to_string(x.lost_records) + " records lost: " + escape_markup(x.write_error)) +
         escape_markup(incomplete_text(x)) + "</td></tr>\n";
  }
  o += "</table>\n";
  for (const auto& x : r.runs) {
    auto lines = device_profile_lines(x);
    for (auto& line : fp8_lines(x.fp8)) lines.push_back(std::move(line));
    if (lines.empty()) continue;
    o += "<pre class=\"note\">";
    for (const auto& line : lines) o += escape_markup(line) + "\n";
    o += "</pre>\n";
  }
  const bool scaled = std::any_of(runs.begin(), runs.end(), [](const Run& run) { return run.has_scaler(); });
  if (scaled) o += "<h2>Loss scale</h2>\n" + scale_plot(runs);
  const std::string losses = loss_plot(runs);
  if (!losses.empty()) o += "<h2>Loss</h2>\n" + losses;
  if (!runs.empty()) {
    const Run& run = runs[focus_run(r, runs)];
    o += "<h2>Layers" + escape_markup(rank_note(runs, run)) + "</h2>\n<p class=\"note\">The analyzer's ranking (as <code>ampdiag layers</code>): the layers the findings "
         "name first, then NaN/Inf, then least headroom.</p>\n" +
         headroom_plot(r, runs, run) + l2_plot(r, runs, run) + offenders_chart(run) + layer_table(r, run) + histograms(r, run);
  }
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
      if (!s.cost.empty()) o += "<div>cost: " + escape_markup(s.cost) + "</div>\n";
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
           escape_markup(k.nonfinite_layers.empty() ? finite_gradients_label(k) : !k.nonfinite_ordered ? "order unknown: " + k.nonfinite_layers.front()
                                                                                 : k.nonfinite_layers.front()) +
           (k.nonfinite_layer_count > 1 ? " (+" + std::to_string(k.nonfinite_layer_count - 1) + ")" : "") + "</td><td>" +
           escape_markup(forward_label(k.forward, k.forward_module)) + "</td></tr>\n";
    }
    o += "</table>\n";
  }
  // Lets a headless browser report what it laid out: plot paths with a size, NaN/Inf
  // crosses among them, and texts that stick out of their plot (cut off on screen).
  o += "<script>window.addEventListener('load',function(){var n=0,c=0,cut=0;"
       "document.querySelectorAll('svg.plot').forEach(function(svg){var r=svg.getBoundingClientRect();"
       "svg.querySelectorAll('path').forEach(function(p){var b=p.getBBox();if(b.width>0||b.height>0){n++;"
       "if(p.classList.contains('cross'))c++;}});"
       "svg.querySelectorAll('text').forEach(function(t){var b=t.getBoundingClientRect();"
       "if(b.left<r.left-0.5||b.right>r.right+0.5||b.top<r.top-0.5||b.bottom>r.bottom+0.5)cut++;});});"
       "document.body.setAttribute('data-rendered-paths',n);document.body.setAttribute('data-rendered-crosses',c);"
       "document.body.setAttribute('data-cut-texts',cut);});"
       "</script>\n</body></html>\n";
  return o;
}

}  // namespace ampdiag::analyzer
