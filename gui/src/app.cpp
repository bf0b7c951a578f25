// app.h: the state every panel shares (runs, report, ranking, view, selection).
#include <imgui.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

#include "ampdiag/analyzer/escape.h"
#include "app.h"
#include "style.h"
#include "ampdiag/analyzer/analyze.h"
#include "timeline.h"
#include "gl_texture.h"

namespace ampdiag::gui {

App::App(std::vector<analyzer::Run> runs) : runs_(std::move(runs)) {
  report_ = analyzer::analyze(runs_);
  rerank();
  view_first_ = double(run().steps.front().row.step);
  view_last_ = double(run().steps.back().row.step);
}

App::~App() = default;

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
  set_view(first, last);
}

void App::set_view(double first, double last) {
  const double all_first = double(run().steps.front().row.step), all_last = double(run().steps.back().row.step);
  const double width = std::min(std::max(last - first, 0.0), all_last - all_first);  // never past the run's ends
  first = std::clamp(first, all_first, all_last - width);
  view_first_ = first, view_last_ = first + width;
}

}  // namespace ampdiag::gui
