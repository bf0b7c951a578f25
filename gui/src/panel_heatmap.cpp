// The layer x step heatmap panel.
#include <imgui.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>

#include "ampdiag/analyzer/escape.h"
#include "app.h"
#include "style.h"
#include "heatmap.h"
#include "timeline.h"
#include "gl_texture.h"

namespace ampdiag::gui {

std::string App::heatmap_title() const {
  // Headroom is against the run's own dtype (bf16's maximum in a bf16 run); the underflow
  // share is fp16's range whatever the dtype (the agent's fp16_subnormal statistic).
  if (heat_underflow_) return "Layers x steps: share of values zero or fp16-subnormal (magenta: NaN/Inf)";
  return std::string("Layers x steps: headroom below the ") + (run().fp16() ? "fp16" : "bf16") +
         " maximum (magenta: NaN/Inf)";
}

void App::heatmap(float x, float y, float w, float h) {
  const analyzer::Run& run = this->run();
  place((heatmap_title() + "###heatmap").c_str(), x, y, w, h);
  if (ImGui::RadioButton("headroom", !heat_underflow_)) heat_underflow_ = false;
  ImGui::SameLine();
  if (ImGui::RadioButton("underflow share", heat_underflow_)) heat_underflow_ = true;
  const ImVec2 origin = ImGui::GetCursorScreenPos(), avail = ImGui::GetContentRegionAvail();
  const ImVec2 p0(origin.x + kGutter, origin.y), p1(origin.x + avail.x, origin.y + avail.y);
  ImDrawList* draw = ImGui::GetWindowDrawList();
  navigate(p0, p1);
  const std::int64_t first = std::int64_t(std::floor(view_first_)), last = std::int64_t(std::ceil(view_last_));
  const float row_h = 14;
  const int visible = std::max(1, int((p1.y - p0.y) / row_h));
  const ImVec2 m = ImGui::GetIO().MousePos;
  if (m.x >= origin.x && m.x < p0.x && m.y >= p0.y && m.y < p1.y && ImGui::GetIO().MouseWheel != 0)
    row_offset_ -= int(ImGui::GetIO().MouseWheel) * 3;  // the wheel over the names scrolls the rows
  row_offset_ = std::clamp(row_offset_, 0, std::max(0, int(ranked_.size()) - visible));
  heat_geometry_ = {p0.x, p0.y, p1.x, p1.y, (long long)first, (long long)last, row_h};
  const int width = std::max(1, int(p1.x - p0.x)), height = std::max(1, int(p1.y - p0.y));
  // The cells are painted into a texture, one texel per pixel, and drawn as one quad.
  heat_pixels_.assign(std::size_t(width) * std::size_t(height), 0);
  const double span = double(std::max<std::int64_t>(1, last - first + 1)), per_step = double(width) / span;
  std::vector<int> cell_of(static_cast<std::size_t>(width));  // with fewer steps than pixels, a step's cell spans its share
  for (int x = 0; x < width; ++x)
    cell_of[std::size_t(x)] =
        per_step <= 1 ? x : column_of(first + std::int64_t(std::floor((double(x) + 0.5) / per_step)), first, last, width);
  const float gutter = p0.x - 6 - origin.x;  // the names' room, right-aligned against the cells
  for (int r = 0; r < visible && row_offset_ + r < int(ranked_.size()); ++r) {
    const auto& layer = *ranked_[std::size_t(row_offset_ + r)].layer;
    const float ry = p0.y + float(r) * row_h;
    const std::string name = fit_end(analyzer::printable(layer.info.name), gutter, text_width);
    if (ImGui::IsMouseClicked(ImGuiMouseButton_Left) && m.y >= ry && m.y < ry + row_h && m.x >= origin.x && m.x < p1.x)
      selected_ = row_offset_ + r;
    if (row_offset_ + r == selected_)
      draw->AddRectFilled(ImVec2(origin.x, ry), ImVec2(p0.x - 2, ry + row_h), IM_COL32(60, 80, 130, 255));
    draw->PushClipRect(ImVec2(origin.x, ry), ImVec2(p0.x - 6, ry + row_h), true);
    draw->AddText(ImVec2(p0.x - 6 - text_width(name), ry), IM_COL32(200, 200, 200, 255), name.c_str());
    draw->PopClipRect();
    const auto cells = heatmap_row(layer, run.fp_max, first, last, width);
    const int top = int(float(r) * row_h) + 1, bottom = std::min(height, int(float(r + 1) * row_h) - 1);
    if (top >= bottom) continue;
    ImU32* row = heat_pixels_.data() + std::size_t(top) * std::size_t(width);
    for (int x = 0; x < width; ++x) {
      const HeatCell& cell = cells[std::size_t(cell_of[std::size_t(x)])];
      if (cell.any) row[x] = heat_underflow_ ? underflow_colour(cell) : headroom_colour(cell);
    }
    for (int y = top + 1; y < bottom; ++y)
      std::copy_n(row, width, heat_pixels_.data() + std::size_t(y) * std::size_t(width));
  }
  if (!heat_texture_) heat_texture_ = std::make_unique<RgbaTexture>();
  heat_texture_->upload(heat_pixels_, width, height);
  draw->AddImage(heat_texture_->id(), p0, ImVec2(p0.x + float(width), p0.y + float(height)));
  step_cursor(draw, p0, p1, first, last);
  // Hover: the numbers behind the cell under the cursor.
  const int hover_row = int((m.y - p0.y) / row_h);
  if (m.x >= p0.x && m.x < p1.x && m.y >= p0.y && hover_row < visible && row_offset_ + hover_row < int(ranked_.size())) {
    const auto& layer = *ranked_[std::size_t(row_offset_ + hover_row)].layer;
    const std::int64_t step = first + std::int64_t((m.x - p0.x) / (p1.x - p0.x) * double(last - first + 1));
    const auto it = std::lower_bound(layer.samples.begin(), layer.samples.end(), step,
                                     [](const analyzer::GradSample& s, std::int64_t v) { return s.step < v; });
    ImGui::BeginTooltip();
    ImGui::Text("%s", analyzer::printable(layer.info.name).c_str());
    if (it != layer.samples.end() && it->step == step) {
      if (it->nonfinite)
        ImGui::Text("step %lld: NaN/Inf in the gradient", (long long)step);
      else
        ImGui::Text("step %lld: |g| max %g before unscale, %.1f bits below the maximum\nzeros %.1f %%, fp16 subnormals %.1f %%",
                    (long long)step, double(it->absmax), analyzer::headroom_bits(it->absmax, run.fp_max),
                    it->zero_q / 655.35, it->sub_q / 2.55);
    } else {
      ImGui::Text("step %lld: not sampled", (long long)step);
    }
    ImGui::EndTooltip();
  }
  ImGui::Dummy(avail);
  ImGui::End();
}

}  // namespace ampdiag::gui
