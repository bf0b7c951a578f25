// The heatmap's and layer detail's level of detail: per pixel column, the numbers of every
// sample in it, whatever the zoom; and the column walk agrees with column_of everywhere.
#include <catch2/catch.hpp>

#include <cmath>
#include <random>

#include "heatmap.h"
#include "timeline.h"

using namespace ampdiag;

namespace {

analyzer::LayerSummary layer_of(std::int64_t steps) {
  analyzer::LayerSummary layer;
  for (std::int64_t s = 0; s < steps; ++s)
    layer.samples.push_back({std::int32_t(s), float(1 + s % 7), 1.0f, std::uint16_t(s % 3 == 0 ? 6553 : 0), 0, 0});
  return layer;
}

}  // namespace

TEST_CASE("the column walk gives column_of's column for every step at any zoom", "[gui]") {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const std::int64_t first = rng() % 1000, last = first + rng() % 200000;
    const int width = 1 + int(rng() % 2000);
    gui::ColumnWalker walk(first, last, width);
    for (std::int64_t s = first; s <= last; s += 1 + std::int64_t(rng() % 7)) {
      INFO("first " << first << " last " << last << " width " << width << " step " << s);
      REQUIRE(walk.column(s) == gui::column_of(s, first, last, width));
    }
  }
}

TEST_CASE("a zoomed-out heatmap column keeps its largest and smallest abs-max and its most underflow", "[gui]") {
  auto layer = layer_of(100000);
  layer.samples[50123].absmax = 60000.0f;  // one sample near the fp16 maximum
  layer.samples[50124].absmax = 1e-6f;
  layer.samples[50125].zero_q = 65000;     // mostly zero
  layer.samples[70000].nonfinite = 1;
  const auto cells = gui::heatmap_row(layer, 65504.0, 0, 99999, 1000);
  const auto& c = cells[std::size_t(gui::column_of(50123, 0, 99999, 1000))];
  CHECK(c.largest_absmax == 60000.0f);
  CHECK(c.smallest_absmax == 1e-6f);
  CHECK(c.least_headroom == Approx(std::log2(65504.0 / 60000.0)));
  CHECK(c.most_underflow == Approx(65000.0 / 65535.0));
  CHECK(cells[std::size_t(gui::column_of(70000, 0, 99999, 1000))].nonfinite);
  int nonfinite = 0;
  for (const auto& cell : cells) nonfinite += cell.nonfinite ? 1 : 0;
  CHECK(nonfinite == 1);
}

TEST_CASE("a zoomed-in heatmap fills only the columns that hold a step", "[gui]") {
  const auto layer = layer_of(100);
  const auto cells = gui::heatmap_row(layer, 65504.0, 10, 19, 100);  // 10 steps over 100 px
  int filled = 0;
  for (const auto& cell : cells) filled += cell.any ? 1 : 0;
  CHECK(filled == 10);
  CHECK(cells[std::size_t(gui::column_of(12, 10, 19, 100))].largest_absmax == float(1 + 12 % 7));
}

TEST_CASE("an all-zero sample is not underflow and a column of them has no underflow share", "[gui]") {
  analyzer::LayerSummary layer;
  layer.samples.push_back({0, 0.0f, 0.0f, 65535, 0, 0});
  const auto cells = gui::heatmap_row(layer, 65504.0, 0, 0, 10);
  REQUIRE(cells[std::size_t(gui::column_of(0, 0, 0, 10))].any);
  CHECK(cells[std::size_t(gui::column_of(0, 0, 0, 10))].most_underflow < 0);
  CHECK(std::isinf(cells[std::size_t(gui::column_of(0, 0, 0, 10))].least_headroom));
}
