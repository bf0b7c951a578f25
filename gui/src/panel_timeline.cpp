// The loss-scale timeline panel: scale by step, skipped-step ticks, floor, ranks, loss, ruler.
#include <imgui.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

#include "ampdiag/analyzer/axis.h"
#include "ampdiag/analyzer/causes.h"
#include "ampdiag/analyzer/escape.h"
#include "app.h"
#include "style.h"
#include "timeline.h"

namespace ampdiag::gui {

void App::timeline(float x, float y, float w, float h) {
  const analyzer::Run& run = this->run();
  place("Loss scale", x, y, w, h);
  const auto& o = report_.runs[rank_];
  if (runs_.size() > 1) {
    ImGui::SetNextItemWidth(190);
    const auto label = [&](std::size_t i) {
      const bool odd = std::find(disagreeing_.begin(), disagreeing_.end(), runs_[i].rank) != disagreeing_.end();
      return "rank " + std::to_string(runs_[i].rank) + (odd ? " (disagrees)" : "");
    };
    if (ImGui::BeginCombo("##rank", label(rank_).c_str())) {
      for (std::size_t i = 0; i < runs_.size(); ++i)
        if (ImGui::Selectable(label(i).c_str(), i == rank_)) {
          rank_ = i;
          rerank();
        }
      ImGui::EndCombo();
    }
    ImGui::SameLine();
    ImGui::Checkbox("All ranks' scales", &overlay_ranks_);
    ImGui::SameLine();
  }
  // Without a scaler (bf16, or half-precision parameters) the recorded scale is a constant
  // 1: no floor to fall below, and the loss is what there is to see.
  const bool scaler = run.has_scaler();
  if (scaler)
    ImGui::Text("%s: %lld steps, %lld skipped, scale %g -> %g (lowest %g)%s", analyzer::printable(run.path).c_str(),
                (long long)o.steps, (long long)o.skipped, o.first_scale, o.last_scale, o.min_scale,
                o.finished ? "" : ", still being written or stopped");
  else
    ImGui::Text("%s: %lld steps, no loss scaler: the loss by step%s", analyzer::printable(run.path).c_str(),
                (long long)o.steps, o.finished ? "" : ", still being written or stopped");
  ImGui::SameLine();
  if (scaler) {  // else it is always drawn
    ImGui::Checkbox("Loss", &show_loss_);
    ImGui::SameLine();
  }
  ImGui::Checkbox("Follow", &follow_);
  if (follow_) {
    ImGui::SameLine();
    ImGui::Checkbox("Stick to newest", &stick_to_newest_);
    ImGui::SameLine();
    if (follow_error_.empty()) ImGui::TextDisabled("(%d updates)", updates_);
    else ImGui::TextColored(ImVec4(0.95f, 0.6f, 0.3f, 1), "%s", analyzer::printable(follow_error_).c_str());
  }
  const ImVec2 origin = ImGui::GetCursorScreenPos(), avail = ImGui::GetContentRegionAvail();
  const float marker_strip = 14, ruler = 16;
  const float pad = 8;  // room for the top axis label
  const ImVec2 p0(origin.x + kGutter, origin.y + pad), p1(origin.x + avail.x, origin.y + avail.y - marker_strip - ruler);
  ImDrawList* draw = ImGui::GetWindowDrawList();
  navigate(p0, ImVec2(p1.x, p1.y + marker_strip));
  const std::int64_t first = std::int64_t(std::floor(view_first_)), last = std::int64_t(std::ceil(view_last_));
  geometry_ = {p0.x, p0.y, p1.x, p1.y, (long long)first, (long long)last};

  // y: log2 of the scale, from the lowest to the highest seen (and the floor).
  double lo = scaler ? std::log2(kScaleFloor) : 0.0, hi = lo;
  for (std::size_t i = 0; i < runs_.size(); ++i) {
    if (i != rank_ && !overlay_ranks_) continue;
    for (const auto& s : runs_[i].steps) {
      const double v = std::log2(std::max(s.row.scale_after, 1e-300));
      lo = std::min(lo, v), hi = std::max(hi, v);
    }
  }
  lo = std::floor(lo) - 1, hi = std::ceil(hi) + 1;
  const auto Y = [&](double v) { return float(p1.y - (v - lo) / (hi - lo) * (p1.y - p0.y)); };
  const int stride = log2_label_stride(hi - lo, p1.y - p0.y, ImGui::GetTextLineHeight() + 2);
  for (int k = int(std::ceil(lo / stride)) * stride; scaler && k <= int(hi); k += stride)
    log2_gridline(draw, p0.x, p1.x, Y(k), k);
  if (scaler) draw->AddLine(ImVec2(p0.x, Y(std::log2(kScaleFloor))), ImVec2(p1.x, Y(std::log2(kScaleFloor))), kFloor, 1.5f);

  const int width = std::max(1, int(p1.x - p0.x));
  // Other ranks first, dimmer (orange when a finding says they disagree), the shown rank on top.
  if (overlay_ranks_)
    for (std::size_t i = 0; i < runs_.size(); ++i) {
      if (i == rank_) continue;
      const bool odd = std::find(disagreeing_.begin(), disagreeing_.end(), runs_[i].rank) != disagreeing_.end();
      const ImU32 colour = odd ? IM_COL32(255, 150, 40, 230) : IM_COL32(190, 190, 215, 230);
      draw_scale_steps(draw, timeline_columns(runs_[i], first, last, width), p0.x, Y, colour);
    }
  const auto columns = timeline_columns(run, first, last, width);
  if (scaler) draw_scale_steps(draw, columns, p0.x, Y, kScaleLine);
  for (int c = 0; c < width; ++c) {
    const float cx = p0.x + float(c) + 0.5f;
    if (columns[std::size_t(c)].skipped)
      draw->AddRectFilled(ImVec2(cx - 1.5f, p1.y + 2), ImVec2(cx + 1.5f, p1.y + marker_strip), kSkipped);
  }
  step_cursor(draw, p0, p1, first, last);

  // The step ruler: round step numbers (1, 2 or 5 x 10^k apart), about one per 120 pixels.
  {
    const std::int64_t every_steps =
        std::int64_t(analyzer::nice_step(double(last - first + 1), std::max(1.0, double(p1.x - p0.x) / 120.0), true));
    const float ry = p1.y + marker_strip;
    for (std::int64_t t = (first + every_steps - 1) / every_steps * every_steps; t <= last; t += every_steps) {
      const float tx = p0.x + float(step_to_x(t, first, last, double(p1.x - p0.x)));
      draw->AddLine(ImVec2(tx, ry), ImVec2(tx, ry + 4), IM_COL32(180, 180, 180, 255));
      const std::string label = std::to_string(t);
      draw->AddText(ImVec2(tx - ImGui::CalcTextSize(label.c_str()).x / 2, ry + 3), IM_COL32(180, 180, 180, 255), label.c_str());
    }
    draw->AddText(ImVec2(p0.x - 6 - ImGui::CalcTextSize("step").x, ry + 3), IM_COL32(140, 140, 140, 255), "step");
  }

  // The loss on its own axis (right), NaN/Inf losses as magenta marks along the top.
  if (show_loss_ || !scaler) {
    double loss_lo = INFINITY, loss_hi = -INFINITY;
    for (const auto& s : run.steps)
      if (s.row.step >= first && s.row.step <= last && std::isfinite(s.row.loss))
        loss_lo = std::min(loss_lo, s.row.loss), loss_hi = std::max(loss_hi, s.row.loss);
    if (!(loss_hi > loss_lo)) {  // one value (or none): a flat line in the middle
      if (!std::isfinite(loss_lo)) loss_lo = loss_hi = 0;
      loss_lo -= 0.5, loss_hi += 0.5;
    }
    const auto LY = [&](double v) { return float(p1.y - (v - loss_lo) / (loss_hi - loss_lo) * (p1.y - p0.y) * 0.9); };
    const ImU32 loss_colour = IM_COL32(120, 220, 140, 220);
    ImVec2 prev(-1, -1);
    for (const auto& s : run.steps) {
      if (s.row.step < first || s.row.step > last) continue;
      const float cx = p0.x + float(step_to_x(s.row.step, first, last, double(p1.x - p0.x)));
      if (!std::isfinite(s.row.loss)) {
        if (run.loss_known(s.row)) draw->AddRectFilled(ImVec2(cx - 2, p0.y), ImVec2(cx + 2, p0.y + 6), kNonfinite);
        prev = ImVec2(-1, -1);
        continue;
      }
      const ImVec2 point(cx, LY(s.row.loss));
      if (prev.x >= 0) draw->AddLine(prev, point, loss_colour, 1.5f);
      prev = point;
    }
    char label[32];
    for (double v : {loss_lo, loss_hi}) {
      std::snprintf(label, sizeof label, "loss %.3g", v);
      draw->AddText(ImVec2(p1.x - ImGui::CalcTextSize(label).x - 4, LY(v) - 14), loss_colour, label);
    }
  }

  // Hover: the step under the cursor, and for a skipped step the analyzer's cause.
  const ImVec2 mouse = ImGui::GetIO().MousePos;
  if (mouse.x >= p0.x && mouse.x < p1.x && mouse.y >= p0.y && mouse.y <= p1.y + marker_strip + ruler) {
    const std::int64_t step = first + std::int64_t((mouse.x - p0.x) / (p1.x - p0.x) * double(last - first + 1));
    const auto it = std::lower_bound(run.steps.begin(), run.steps.end(), step,
                                     [](const analyzer::StepSummary& s, std::int64_t v) { return s.row.step < v; });
    if (it != run.steps.end() && it->row.step == step) {
      ImGui::BeginTooltip();
      ImGui::Text("step %lld\nscale %g -> %g\nloss %g", (long long)step, it->row.scale_before, it->row.scale_after, it->row.loss);
      for (const auto& k : report_.skipped)
        if (k.rank == run.rank && k.step == step) {
          ImGui::TextColored(ImVec4(0.95f, 0.35f, 0.35f, 1), "SKIPPED");
          const std::string forward = analyzer::forward_sentence(k.forward, k.forward_module);
          if (!forward.empty()) ImGui::TextUnformatted(analyzer::printable(forward).c_str());
          if (!k.nonfinite_layers.empty())
            ImGui::Text(k.nonfinite_ordered ? "first non-finite gradient: %s%s" : "non-finite gradients (order unknown): %s%s",
                        analyzer::printable(k.nonfinite_layers.front()).c_str(),
                        k.nonfinite_layer_count > 1 ? (" (+" + std::to_string(k.nonfinite_layer_count - 1) + " more)").c_str() : "");
        }
      ImGui::EndTooltip();
    }
  }
  ImGui::Dummy(avail);
  ImGui::End();
}

}  // namespace ampdiag::gui
