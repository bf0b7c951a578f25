// app.h: the state every panel shares (runs, report, ranking, view, selection).
#include <imgui.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <string>

#include "ampdiag/analyzer/escape.h"
#include "ampdiag/analyzer/fp8.h"
#include "ampdiag/analyzer/whatif.h"
#include "app.h"
#include "style.h"
#include "ampdiag/analyzer/analyze.h"
#include "timeline.h"
#include "gl_texture.h"

namespace ampdiag::gui {

App::App(const std::vector<std::string>& paths) { show(load(paths), paths); }

std::vector<analyzer::Run> App::load(const std::vector<std::string>& paths) {
  if (paths.empty()) throw std::runtime_error("no file to open");
  analyzer::LoadOptions options;
  options.allow_unfinished = true;  // the GUI shows a run while it trains
  std::vector<analyzer::Run> runs;
  for (const auto& path : paths) runs.push_back(analyzer::load_run(path, options));
  return runs;
}

void App::show(std::vector<analyzer::Run> runs, const std::vector<std::string>& paths) {
  poll_analysis(true);
  runs_ = std::move(runs);
  paths_ = paths;
  rank_ = 0;
  selected_step_ = -1;
  ranked_.clear();  // a new run selects its own top layer
  summaries_asked_ = std::chrono::steady_clock::now();
  use_analysis(analysis(rank_, true));
  // The rank the HTML report shows the layers of (a finding's, or the one that went NaN/Inf).
  if (const std::size_t focus = analyzer::focus_run(report_, runs_); focus != rank_) {
    rank_ = focus;
    ranked_.clear();  // its own top layer selected
    rerank();
  }
  whatif_open_ = !report_.runs.empty() && report_.runs.front().skipped > 0;
  row_offset_ = 0;
  updates_ = merged_ = whole_loads_ = 0;
  follow_error_.clear();
  view_first_ = double(run().steps.front().row.step);
  view_last_ = double(run().steps.back().row.step);
}

App::~App() { poll_analysis(true); }

void App::poll_analysis(bool wait) {
  if (!analysis_.valid() || (!wait && analysis_.wait_for(std::chrono::seconds(0)) != std::future_status::ready)) return;
  Analysis a;
  try {
    a = analysis_.get();
  } catch (const std::exception& e) {
    follow_error_ = std::string("the rules failed on the updated run: ") + e.what();
    return;
  }
  use_analysis(std::move(a));
}

App::Analysis App::analysis(std::size_t rank, bool with_summaries) const {
  Analysis a;
  a.report = analyzer::analyze(runs_);
  a.ranked = analyzer::rank_layers(runs_[rank], a.report);
  a.rank = rank;
  if (with_summaries) {
    const auto t0 = std::chrono::steady_clock::now();
    auto& s = a.summaries.emplace();
    s.whatif = analyzer::whatif_lines(runs_.front());
    analyzer::add_fp8_overview(a.report, runs_);
    for (const auto& run : a.report.runs) s.fp8.push_back(run.fp8);
    s.cost = std::chrono::steady_clock::now() - t0;
  }
  return a;
}

void App::use_analysis(Analysis a) {
  report_ = std::move(a.report);
  if (a.summaries) {
    whatif_ = std::move(a.summaries->whatif);
    fp8_ = std::move(a.summaries->fp8);
    summaries_cost_ = a.summaries->cost;
  }
  if (a.rank == rank_) use_ranking(std::move(a.ranked));
  else rerank();  // the rank shown changed meanwhile
}

void App::rerank() { use_ranking(analyzer::rank_layers(run(), report_)); }

void App::use_ranking(std::vector<analyzer::LayerRowSummary> ranked) {
  const std::string selected = ranked_.empty() ? "" : selected_layer();
  ranked_ = std::move(ranked);
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
  poll_analysis();
  const float menu = menu_bar(), h = height - menu;
  const float timeline_h = std::floor(h * split_timeline_), heat_h = std::floor(h * split_heat_);
  timeline(0, menu, width, timeline_h);
  heatmap(0, menu + timeline_h, width, heat_h);
  const float top = menu + timeline_h + heat_h, left = std::floor(width * split_left_), right = std::floor(width * split_right_);
  findings(0, top, left, height - top);
  detail(left, top, right - left, height - top);
  layers(right, top, width - right, height - top);
  // Drawn after the panels, so on top of their edges.
  float below_heat = split_timeline_ + split_heat_;
  splitter("##split-timeline", false, 0, menu + timeline_h, width, h, split_timeline_);
  split_heat_ = std::clamp(below_heat - split_timeline_, 0.1f, 0.8f);
  below_heat = split_timeline_ + split_heat_;
  splitter("##split-heatmap", false, 0, top, width, h, below_heat);
  split_heat_ = std::clamp(below_heat - split_timeline_, 0.1f, 0.85f - split_timeline_);
  splitter("##split-left", true, left, top, height - top, width, split_left_);
  splitter("##split-right", true, right, top, height - top, width, split_right_);
  split_left_ = std::min(split_left_, split_right_ - 0.1f), split_right_ = std::max(split_right_, split_left_ + 0.1f);
  if (open_dialog_) open_dialog();
}

void App::splitter(const char* id, bool vertical, float x, float y, float length, float total, float& fraction) {
  constexpr float kGrip = 6;
  ImGui::SetNextWindowPos(vertical ? ImVec2(x - kGrip / 2, y) : ImVec2(x, y - kGrip / 2));
  ImGui::SetNextWindowSize(vertical ? ImVec2(kGrip, length) : ImVec2(length, kGrip));
  ImGui::PushStyleVar(ImGuiStyleVar_WindowPadding, ImVec2(0, 0));
  ImGui::PushStyleVar(ImGuiStyleVar_WindowMinSize, ImVec2(1, 1));
  ImGui::Begin(id, nullptr,
               ImGuiWindowFlags_NoDecoration | ImGuiWindowFlags_NoMove | ImGuiWindowFlags_NoBackground |
                   ImGuiWindowFlags_NoSavedSettings);
  ImGui::InvisibleButton(id, vertical ? ImVec2(kGrip, length) : ImVec2(length, kGrip));
  if (ImGui::IsItemHovered() || ImGui::IsItemActive())
    ImGui::SetMouseCursor(vertical ? ImGuiMouseCursor_ResizeEW : ImGuiMouseCursor_ResizeNS);
  if (ImGui::IsItemActive() && total > 0) {
    const ImVec2 d = ImGui::GetIO().MouseDelta;
    fraction = std::clamp(fraction + (vertical ? d.x : d.y) / total, 0.1f, 0.9f);
  }
  ImGui::End();
  ImGui::PopStyleVar(2);
}

float App::menu_bar() {
  float height = 0;
  if (ImGui::BeginMainMenuBar()) {
    if (ImGui::BeginMenu("File")) {
      if (ImGui::MenuItem("Open...")) {
        open_dialog_ = true;  // opened by open_dialog(), outside the menu's ID scope
        open_text_.clear();
      }
      if (ImGui::MenuItem("Quit")) quit_ = true;
      ImGui::EndMenu();
    }
    if (!open_error_.empty()) ImGui::TextColored(ImVec4(0.95f, 0.45f, 0.35f, 1), "%s", analyzer::printable(open_error_).c_str());
    else ImGui::TextDisabled("drop run.db files on the window to open them");
    height = ImGui::GetWindowSize().y;
    ImGui::EndMainMenuBar();
  }
  return height;
}

void App::open_dialog() {
  if (!ImGui::IsPopupOpen("Open run.db")) ImGui::OpenPopup("Open run.db");
  ImGui::SetNextWindowSize(ImVec2(640, 0), ImGuiCond_Appearing);
  if (ImGui::BeginPopupModal("Open run.db", &open_dialog_)) {
    ImGui::TextUnformatted("run.db paths, one per line (several: the ranks of one run)");
    char buffer[8192];
    const std::size_t n = std::min(open_text_.size(), sizeof buffer - 1);
    std::copy_n(open_text_.data(), n, buffer);
    buffer[n] = 0;
    if (ImGui::InputTextMultiline("##paths", buffer, sizeof buffer, ImVec2(-1, 80))) open_text_ = buffer;
    if (!open_error_.empty()) ImGui::TextColored(ImVec4(0.95f, 0.45f, 0.35f, 1), "%s", analyzer::printable(open_error_).c_str());
    if (ImGui::Button("Open")) {
      std::vector<std::string> paths;
      std::size_t begin = 0;
      while (begin <= open_text_.size()) {
        std::size_t end = open_text_.find('\n', begin);
        if (end == std::string::npos) end = open_text_.size();
        std::string line = open_text_.substr(begin, end - begin);
        while (!line.empty() && (line.back() == ' ' || line.back() == '\r')) line.pop_back();
        if (!line.empty()) paths.push_back(line);
        begin = end + 1;
      }
      if (paths.empty()) open_error_ = "give the path of a run.db";
      else if (open(paths)) open_dialog_ = false;
    }
    ImGui::SameLine();
    if (ImGui::Button("Cancel")) open_dialog_ = false;
    if (!open_dialog_) ImGui::CloseCurrentPopup();
    ImGui::EndPopup();
  }
}

bool App::open(const std::vector<std::string>& paths) {
  std::vector<analyzer::Run> runs;
  try {
    runs = load(paths);
  } catch (const std::exception& e) {
    open_error_ = e.what();  // the same one line as the CLI's
    return false;
  }
  show(std::move(runs), paths);
  open_error_.clear();
  ++generation_;
  return true;
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
  poll_analysis(true);
  const double old_first = double(runs_[index].steps.front().row.step), old_last = double(runs_[index].steps.back().row.step);
  runs_[index] = std::move(run);
  ++whole_loads_;
  changed(index, old_first, old_last, false);  // the ranking points into the run replaced
}

void App::merge_run(std::size_t index, analyzer::RunDelta delta) {
  if (index >= runs_.size()) return;
  poll_analysis(true);
  const double old_first = double(runs_[index].steps.front().row.step), old_last = double(runs_[index].steps.back().row.step);
  const std::size_t layers = runs_[index].layers.size();
  analyzer::apply_run_delta(runs_[index], std::move(delta));
  ++merged_;
  changed(index, old_first, old_last, runs_[index].layers.size() == layers);
}

void App::changed(std::size_t index, double old_first, double old_last, bool in_background) {
  const bool at_end = view_last_ >= old_last - 0.5, whole = at_end && view_first_ <= old_first + 0.5;
  const auto now = std::chrono::steady_clock::now();
  const bool with_summaries = now - summaries_asked_ >= 10 * summaries_cost_;
  if (with_summaries) summaries_asked_ = now;
  if (in_background)
    analysis_ = std::async(std::launch::async,
                           [this, rank = rank_, with_summaries] { return analysis(rank, with_summaries); });
  else
    use_analysis(analysis(rank_, with_summaries));
  ++updates_;
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
