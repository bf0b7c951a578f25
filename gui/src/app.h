// What the GUI shows, drawn with Dear ImGui each frame: the loss-scale timeline, the
// analyzer's findings and its ranking of layers. Everything comes from the analyzer (the
// same Run model, rules and findings as `ampdiag report`), so the two never disagree.
#pragma once

#include <chrono>
#include <future>
#include <optional>
#include <memory>
#include <string>

#include <imgui.h>
#include <vector>

#include "ampdiag/analyzer/findings.h"
#include "ampdiag/analyzer/layer_table.h"
#include "ampdiag/analyzer/run.h"
#include "ampdiag/analyzer/run_delta.h"

namespace ampdiag::gui {

class RgbaTexture;

// Where a plot area was drawn in the last frame (screen pixels), for tests and
// screenshots: a step's x is step_to_x() from x0; heatmap rows are row_height tall.
struct PlotGeometry {
  float x0 = 0, y0 = 0, x1 = 0, y1 = 0;
  long long first = 0, last = 0;
  float row_height = 0;
};

class App {
 public:
  // Loads the run files (several: the ranks of one run); throws their one-line error.
  explicit App(const std::vector<std::string>& paths);
  ~App();
  // Lays out and draws one frame into a window of the given size.
  void frame(float width, float height);
  // Shows other run files instead (File > Open, a drop on the window). A file that cannot
  // be read leaves the runs shown as they are and its one-line error in open_error(),
  // which the window shows; returns whether the files were opened.
  bool open(const std::vector<std::string>& paths);
  const std::string& open_error() const { return open_error_; }
  const std::vector<std::string>& paths() const { return paths_; }
  int generation() const { return generation_; }  // one more after each open()
  bool quit_requested() const { return quit_; }
  const PlotGeometry& timeline_geometry() const { return geometry_; }
  const PlotGeometry& heatmap_geometry() const { return heat_geometry_; }
  // The heat map's title: what its colours measure, against the shown run's dtype.
  std::string heatmap_title() const;
  const PlotGeometry& detail_geometry() const { return detail_geometry_; }
  // The selected step's exponent histogram in the layer detail (first = last = the step,
  // row_height unused); x1 == x0 when none is drawn.
  const PlotGeometry& histogram_geometry() const { return histogram_geometry_; }
  // Selects a layer by name (false: no such layer) and optionally a step (-1: none).
  bool select(const std::string& layer, long long step);
  std::string selected_layer() const;
  // Live mode: swap in a newer load of run `index`, or merge in what its file gained since
  // (run_delta.h); the rules run again on it.
  void replace_run(std::size_t index, analyzer::Run run);
  void merge_run(std::size_t index, analyzer::RunDelta delta);
  // Where the reads of run `index` went in its file (what a follower reads on from).
  const analyzer::RunCursor& cursor(std::size_t index) const { return runs_.at(index).cursor; }
  // After a merge the rules and the ranking run on a background thread (on a 50 M-row run
  // they take about a second; the panels keep drawing the run meanwhile). While they run
  // nothing may change the runs: merges wait (busy()). poll_analysis() takes a finished one
  // in (frame() calls it); with `wait`, once it is finished.
  bool busy() const { return analysis_.valid(); }
  void poll_analysis(bool wait = false);
  int merged_updates() const { return merged_; }  // live reads merged in
  int whole_loads() const { return whole_loads_; }  // live reads that loaded a file whole
  const std::vector<std::string>& whatif() const { return whatif_; }
  // The Layers panel's columns: the share of updates that rounded away only for a run
  // that measured them (half-precision parameters).
  std::vector<const char*> layer_columns() const;
  bool following() const { return follow_; }
  void set_following(bool on) { follow_ = on; }
  void set_show_loss(bool on) { show_loss_ = on; }
  // The heatmap's colour: the share of zeros and fp16 subnormals instead of headroom.
  void set_heat_underflow(bool on) { heat_underflow_ = on; }
  void set_follow_error(std::string error) { follow_error_ = std::move(error); }
  // With several rank files: show this rank (false: no file of that rank).
  bool show_rank(long long rank);
  long long shown_rank() const { return run().rank; }
  const analyzer::Run& shown_run() const { return run(); }
  // Shows steps first..last in the timeline and heatmap (clamped to the run), as zooming
  // and panning do; the steps shown now.
  void set_view(double first, double last);
  double view_first() const { return view_first_; }
  double view_last() const { return view_last_; }
  // The heatmap's top row (the analyzer's first-ranked layer).
  std::string top_layer() const;

 private:
  const analyzer::Run& run() const { return runs_[rank_]; }
  static std::vector<analyzer::Run> load(const std::vector<std::string>& paths);
  void show(std::vector<analyzer::Run> runs, const std::vector<std::string>& paths);
  void rerank();
  // Shows a ranking of run rank_ made with report_ (keeps the selected layer).
  void use_ranking(std::vector<analyzer::LayerRowSummary> ranked);
  // After run `index` changed (its steps were first..last before): the rules again, and the
  // view sticks to the newest step.
  // `in_background`: the rules may run on a thread (the run's layers did not move).
  void changed(std::size_t index, double old_first, double old_last, bool in_background);
  struct Analysis {
    analyzer::Report report;
    std::vector<analyzer::LayerRowSummary> ranked;
    std::size_t rank = 0;  // the run ranked
    // The summaries that cost more than the rules (the what-if replays the scaler over a
    // grid of settings; the FP8 overview reads every histogram from the files again),
    // when computed this time, and what they cost.
    struct Summaries {
      std::vector<std::string> whatif;
      std::vector<analyzer::Fp8Overview> fp8;
      std::chrono::steady_clock::duration cost{};
    };
    std::optional<Summaries> summaries;
  };
  // The rules and ranking of the runs as they are now; the summaries too when asked.
  Analysis analysis(std::size_t rank, bool with_summaries) const;
  // Takes an analysis of the runs shown (the window's thread).
  void use_analysis(Analysis a);
  std::future<Analysis> analysis_;
  void timeline(float x, float y, float w, float h);
  void heatmap(float x, float y, float w, float h);
  // Mouse wheel zooms around the cursor, dragging pans, a double click shows every step.
  void navigate(const ImVec2& p0, const ImVec2& p1);
  void findings(float x, float y, float w, float h);
  void layers(float x, float y, float w, float h);
  void detail(float x, float y, float w, float h);
  void step_cursor(ImDrawList* draw, const ImVec2& p0, const ImVec2& p1, long long first, long long last);
  float menu_bar();  // returns its height
  void open_dialog();
  // A bar between two panels that drags `fraction` (of `total` pixels) along its axis.
  void splitter(const char* id, bool vertical, float x, float y, float length, float total, float& fraction);

  std::vector<analyzer::Run> runs_;
  analyzer::Report report_;
  std::vector<analyzer::Fp8Overview> fp8_;  // per run
  std::vector<std::string> whatif_;         // the first run's what-if in brief
  // When the summaries were last asked for, and what they cost then: while following, they
  // are computed again once ten times that has passed (a tenth of the time at most).
  std::chrono::steady_clock::time_point summaries_asked_;
  std::chrono::steady_clock::duration summaries_cost_{};
  bool whatif_open_ = false;                // open it at first: the run skipped steps
  std::vector<analyzer::LayerRowSummary> ranked_;
  PlotGeometry geometry_, heat_geometry_, detail_geometry_, histogram_geometry_;
  // The exponent histogram of one layer at one step, read from the file when first shown.
  struct StepHistogram {
    std::string path;
    long long step = -1;
    std::int64_t layer = -1;
    std::vector<std::uint32_t> counts;  // empty: see note
    std::string note;                   // why there is none
  };
  StepHistogram step_histogram_;
  const StepHistogram& step_histogram(std::int64_t layer, long long step);
  void histogram_plot(ImDrawList* draw, const ImVec2& p0, const ImVec2& p1, std::int64_t layer, long long step);
  int selected_ = 0;            // index into ranked_
  long long selected_step_ = -1;  // a step the user picked (a finding's, a click); -1: none
  double view_first_ = 0, view_last_ = 0;  // the visible steps, shared by both plots
  int row_offset_ = 0;                     // the heatmap's first visible row
  bool follow_ = false, stick_to_newest_ = true;
  std::size_t rank_ = 0;        // which of runs_ the heatmap, detail and layers show
  bool overlay_ranks_ = true;   // the timeline draws every rank's scale
  bool show_loss_ = false;      // the loss on its own axis in the timeline
  std::vector<long long> disagreeing_;  // ranks a rank-disagreement finding names
  int updates_ = 0, merged_ = 0, whole_loads_ = 0;  // live reads: all, merged in, loaded whole
  std::vector<std::string> paths_;  // the files shown, as given
  std::string open_error_;
  int generation_ = 0;
  bool quit_ = false, open_dialog_ = false;
  std::string open_text_;  // the Open dialog's paths, one per line
  // The panels' sizes, as shares of the window (the splitters drag them).
  float split_timeline_ = 0.34f, split_heat_ = 0.30f, split_left_ = 1.0f / 3, split_right_ = 2.0f / 3;
  bool heat_underflow_ = false;          // the heatmap's colour: underflow share, not headroom
  std::vector<ImU32> heat_pixels_;       // the heatmap's cells, painted each frame
  std::unique_ptr<RgbaTexture> heat_texture_;
  std::string follow_error_;
};

}  // namespace ampdiag::gui
