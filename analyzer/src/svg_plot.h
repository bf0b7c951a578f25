// Small SVG line/bar plots for the HTML report. Lines are decimated to exact min/max per
// pixel column, so a single spike never disappears; markers are never dropped.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace ampdiag::analyzer::svg {

struct Series {
  std::string label;
  std::string colour;
  std::vector<std::pair<double, double>> points;  // (x, y), x ascending
};

struct LinePlot {
  std::string title, x_label, y_label;
  double width = 860, height = 260;
  std::vector<Series> series;
  std::vector<double> markers_x;              // red ticks along the top (e.g. skipped steps)
  std::string markers_label;
  std::vector<std::pair<double, std::string>> hlines;  // dashed reference lines (y, label)
  std::vector<std::pair<double, double>> crosses;      // red crosses (x, y): overflow samples
};

std::string line_plot(const LinePlot& p);

struct Bar {
  std::string label;
  double value;
  std::string note;
};

std::string bar_chart(const std::string& title, const std::vector<Bar>& bars, const std::string& unit);

}  // namespace ampdiag::analyzer::svg
