// svg_plot.h: decimated polylines, markers, axes, bars.
#include "svg_plot.h"

#include "markup.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>

namespace ampdiag::analyzer::svg {

namespace {

constexpr double kLeft = 64, kRight = 150, kTop = 34, kBottom = 36;

std::string n(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f", v);
  return b;
}

std::string g(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%g", v);
  return b;
}

}  // namespace

std::string line_plot(const LinePlot& p) {
  double x0 = INFINITY, x1 = -INFINITY, y0 = INFINITY, y1 = -INFINITY;
  for (const auto& s : p.series)
    for (const auto& [x, y] : s.points) {
      if (!std::isfinite(x) || !std::isfinite(y)) continue;
      x0 = std::min(x0, x), x1 = std::max(x1, x), y0 = std::min(y0, y), y1 = std::max(y1, y);
    }
  for (double x : p.markers_x) x0 = std::min(x0, x), x1 = std::max(x1, x);
  for (const auto& [y, label] : p.hlines) y0 = std::min(y0, y), y1 = std::max(y1, y);
  for (const auto& [x, y] : p.crosses) x0 = std::min(x0, x), x1 = std::max(x1, x), y0 = std::min(y0, y), y1 = std::max(y1, y);
  if (!std::isfinite(x0)) x0 = 0, x1 = 1;
  if (!std::isfinite(y0)) y0 = 0, y1 = 1;
  if (x1 <= x0) x1 = x0 + 1;
  if (y1 <= y0) y1 = y0 + 1;
  const double pad = (y1 - y0) * 0.08;
  y0 -= pad, y1 += pad;
  const double w = p.width - kLeft - kRight, h = p.height - kTop - kBottom;
  auto X = [&](double x) { return kLeft + (x - x0) / (x1 - x0) * w; };
  auto Y = [&](double y) { return kTop + (1.0 - (y - y0) / (y1 - y0)) * h; };

  std::string o = "<svg xmlns=\"http://www.w3.org/2000/svg\" class=\"plot\" width=\"" + n(p.width) + "\" height=\"" +
                  n(p.height) + "\" viewBox=\"0 0 " + n(p.width) + " " + n(p.height) + "\">\n";
  o += "<text x=\"" + n(kLeft) + "\" y=\"18\" class=\"ptitle\">" + escape_markup(p.title) + "</text>\n";
  o += "<path class=\"axis\" d=\"M" + n(kLeft) + " " + n(kTop) + " V" + n(kTop + h) + " H" + n(kLeft + w) + "\"/>\n";
  for (int i = 0; i <= 4; ++i) {
    const double yv = y0 + (y1 - y0) * i / 4.0, xv = x0 + (x1 - x0) * i / 4.0;
    o += "<text x=\"" + n(kLeft - 6) + "\" y=\"" + n(Y(yv) + 4) + "\" class=\"tick\" text-anchor=\"end\">" + g(std::round(yv * 10) / 10) + "</text>\n";
    o += "<text x=\"" + n(X(xv)) + "\" y=\"" + n(kTop + h + 16) + "\" class=\"tick\" text-anchor=\"middle\">" + g(std::round(xv)) + "</text>\n";
  }
  o += "<text x=\"" + n(kLeft + w / 2) + "\" y=\"" + n(p.height - 4) + "\" class=\"tick\" text-anchor=\"middle\">" + escape_markup(p.x_label) + "</text>\n";
  o += "<text x=\"14\" y=\"" + n(kTop + h / 2) + "\" class=\"tick\" transform=\"rotate(-90 14 " + n(kTop + h / 2) + ")\" text-anchor=\"middle\">" + escape_markup(p.y_label) + "</text>\n";
  for (const auto& [y, label] : p.hlines) {
    o += "<path class=\"ref\" d=\"M" + n(kLeft) + " " + n(Y(y)) + " H" + n(kLeft + w) + "\"/>\n";
    o += "<text x=\"" + n(kLeft + w + 4) + "\" y=\"" + n(Y(y) + 4) + "\" class=\"tick\">" + escape_markup(label) + "</text>\n";
  }
  // Markers: one tick per pixel column that holds any, so none is lost when they crowd.
  std::map<int, int> columns;
  for (double x : p.markers_x) columns[int(X(x))]++;
  if (!columns.empty()) {
    std::string d;
    for (const auto& [col, count] : columns) d += "M" + n(col) + " " + n(kTop - 8) + " v10 ";
    o += "<path class=\"marker\" d=\"" + d + "\"><title>" + escape_markup(p.markers_label) + "</title></path>\n";
  }
  int legend = 0;
  for (const auto& s : p.series) {
    // Exact min/max per pixel column, drawn as a vertical stroke plus the connecting line.
    std::map<int, std::pair<double, double>> bucket;
    std::vector<int> order;
    for (const auto& [x, y] : s.points) {
      if (!std::isfinite(y)) continue;
      const int col = int(X(x));
      auto it = bucket.find(col);
      if (it == bucket.end()) {
        bucket[col] = {y, y};
        order.push_back(col);
      } else {
        it->second.first = std::min(it->second.first, y);
        it->second.second = std::max(it->second.second, y);
      }
    }
    std::string d;
    for (std::size_t i = 0; i < order.size(); ++i) {
      const auto [lo, hi] = bucket[order[i]];
      d += (i ? "L" : "M") + n(order[i]) + " " + n(Y(hi));
      if (lo != hi) d += "L" + n(order[i]) + " " + n(Y(lo));
    }
    if (!d.empty())
      o += "<path class=\"line\" stroke=\"" + s.colour + "\" d=\"" + d + "\"><title>" + escape_markup(s.label) + "</title></path>\n";
    o += "<path d=\"M" + n(kLeft + w + 8) + " " + n(kTop + 10 + legend * 16) + " h14\" stroke=\"" + s.colour +
         "\" stroke-width=\"3\"/><text x=\"" + n(kLeft + w + 26) + "\" y=\"" + n(kTop + 14 + legend * 16) +
         "\" class=\"tick\">" + escape_markup(s.label.size() > 20 ? "…" + s.label.substr(s.label.size() - 19) : s.label) + "</text>\n";
    ++legend;
  }
  if (!p.crosses.empty()) {
    std::map<int, double> cols;
    for (const auto& [x, y] : p.crosses) cols[int(X(x))] = y;
    std::string d;
    for (const auto& [col, y] : cols) d += "M" + n(col - 3) + " " + n(Y(y) - 3) + " l6 6 m-6 0 l6 -6 ";
    o += "<path class=\"cross\" d=\"" + d + "\"><title>non-finite gradient</title></path>\n";
  }
  return o + "</svg>\n";
}

std::string bar_chart(const std::string& title, const std::vector<Bar>& bars, const std::string& unit) {
  const double width = 860, row = 24, left = 300, top = 34;
  const double height = top + row * double(std::max<std::size_t>(bars.size(), 1)) + 12;
  double max = 0;
  for (const auto& b : bars) max = std::max(max, b.value);
  if (max <= 0) max = 1;
  std::string o = "<svg xmlns=\"http://www.w3.org/2000/svg\" class=\"plot\" width=\"" + n(width) + "\" height=\"" + n(height) +
                  "\" viewBox=\"0 0 " + n(width) + " " + n(height) + "\">\n";
  o += "<text x=\"8\" y=\"18\" class=\"ptitle\">" + escape_markup(title) + "</text>\n";
  for (std::size_t i = 0; i < bars.size(); ++i) {
    const double y = top + row * double(i), bw = (width - left - 240) * bars[i].value / max;
    o += "<text x=\"" + n(left - 8) + "\" y=\"" + n(y + 15) + "\" class=\"tick\" text-anchor=\"end\">" + escape_markup(bars[i].label) + "</text>\n";
    o += "<path class=\"bar\" d=\"M" + n(left) + " " + n(y + 3) + " h" + n(std::max(bw, 1.0)) + " v16 h" + n(-std::max(bw, 1.0)) +
         " z\"><title>" + escape_markup(bars[i].note) + "</title></path>\n";
    o += "<text x=\"" + n(left + std::max(bw, 1.0) + 6) + "\" y=\"" + n(y + 15) + "\" class=\"tick\">" + g(bars[i].value) + " " +
         escape_markup(unit) + "</text>\n";
  }
  return o + "</svg>\n";
}

}  // namespace ampdiag::analyzer::svg
