// What the GUI shows, drawn with Dear ImGui each frame: the loss-scale timeline, the
// analyzer's findings and its ranking of layers. Everything comes from the analyzer (the
// same Run model, rules and findings as `ampdiag report`), so the two never disagree.
#pragma once

#include <string>
#include <vector>

#include "ampdiag/analyzer/findings.h"
#include "ampdiag/analyzer/layer_table.h"
#include "ampdiag/analyzer/run.h"

namespace ampdiag::gui {

// Where the timeline's plot area was drawn in the last frame (screen pixels), for tests
// and screenshots: a step's x is step_to_x() from x0.
struct PlotGeometry {
  float x0 = 0, y0 = 0, x1 = 0, y1 = 0;
  long long first = 0, last = 0;
};

class App {
 public:
  explicit App(std::vector<analyzer::Run> runs);
  // Lays out and draws one frame into a window of the given size.
  void frame(float width, float height);
  const PlotGeometry& timeline_geometry() const { return geometry_; }

 private:
  void timeline(float x, float y, float w, float h);
  void findings(float x, float y, float w, float h);
  void layers(float x, float y, float w, float h);

  std::vector<analyzer::Run> runs_;
  analyzer::Report report_;
  std::vector<analyzer::LayerRowSummary> ranked_;
  PlotGeometry geometry_;
};

}  // namespace ampdiag::gui
