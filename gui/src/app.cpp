// app.h: the three panels.
#include "app.h"

#include <imgui.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "ampdiag/analyzer/analyze.h"
#include "ampdiag/analyzer/escape.h"
#include "heatmap.h"
#include "timeline.h"

namespace ampdiag::gui {

namespace {

const ImU32 kScaleLine = IM_COL32(90, 170, 255, 255);
const ImU32 kSkipped = IM_COL32(235, 50, 50, 255);  // the skipped-step marker; tests look for it
const ImU32 kFloor = IM_COL32(200, 160, 60, 255);
const ImU32 kGrid = IM_COL32(70, 70, 80, 255);
const ImU32 kNonfinite = IM_COL32(230, 0, 230, 255);  // a NaN/Inf gradient; tests look for it
const ImU32 kAllZero = IM_COL32(60, 60, 60, 255);
constexpr double kScaleFloor = 128.0;  // the analyzer's default floor (Thresholds)
constexpr float kGutter = 210;         // left of both plots: axis labels, layer names

// Headroom in bits: orange near the top of the range (little room), blue far below it.
ImU32 headroom_colour(const HeatCell& c) {
  if (c.nonfinite) return kNonfinite;
  if (!std::isfinite(c.least_headroom)) return kAllZero;
  const float t = std::clamp(c.least_headroom / 16.0f, 0.0f, 1.0f);
  const float r = t < 0.25f ? 250 : 250 - (t - 0.25f) / 0.75f * 210, g = t < 0.25f ? 120 + t * 4 * 100 : 220 - (t - 0.25f) / 0.75f * 130,
              b = t < 0.25f ? 30 + t * 4 * 50 : 80 + (t - 0.25f) / 0.75f * 80;
  return IM_COL32(int(r), int(g), int(b), 255);
}

void place(const char* name, float x, float y, float w, float h) {
  ImGui::SetNextWindowPos(ImVec2(x, y));
  ImGui::SetNextWindowSize(ImVec2(w, h));
  ImGui::Begin(name, nullptr, ImGuiWindowFlags_NoMove | ImGuiWindowFlags_NoResize | ImGuiWindowFlags_NoCollapse);
}

ImVec4 severity_colour(analyzer::Severity s) {
  if (s == analyzer::Severity::kError) return ImVec4(0.95f, 0.35f, 0.35f, 1);
  if (s == analyzer::Severity::kWarning) return ImVec4(0.95f, 0.75f, 0.3f, 1);
  return ImVec4(0.7f, 0.7f, 0.7f, 1);
}

}  // namespace

App::App(std::vector<analyzer::Run> runs) : runs_(std::move(runs)) {
  report_ = analyzer::analyze(runs_);
  rerank();
  view_first_ = double(run().steps.front().row.step);
  view_last_ = double(run().steps.back().row.step);
}

void App::rerank() {
  const std::string selected = ranked_.empty() ? "" : selected_layer();
  ranked_ = analyzer::rank_layers(run(), report_);
  disagreeing_.clear();
  for (const auto& f : report_.findings)
    if (f.rule == "rank-disagreement") disagreeing_.insert(disagreeing_.end(), f.ranks.begin(), f.ranks.end());
  selected_ = 0;
  if (!selected.empty()) select(selected, selected_step_);
}

bool App::show_rank(long long rank) {
  for (std::size_t i = 0; i < runs_.size(); ++i)
    if (runs_[i].rank == rank) {
      rank_ = i;
      rerank();
      return true;
    }
  return false;
}

std::string App::top_layer() const { return ranked_.empty() ? "" : ranked_.front().layer->info.name; }

void App::frame(float width, float height) {
  const float timeline_h = std::floor(height * 0.34f), heat_h = std::floor(height * 0.30f);
  timeline(0, 0, width, timeline_h);
  heatmap(0, timeline_h, width, heat_h);
  const float top = timeline_h + heat_h, third = std::floor(width / 3);
  findings(0, top, third, height - top);
  detail(third, top, third, height - top);
  layers(2 * third, top, width - 2 * third, height - top);
}

bool App::select(const std::string& layer, long long step) {
  for (std::size_t i = 0; i < ranked_.size(); ++i)
    if (ranked_[i].layer->info.name == layer) {
      selected_ = int(i);
      selected_step_ = step;
      return true;
    }
  return false;
}

void App::replace_run(std::size_t index, analyzer::Run run) {
  if (index >= runs_.size() || run.steps.empty()) return;
  const double old_first = double(runs_[index].steps.front().row.step), old_last = double(runs_[index].steps.back().row.step);
  const bool at_end = view_last_ >= old_last - 0.5, whole = at_end && view_first_ <= old_first + 0.5;
  runs_[index] = std::move(run);
  report_ = analyzer::analyze(runs_);
  rerank();
  ++reloads_;
  // Stick to the newest step: a view of the whole run keeps showing all of it; a zoomed
  // view at the end keeps its width and slides along.
  const double new_last = double(this->run().steps.back().row.step);
  if (index == rank_ && stick_to_newest_ && whole) {
    view_first_ = double(this->run().steps.front().row.step);
    view_last_ = new_last;
  } else if (index == rank_ && stick_to_newest_ && at_end) {
    const double width = view_last_ - view_first_;
    view_last_ = new_last;
    view_first_ = std::max(double(this->run().steps.front().row.step), new_last - width);
  }
}

std::string App::selected_layer() const { return ranked_.empty() ? "" : ranked_[std::size_t(selected_)].layer->info.name; }

void App::step_cursor(ImDrawList* draw, const ImVec2& p0, const ImVec2& p1, long long first, long long last) {
  if (selected_step_ < first || selected_step_ > last) return;
  const float x = p0.x + float(step_to_x(selected_step_, first, last, double(p1.x - p0.x)));
  draw->AddLine(ImVec2(x, p0.y), ImVec2(x, p1.y), IM_COL32(255, 255, 255, 140), 1.0f);
}

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
    draw->AddLine(ImVec2(p0.x, Y(k)), ImVec2(p1.x, Y(k)), kGrid);
    char label[16];
    std::snprintf(label, sizeof label, "2^%d", k);
    draw->AddText(ImVec2(p0.x - 6 - ImGui::CalcTextSize(label).x, Y(k) - 7), IM_COL32(180, 180, 180, 255), label);
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

void App::navigate(const ImVec2& p0, const ImVec2& p1) {
  const ImGuiIO& io = ImGui::GetIO();
  const analyzer::Run& run = this->run();
  const double all_first = double(run.steps.front().row.step), all_last = double(run.steps.back().row.step);
  const ImVec2 m = io.MousePos;
  if (!(m.x >= p0.x && m.x < p1.x && m.y >= p0.y && m.y < p1.y)) return;
  const double span = view_last_ - view_first_ + 1, at = view_first_ + (m.x - p0.x) / (p1.x - p0.x) * span;
  if (ImGui::IsMouseDoubleClicked(ImGuiMouseButton_Left)) {
    view_first_ = all_first, view_last_ = all_last;
    return;
  }
  double first = view_first_, last = view_last_;
  if (io.MouseWheel != 0) {
    const double factor = std::pow(0.8, double(io.MouseWheel)), width = std::max(8.0, span * factor);
    first = at - (at - view_first_) / span * width;
    last = first + width - 1;
  } else if (ImGui::IsMouseDragging(ImGuiMouseButton_Left)) {
    const double shift = -double(io.MouseDelta.x) / (p1.x - p0.x) * span;
    first += shift, last += shift;
  } else {
    return;
  }
  const double width = std::min(last - first, all_last - all_first);  // never past the run's ends
  first = std::clamp(first, all_first, all_last - width);
  view_first_ = first, view_last_ = first + width;
}

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
  ImGui::Text("%s: %lld steps, %lld skipped, scale %g -> %g (lowest %g)%s", analyzer::printable(run.path).c_str(),
              (long long)o.steps, (long long)o.skipped, o.first_scale, o.last_scale, o.min_scale,
              o.finished ? "" : ", still being written or stopped");
  ImGui::SameLine();
  ImGui::Checkbox("Loss", &show_loss_);
  ImGui::SameLine();
  ImGui::Checkbox("Follow", &follow_);
  if (follow_) {
    ImGui::SameLine();
    ImGui::Checkbox("Stick to newest", &stick_to_newest_);
    ImGui::SameLine();
    if (follow_error_.empty()) ImGui::TextDisabled("(%d reloads)", reloads_);
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
  double lo = std::log2(kScaleFloor), hi = lo;
  for (std::size_t i = 0; i < runs_.size(); ++i) {
    if (i != rank_ && !overlay_ranks_) continue;
    for (const auto& s : runs_[i].steps) {
      const double v = std::log2(std::max(s.row.scale_after, 1e-300));
      lo = std::min(lo, v), hi = std::max(hi, v);
    }
  }
  lo = std::floor(lo) - 1, hi = std::ceil(hi) + 1;
  const auto Y = [&](double v) { return float(p1.y - (v - lo) / (hi - lo) * (p1.y - p0.y)); };
  for (int k = int(lo); k <= int(hi); ++k) {
    if ((int(hi - lo) > 16) && k % 2) continue;
    draw->AddLine(ImVec2(p0.x, Y(k)), ImVec2(p1.x, Y(k)), kGrid);
    char label[16];
    std::snprintf(label, sizeof label, "2^%d", k);
    draw->AddText(ImVec2(p0.x - 6 - ImGui::CalcTextSize(label).x, Y(k) - 7), IM_COL32(180, 180, 180, 255), label);
  }
  draw->AddLine(ImVec2(p0.x, Y(std::log2(kScaleFloor))), ImVec2(p1.x, Y(std::log2(kScaleFloor))), kFloor, 1.5f);

  const int width = std::max(1, int(p1.x - p0.x));
  // Other ranks first, dimmer (orange when a finding says they disagree), the shown rank on top.
  if (overlay_ranks_)
    for (std::size_t i = 0; i < runs_.size(); ++i) {
      if (i == rank_) continue;
      const bool odd = std::find(disagreeing_.begin(), disagreeing_.end(), runs_[i].rank) != disagreeing_.end();
      const ImU32 colour = odd ? IM_COL32(255, 150, 40, 230) : IM_COL32(190, 190, 215, 230);
      const auto other = timeline_columns(runs_[i], first, last, width);
      ImVec2 prev(-1, -1);
      for (int c = 0; c < width; ++c) {
        const auto& col = other[std::size_t(c)];
        if (!col.any) continue;
        const float cx = p0.x + float(c) + 0.5f;
        if (prev.x >= 0) {
          draw->AddLine(prev, ImVec2(cx, prev.y), colour, 2.0f);
          draw->AddLine(ImVec2(cx, prev.y), ImVec2(cx, Y(col.hi)), colour, 2.0f);
        }
        draw->AddLine(ImVec2(cx, Y(col.hi)), ImVec2(cx, Y(col.lo)), colour, 2.0f);
        prev = ImVec2(cx, Y(col.lo));
      }
    }
  const auto columns = timeline_columns(run, first, last, width);
  ImVec2 previous(-1, -1);
  for (int c = 0; c < width; ++c) {
    const auto& col = columns[std::size_t(c)];
    if (!col.any) continue;
    const float cx = p0.x + float(c) + 0.5f;
    const ImVec2 top(cx, Y(col.hi)), bottom(cx, Y(col.lo));
    // The scale is a step function: it holds until the next step, then jumps.
    if (previous.x >= 0) {
      draw->AddLine(previous, ImVec2(cx, previous.y), kScaleLine, 2.0f);
      draw->AddLine(ImVec2(cx, previous.y), top, kScaleLine, 2.0f);
    }
    draw->AddLine(top, bottom, kScaleLine, 2.0f);
    previous = bottom;
    if (col.skipped) draw->AddRectFilled(ImVec2(cx - 1.5f, p1.y + 2), ImVec2(cx + 1.5f, p1.y + marker_strip), kSkipped);
  }
  step_cursor(draw, p0, p1, first, last);

  // The step ruler: round step numbers (1, 2 or 5 x 10^k apart), about one per 120 pixels.
  {
    const double span = double(last - first + 1), raw = span / std::max(1.0, double(p1.x - p0.x) / 120.0);
    const double magnitude = std::pow(10.0, std::floor(std::log10(std::max(1.0, raw))));
    double every = 10 * magnitude;
    for (double m : {1.0, 2.0, 5.0})
      if (m * magnitude >= raw) {
        every = m * magnitude;
        break;
      }
    const std::int64_t every_steps = std::max<std::int64_t>(1, std::int64_t(every));
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
  if (show_loss_) {
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
    for (const auto& s : run.steps)
      if (s.row.step == step) {
        ImGui::BeginTooltip();
        ImGui::Text("step %lld\nscale %g -> %g\nloss %g", (long long)step, s.row.scale_before, s.row.scale_after, s.row.loss);
        for (const auto& k : report_.skipped)
          if (k.rank == run.rank && k.step == step) {
            ImGui::TextColored(ImVec4(0.95f, 0.35f, 0.35f, 1), "SKIPPED");
            if (k.forward_known)
              ImGui::Text("forward went non-finite at %s",
                          k.forward_module.empty() ? "the model's own forward()" : analyzer::printable(k.forward_module).c_str());
            if (!k.nonfinite_layers.empty())
              ImGui::Text("first non-finite gradient: %s%s", analyzer::printable(k.nonfinite_layers.front()).c_str(),
                          k.nonfinite_layer_count > 1 ? (" (+" + std::to_string(k.nonfinite_layer_count - 1) + " more)").c_str() : "");
          }
        ImGui::EndTooltip();
        break;
      }
  }
  ImGui::Dummy(avail);
  ImGui::End();
}

void App::heatmap(float x, float y, float w, float h) {
  const analyzer::Run& run = this->run();
  place("Layers x steps: headroom below the fp16 maximum (magenta: NaN/Inf)", x, y, w, h);
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
  const int width = std::max(1, int(p1.x - p0.x));
  for (int r = 0; r < visible && row_offset_ + r < int(ranked_.size()); ++r) {
    const auto& layer = *ranked_[std::size_t(row_offset_ + r)].layer;
    const float ry = p0.y + float(r) * row_h;
    const std::string name = analyzer::printable(layer.info.name);
    if (ImGui::IsMouseClicked(ImGuiMouseButton_Left) && m.y >= ry && m.y < ry + row_h && m.x >= origin.x && m.x < p1.x)
      selected_ = row_offset_ + r;
    if (row_offset_ + r == selected_)
      draw->AddRectFilled(ImVec2(origin.x, ry), ImVec2(p0.x - 2, ry + row_h), IM_COL32(60, 80, 130, 255));
    draw->PushClipRect(ImVec2(origin.x, ry), ImVec2(p0.x - 6, ry + row_h), true);
    draw->AddText(ImVec2(std::max(origin.x, p0.x - 6 - ImGui::CalcTextSize(name.c_str()).x), ry), IM_COL32(200, 200, 200, 255),
                  name.c_str());
    draw->PopClipRect();
    const auto cells = heatmap_row(layer, run.fp_max, first, last, width);
    // Runs of one colour are one rectangle: 500 rows stay cheap to draw. With fewer steps
    // than pixels a cell spans its step's share of the width, edge to edge.
    const double span = double(std::max<std::int64_t>(1, last - first + 1)), per_step = double(width) / span;
    const auto edge = [&](int column) {  // left edge of the cell holding `column`
      if (per_step <= 1) return p0.x + float(column);
      const double step = std::floor((double(column) + 0.5) / per_step);
      return p0.x + float(std::round(step * per_step));
    };
    const auto right_edge = [&](int column) {
      if (per_step <= 1) return p0.x + float(column + 1);
      const double step = std::floor((double(column) + 0.5) / per_step);
      return std::min(p1.x, p0.x + float(std::round((step + 1) * per_step)));
    };
    for (int c = 0; c < width;) {
      if (!cells[std::size_t(c)].any) {
        ++c;
        continue;
      }
      const ImU32 colour = headroom_colour(cells[std::size_t(c)]);
      int end = c + 1;
      while (end < width && cells[std::size_t(end)].any && headroom_colour(cells[std::size_t(end)]) == colour) ++end;
      draw->AddRectFilled(ImVec2(edge(c), ry + 1), ImVec2(right_edge(end - 1), ry + row_h - 1), colour);
      c = end;
    }
  }
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

void App::findings(float x, float y, float w, float h) {
  place("Findings", x, y, w, h);
  if (report_.findings.empty()) ImGui::TextColored(ImVec4(0.4f, 0.85f, 0.4f, 1), "Healthy: nothing found.");
  int n = 0;
  for (const auto& f : report_.findings) {
    ImGui::PushID(n++);
    ImGui::TextColored(severity_colour(f.severity), "%s [%s]", analyzer::severity_name(f.severity), f.rule.c_str());
    if (!f.layer.empty()) {
      ImGui::SameLine();
      if (ImGui::SmallButton("Show")) select(f.layer, f.steps.empty() ? -1 : f.steps.front());
    }
    ImGui::TextWrapped("%s", analyzer::printable(f.title).c_str());
    ImGui::PushStyleColor(ImGuiCol_Text, ImGui::GetStyleColorVec4(ImGuiCol_TextDisabled));
    ImGui::TextWrapped("%s", analyzer::printable(f.evidence).c_str());
    ImGui::PopStyleColor();
    if (!f.suggestions.empty()) {
      const auto& s = f.suggestions.front();
      ImGui::TextWrapped("fix: %s", analyzer::printable(s.summary).c_str());
      if (!s.python.empty() && ImGui::SmallButton("Copy Python")) ImGui::SetClipboardText(s.python.c_str());
      if (!s.cpp.empty()) {
        ImGui::SameLine();
        if (ImGui::SmallButton("Copy C++")) ImGui::SetClipboardText(s.cpp.c_str());
      }
    }
    ImGui::Separator();
    ImGui::PopID();
  }
  ImGui::End();
}

void App::layers(float x, float y, float w, float h) {
  place("Layers (culprits first)", x, y, w, h);
  if (ImGui::BeginTable("layers", 3, ImGuiTableFlags_RowBg | ImGuiTableFlags_ScrollY | ImGuiTableFlags_Resizable)) {
    ImGui::TableSetupColumn("layer");
    ImGui::TableSetupColumn("non-finite steps");
    ImGui::TableSetupColumn("least headroom (bits)");
    ImGui::TableHeadersRow();
    ImGuiListClipper clipper;
    clipper.Begin(int(ranked_.size()));
    while (clipper.Step())
      for (int i = clipper.DisplayStart; i < clipper.DisplayEnd; ++i) {
        const auto& r = ranked_[std::size_t(i)];
        ImGui::TableNextRow();
        ImGui::TableNextColumn();
        if (ImGui::Selectable(analyzer::printable(r.layer->info.name).c_str(), i == selected_, ImGuiSelectableFlags_SpanAllColumns))
          selected_ = i;
        ImGui::TableNextColumn();
        ImGui::Text("%lld", (long long)r.layer->nonfinite_steps);
        ImGui::TableNextColumn();
        if (std::isfinite(r.least_headroom)) ImGui::Text("%.1f", r.least_headroom);
        else ImGui::TextUnformatted(r.least_headroom < 0 ? "non-finite" : "-");
      }
    ImGui::EndTable();
  }
  ImGui::End();
}

}  // namespace ampdiag::gui
