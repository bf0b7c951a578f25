// The layer detail panel: the selected layer's |g| against the dtype's maximum.
#include <imgui.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

#include "ampdiag/analyzer/escape.h"
#include "app.h"
#include "style.h"
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
  const ImVec2 p0(origin.x + 44, origin.y + 6), p1(origin.x + avail.x - 4, origin.y + avail.y - 16);
  ImDrawList* draw = ImGui::GetWindowDrawList();
  const long long first = (long long)std::floor(view_first_), last = (long long)std::ceil(view_last_);
  detail_geometry_ = {p0.x, p0.y, p1.x, p1.y, first, last, 0};
  if (p1.y - p0.y < 20 || p1.x - p0.x < 20) {
    ImGui::End();
    return;
  }
  const double top = std::ceil(std::log2(run.fp_max)) + 1;
  double bottom = top - 8;
  for (const auto& s : layer.samples)
    if (!s.nonfinite && s.absmax > 0) bottom = std::min(bottom, std::floor(std::log2(double(s.absmax))) - 1);
  const auto Y = [&](double v) { return float(p1.y - (v - bottom) / (top - bottom) * (p1.y - p0.y)); };
  const auto X = [&](long long step) { return p0.x + float(step_to_x(step, first, last, double(p1.x - p0.x))); };
  const int label_every = std::max(1, int((top - bottom) / 6));
  for (int k = int(bottom); k <= int(top); k += label_every) {
    log2_gridline(draw, p0.x, p1.x, Y(k), k);
  }
  draw->AddLine(ImVec2(p0.x, Y(std::log2(run.fp_max))), ImVec2(p1.x, Y(std::log2(run.fp_max))), kSkipped, 1.5f);
  ImVec2 previous(-1, -1);
  for (const auto& s : layer.samples) {
    if (s.step < first || s.step > last) continue;
    if (s.nonfinite) {
      const float cx = X(s.step);
      draw->AddRectFilled(ImVec2(cx - 2, p0.y), ImVec2(cx + 2, p0.y + 8), kNonfinite);
      previous = ImVec2(-1, -1);
      continue;
    }
    if (s.absmax <= 0) continue;
    const ImVec2 point(X(s.step), Y(std::log2(double(s.absmax))));
    if (previous.x >= 0) draw->AddLine(previous, point, kScaleLine, 1.5f);
    previous = point;
  }
  step_cursor(draw, p0, p1, first, last);
  ImGui::Dummy(avail);
  ImGui::End();
}

}  // namespace ampdiag::gui
