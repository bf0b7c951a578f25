// Small SVG plots for the HTML report: line plots, bar charts, exponent histograms. Lines
// are decimated to exact min/max per pixel column, so a single spike never disappears;
// markers and non-finite crosses are never dropped. Axes tick at round values, legends
// sit under the plot with the full names.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace ampdiag::analyzer::svg {

struct Series {
  std::string label;
  std::string colour;
  std::string dash;  // an SVG stroke-dasharray; empty for a solid line
  std::vector<std::pair<double, double>> points;  // (x, y), x ascending
  // x where the series was NaN/Inf: crosses in the series' own row of a strip under the
  // plot, so that which series went non-finite, and when, stays readable.
  std::vector<double> nonfinite_x;
};

enum class YAxis {
  kLinear,
  kPowerOfTwo,  // y holds log2(v): ticks at integers, labelled 2^k
};

struct LinePlot {
  std::string title, x_label, y_label;
  double width = 860, plot_height = 190;
  YAxis y_axis = YAxis::kLinear;
  std::vector<double> y_include;  // values the y axis must show whatever the data
  std::vector<Series> series;
  std::vector<double> markers_x;  // red ticks along the top (e.g. skipped steps)
  std::string markers_label;
  std::vector<std::pair<double, std::string>> hlines;  // dashed reference lines (y, label)
  std::string empty_note;  // written across the plot when no series has a finite point
};

std::string line_plot(const LinePlot& p);

struct Bar {
  std::string label;
  double value;
  std::string note;
};

std::string bar_chart(const std::string& title, const std::vector<Bar>& bars, const std::string& unit);

// Shares of values per power of two, one step line per series, over shaded ranges.
struct HistogramPlot {
  std::string title;
  int min_exp = 0;  // bins: below 2^min_exp, one per exponent min_exp..max_exp, from 2^(max_exp+1)
  int max_exp = 0;
  struct Curve {
    std::string label, colour;
    std::vector<double> share;  // per bin, summing to 1
  };
  std::vector<Curve> curves;
  struct Band {
    double from_exp, to_exp;  // in powers of two
    std::string label, colour;
  };
  std::vector<Band> bands;
};

std::string histogram_plot(const HistogramPlot& p);

}  // namespace ampdiag::analyzer::svg
