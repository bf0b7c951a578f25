// What the GUI's panels share: colours (tests look for some of them), the plots' left
// gutter, and how a panel is placed.
#pragma once

#include <imgui.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "ampdiag/analyzer/findings.h"
#include "fit_text.h"
#include "heatmap.h"
#include "timeline.h"

namespace ampdiag::gui {

inline const ImU32 kScaleLine = IM_COL32(90, 170, 255, 255);
inline const ImU32 kSkipped = IM_COL32(235, 50, 50, 255);  // the skipped-step marker; tests look for it
inline const ImU32 kFloor = IM_COL32(200, 160, 60, 255);
inline const ImU32 kGrid = IM_COL32(70, 70, 80, 255);
inline const ImU32 kNonfinite = IM_COL32(230, 0, 230, 255);  // a NaN/Inf gradient; tests look for it
inline const ImU32 kAllZero = IM_COL32(60, 60, 60, 255);
inline const ImU32 kUnderflowLine = IM_COL32(80, 200, 230, 150);
inline constexpr double kScaleFloor = 128.0;  // the analyzer's default floor (Thresholds)
inline constexpr float kGutter = 210;         // left of both plots: axis labels, layer names

// A text's width in the current font (fit_end's measure).
inline float text_width(const std::string& text) { return ImGui::CalcTextSize(text.c_str()).x; }

// Headroom in bits: orange near the top of the range (little room), blue far below it.
inline ImU32 headroom_colour(const HeatCell& c) {
  if (c.nonfinite) return kNonfinite;
  if (!std::isfinite(c.least_headroom)) return kAllZero;
  const float t = std::clamp(c.least_headroom / 16.0f, 0.0f, 1.0f);
  const float r = t < 0.25f ? 250 : 250 - (t - 0.25f) / 0.75f * 210, g = t < 0.25f ? 120 + t * 4 * 100 : 220 - (t - 0.25f) / 0.75f * 130,
              b = t < 0.25f ? 30 + t * 4 * 50 : 80 + (t - 0.25f) / 0.75f * 80;
  return IM_COL32(int(r), int(g), int(b), 255);
}

// The second channel: the share of values at or below fp16's normal range, dark (none)
// to bright cyan (all).
inline ImU32 underflow_colour(const HeatCell& c) {
  if (c.nonfinite) return kNonfinite;
  if (c.most_underflow < 0) return kAllZero;
  const float t = std::clamp(c.most_underflow, 0.0f, 1.0f);
  return IM_COL32(int(30 + t * 20), int(45 + t * 200), int(70 + t * 185), 255);
}

// A grid line across the plot at `y`, labelled 2^k in the gutter to its left.
inline void log2_gridline(ImDrawList* draw, float x0, float x1, float y, int k) {
  draw->AddLine(ImVec2(x0, y), ImVec2(x1, y), kGrid);
  char label[16];
  std::snprintf(label, sizeof label, "2^%d", k);
  draw->AddText(ImVec2(x0 - 6 - ImGui::CalcTextSize(label).x, y - 7), IM_COL32(180, 180, 180, 255), label);
}

// The scale as a step function over timeline columns: it holds until the next step, then
// jumps; a column that holds several steps spans their lowest to highest.
template <typename Y>
void draw_scale_steps(ImDrawList* draw, const std::vector<TimelineColumn>& columns, float x0, Y y_of, ImU32 colour) {
  ImVec2 previous(-1, -1);
  for (std::size_t c = 0; c < columns.size(); ++c) {
    const auto& col = columns[c];
    if (!col.any) continue;
    const float cx = x0 + float(c) + 0.5f;
    const ImVec2 top(cx, y_of(col.hi)), bottom(cx, y_of(col.lo));
    if (previous.x >= 0) {
      draw->AddLine(previous, ImVec2(cx, previous.y), colour, 2.0f);
      draw->AddLine(ImVec2(cx, previous.y), top, colour, 2.0f);
    }
    draw->AddLine(top, bottom, colour, 2.0f);
    previous = bottom;
  }
}

inline void place(const char* name, float x, float y, float w, float h) {
  ImGui::SetNextWindowPos(ImVec2(x, y));
  ImGui::SetNextWindowSize(ImVec2(w, h));
  // Never brought to the front: the splitters between the panels stay on top.
  ImGui::Begin(name, nullptr,
               ImGuiWindowFlags_NoMove | ImGuiWindowFlags_NoResize | ImGuiWindowFlags_NoCollapse |
                   ImGuiWindowFlags_NoBringToFrontOnFocus);
}

inline ImVec4 severity_colour(analyzer::Severity s) {
  if (s == analyzer::Severity::kError) return ImVec4(0.95f, 0.35f, 0.35f, 1);
  if (s == analyzer::Severity::kWarning) return ImVec4(0.95f, 0.75f, 0.3f, 1);
  return ImVec4(0.7f, 0.7f, 0.7f, 1);
}


}  // namespace ampdiag::gui
