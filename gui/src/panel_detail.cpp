// The layer detail panel: the selected layer's |g| against the dtype's maximum.
#include <imgui.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

#include "ampdiag/analyzer/escape.h"
#include "app.h"
#include "style.h"
#include "heatmap.h"
#include "timeline.h"

namespace ampdiag::gui {

void App::detail(float x, float y, float w, float h) {
  const analyzer::Run& run = this->run();
  place("Layer detail", x, y, w, h);
  if (ranked_.empty()) {
    ImGui::TextUnformatted("no layers recorded");
    ImGui::End();
    return;
  }
  const auto& row = ranked_[std::size_t(selected_)];
  const auto& layer = *row.layer;
  ImGui::TextWrapped("%s", analyzer::printable(layer.info.name).c_str());
  ImGui::TextDisabled("%s  %s %s  %lld values", analyzer::printable(layer.info.module_path).c_str(),
                      analyzer::printable(layer.info.dtype).c_str(), analyzer::printable(layer.info.shape).c_str(),
                      (long long)layer.info.numel);
  ImGui::Text("non-finite in %lld steps; zeros %.1f %%, fp16 subnormals %.1f %% (mean)", (long long)layer.nonfinite_steps,
              row.zeros * 100, row.subnormal * 100);
  // |g| before unscale against the dtype's largest value, log2 axis, over the shared view.
  const ImVec2 origin = ImGui::GetCursorScreenPos(), avail = ImGui::GetContentRegionAvail();
  ImVec2 p0(origin.x + 44, origin.y + 6), p1(origin.x + avail.x - 4, origin.y + avail.y - 16);
  ImDrawList* draw = ImGui::GetWindowDrawList();
  // A selected step also shows where its values sit in fp16's range, on the right.
  histogram_geometry_ = {};
  if (selected_step_ >= 0 && p1.x - p0.x > 200 && p1.y - p0.y > 60) {
    const float hx = std::floor(p1.x - (p1.x - p0.x) * 0.38f);
    histogram_plot(draw, ImVec2(hx + 12, p0.y + 18), p1, layer.info.id, selected_step_);
    p1.x = hx - 8;
  }
  const long long first = (long long)std::floor(view_first_), last = (long long)std::ceil(view_last_);
  detail_geometry_ = {p0.x, p0.y, p1.x, p1.y, first, last, 0};
  if (p1.y - p0.y < 20 || p1.x - p0.x < 20) {
    ImGui::End();
    return;
  }
  // One column per pixel (heatmap.h's level of detail): a 100 k-step view is ~1,000
  // segments, not 100 k.
  const int width = std::max(1, int(p1.x - p0.x));
  const auto cells = heatmap_row(layer, run.fp_max, first, last, width);
  const double top = std::ceil(std::log2(run.fp_max)) + 1;
  double bottom = top - 8;
  for (const auto& c : cells)
    if (c.smallest_absmax > 0) bottom = std::min(bottom, std::floor(std::log2(double(c.smallest_absmax))) - 1);
  const auto Y = [&](double v) { return float(p1.y - (v - bottom) / (top - bottom) * (p1.y - p0.y)); };
  const int label_every = std::max(1, int((top - bottom) / 6));
  for (int k = int(bottom); k <= int(top); k += label_every) {
    log2_gridline(draw, p0.x, p1.x, Y(k), k);
  }
  draw->AddLine(ImVec2(p0.x, Y(std::log2(run.fp_max))), ImVec2(p1.x, Y(std::log2(run.fp_max))), kSkipped, 1.5f);
  // The underflow share (zeros and fp16 subnormals) on its own 0..100 % scale, faint.
  const auto U = [&](float share) { return p1.y - share * (p1.y - p0.y); };
  float most_share = 0.0f;
  for (const auto& c : cells) most_share = std::max(most_share, c.most_underflow);
  const bool show_share = most_share >= 0.005f;  // a flat 0 % line would read as an axis
  if (show_share)
    draw->AddText(ImVec2(p1.x - ImGui::CalcTextSize("zeros + subnormals, 0-100 %").x - 4, p0.y + 10), kUnderflowLine,
                  "zeros + subnormals, 0-100 %");
  ImVec2 previous(-1, -1), previous_share(-1, -1);
  for (int c = 0; c < width; ++c) {
    const HeatCell& cell = cells[std::size_t(c)];
    if (!cell.any) continue;
    const float cx = p0.x + float(c) + 0.5f;
    if (cell.nonfinite) draw->AddRectFilled(ImVec2(cx - 2, p0.y), ImVec2(cx + 2, p0.y + 8), kNonfinite);
    if (show_share && cell.most_underflow >= 0) {
      const ImVec2 point(cx, U(cell.most_underflow));
      if (previous_share.x >= 0) draw->AddLine(previous_share, point, kUnderflowLine, 1.0f);
      previous_share = point;
    }
    if (!(cell.largest_absmax > 0)) {
      if (cell.nonfinite) previous = ImVec2(-1, -1);
      continue;
    }
    const ImVec2 high(cx, Y(std::log2(double(cell.largest_absmax))));
    if (cell.smallest_absmax < cell.largest_absmax)
      draw->AddLine(ImVec2(cx, Y(std::log2(double(cell.smallest_absmax)))), high, kScaleLine, 1.0f);
    if (previous.x >= 0) draw->AddLine(previous, high, kScaleLine, 1.5f);
    previous = cell.nonfinite ? ImVec2(-1, -1) : high;
  }
  step_cursor(draw, p0, p1, first, last);
  ImGui::Dummy(avail);
  ImGui::End();
}

}  // namespace ampdiag::gui
