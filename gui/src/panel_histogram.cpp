// The layer detail's exponent histogram of the selected step: where the gradient's values
// sit in fp16's range (flushed to zero, subnormal, normal, overflowing), read on demand.
#include <imgui.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

#include "ampdiag/analyzer/escape.h"
#include "ampdiag/rundb/reader.h"
#include "app.h"
#include "style.h"

namespace ampdiag::gui {

namespace {

// Bin b holds 2^e <= |x| < 2^(e+1) for e = b - 1 + kHistMinExp (rows.h); bin 0 is below
// 2^kHistMinExp and the last bin above 2^(kHistMaxExp + 1).
int exponent_of_bin(int b) { return b - 1 + rundb::kHistMinExp; }

// The fp16 zone a bin's values fall in, as a faint background.
ImU32 zone_colour(int b) {
  const int e = exponent_of_bin(b);
  if (b == 0 || e < -24) return IM_COL32(70, 70, 70, 90);     // below fp16's smallest subnormal: flushed to 0
  if (e < -14) return IM_COL32(60, 150, 190, 70);             // fp16 subnormal
  if (b == rundb::kHistBins - 1 || e >= 16) return IM_COL32(200, 60, 60, 90);  // above 65504: Inf
  return IM_COL32(0, 0, 0, 0);
}

}  // namespace

const App::StepHistogram& App::step_histogram(std::int64_t layer, long long step) {
  const std::string& path = run().path;
  if (step_histogram_.path == path && step_histogram_.step == step && step_histogram_.layer == layer) return step_histogram_;
  StepHistogram h;
  h.path = path, h.step = step, h.layer = layer;
  if (run().meta_or("histogram", "0") != "1") {
    h.note = "no exponent histograms in this run: attach(..., histogram=True) in Python, AgentOptions::histogram in C++";
  } else {
    try {
      rundb::RunDbReader reader(path);
      rundb::RunDbReader::GradScan scan;
      scan.first = scan.last = step;
      reader.for_each_grad_stat(
          [&](const rundb::GradStatRow& g) {
            if (g.layer_id == layer) h.counts = g.histogram;
          },
          scan);
      if (h.counts.empty()) h.note = "no histogram of this layer at step " + std::to_string(step) + " (not sampled)";
    } catch (const std::exception& e) {
      h.note = e.what();
    }
  }
  step_histogram_ = std::move(h);
  return step_histogram_;
}

void App::histogram_plot(ImDrawList* draw, const ImVec2& p0, const ImVec2& p1, std::int64_t layer, long long step) {
  const StepHistogram& h = step_histogram(layer, step);
  histogram_geometry_ = {p0.x, p0.y, h.counts.empty() ? p0.x : p1.x, p1.y, step, step, 0};
  char title[64];
  std::snprintf(title, sizeof title, "step %lld: |g| exponents", step);
  draw->AddText(ImVec2(p0.x, p0.y - 16), IM_COL32(200, 200, 200, 255), title);
  if (h.counts.empty()) {
    ImGui::SetCursorScreenPos(p0);
    ImGui::PushTextWrapPos(p1.x);
    ImGui::TextDisabled("%s", analyzer::printable(h.note).c_str());
    ImGui::PopTextWrapPos();
    return;
  }
  const int bins = int(h.counts.size());
  const float bw = (p1.x - p0.x) / float(bins);
  std::uint32_t most = 1;
  for (const auto c : h.counts) most = std::max(most, c);
  for (int b = 0; b < bins; ++b) {
    const float x = p0.x + float(b) * bw;
    if (const ImU32 zone = zone_colour(b); zone) draw->AddRectFilled(ImVec2(x, p0.y), ImVec2(x + bw, p1.y), zone);
    const std::uint32_t count = h.counts[std::size_t(b)];
    if (!count) continue;
    // log scale: one value among millions still shows
    const float share = float(std::log1p(double(count)) / std::log1p(double(most)));
    draw->AddRectFilled(ImVec2(x + 0.5f, p1.y - share * (p1.y - p0.y)), ImVec2(std::max(x + 1.5f, x + bw - 0.5f), p1.y), kScaleLine);
  }
  float labelled_to = -1e9f;  // labels that would overlap the one before are left out
  for (const int e : {-24, -14, 16}) {
    const float x = p0.x + float(e + 1 - rundb::kHistMinExp) * bw;
    char label[16];
    std::snprintf(label, sizeof label, "2^%d", e);
    draw->AddLine(ImVec2(x, p0.y), ImVec2(x, p1.y + 3), kGrid);
    const float w = ImGui::CalcTextSize(label).x;
    if (x - w / 2 < labelled_to + 4) continue;
    draw->AddText(ImVec2(x - w / 2, p1.y + 2), IM_COL32(170, 170, 170, 255), label);
    labelled_to = x + w / 2;
  }
  const ImVec2 m = ImGui::GetIO().MousePos;
  if (m.x >= p0.x && m.x < p1.x && m.y >= p0.y && m.y < p1.y) {
    const int b = std::clamp(int((m.x - p0.x) / bw), 0, bins - 1);
    ImGui::BeginTooltip();
    const int e = exponent_of_bin(b);
    if (b == 0) ImGui::Text("below 2^%d: %u values", rundb::kHistMinExp, h.counts[0]);
    else if (b == bins - 1) ImGui::Text("2^%d and above: %u values", rundb::kHistMaxExp + 1, h.counts[std::size_t(b)]);
    else ImGui::Text("2^%d <= |g| < 2^%d: %u values", e, e + 1, h.counts[std::size_t(b)]);
    ImGui::EndTooltip();
  }
}

}  // namespace ampdiag::gui
