// svg_plot.h: axes with round ticks, decimated polylines, markers, non-finite strips,
// legends, bars and exponent histograms.
#include "svg_plot.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>

#include "ampdiag/analyzer/axis.h"
#include "markup.h"

namespace ampdiag::analyzer::svg {

namespace {

constexpr double kLeft = 64, kRight = 90, kTop = 34;
// Roughly the advance of one character of the 11 px tick font: enough to lay out legends
// and bar labels without measuring text, which SVG cannot do before it is shown.
constexpr double kCharWidth = 6.4;

std::string n(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f", v);
  return b;
}

std::string number_label(double v) {
  if (std::fabs(v) < 1e-9) v = 0;
  char b[32];
  std::snprintf(b, sizeof b, "%.6g", v);
  return b;
}

std::string power_of_two_label(double exponent) {
  return "2<tspan dy=\"-5\" font-size=\"8\">" + number_label(exponent) + "</tspan>";
}

std::vector<double> ticks(double lo, double hi, double step) {
  std::vector<double> out;
  // By index, not by `v += step`: at 1e300 a small step does not move v, and a run.db can
  // hold any value. A plot never needs more than a few dozen ticks.
  constexpr int kMaxTicks = 64;
  const double first = std::ceil(lo / step - 1e-9) * step;
  for (int i = 0; i < kMaxTicks; ++i) {
    const double v = first + i * step;
    if (!std::isfinite(v) || v > hi + step * 1e-9 || (!out.empty() && v == out.back())) break;
    out.push_back(v);
  }
  return out;
}

// Long names lose their middle, where module paths repeat themselves least usefully.
std::string shorten(const std::string& s, std::size_t max_chars) {
  if (s.size() <= max_chars) return s;
  const std::size_t head = max_chars / 3, tail = max_chars - head - 1;
  return s.substr(0, head) + "…" + s.substr(s.size() - tail);
}

struct LegendItem {
  std::string label, colour, dash;
  bool tick = false;  // a red marker tick instead of a line
};

// Flows the items left to right under a plot, wrapping at `width`; returns the SVG and
// advances `y` past it.
std::string legend(const std::vector<LegendItem>& items, double width, double& y) {
  std::string o;
  double x = kLeft;
  const double max_label = (width - kLeft - 40) / kCharWidth;
  for (const auto& item : items) {
    const std::string label = shorten(item.label, std::size_t(max_label));
    const double item_width = 24 + kCharWidth * double(label.size()) + 16;
    if (x > kLeft && x + item_width > width - 8) x = kLeft, y += 16;
    if (item.tick)
      o += "<path class=\"marker\" d=\"M" + n(x + 7) + " " + n(y - 9) + " v10\"/>";
    else
      o += "<path d=\"M" + n(x) + " " + n(y - 4) + " h18\" stroke=\"" + item.colour + "\" stroke-width=\"3\"" +
           (item.dash.empty() ? "" : " stroke-dasharray=\"" + item.dash + "\"") + "/>";
    o += "<text x=\"" + n(x + 24) + "\" y=\"" + n(y) + "\" class=\"tick\">" + escape_markup(label) + "<title>" +
         escape_markup(item.label) + "</title></text>\n";
    x += item_width;
  }
  if (!items.empty()) y += 16;
  return o;
}

std::string svg_open(double width, double height) {
  return "<svg xmlns=\"http://www.w3.org/2000/svg\" class=\"plot\" width=\"" + n(width) + "\" height=\"" + n(height) +
         "\" viewBox=\"0 0 " + n(width) + " " + n(height) + "\">\n";
}

}  // namespace

std::string line_plot(const LinePlot& p) {
  double x0 = INFINITY, x1 = -INFINITY, y0 = INFINITY, y1 = -INFINITY;
  bool any_point = false;
  for (const auto& s : p.series) {
    for (const auto& [x, y] : s.points) {
      if (!std::isfinite(x) || !std::isfinite(y)) continue;
      any_point = true;
      x0 = std::min(x0, x), x1 = std::max(x1, x), y0 = std::min(y0, y), y1 = std::max(y1, y);
    }
    for (double x : s.nonfinite_x) x0 = std::min(x0, x), x1 = std::max(x1, x);
  }
  for (double x : p.markers_x) x0 = std::min(x0, x), x1 = std::max(x1, x);
  for (double y : p.y_include) y0 = std::min(y0, y), y1 = std::max(y1, y);
  for (const auto& [y, label] : p.hlines) y0 = std::min(y0, y), y1 = std::max(y1, y);
  if (!std::isfinite(x0)) x0 = 0, x1 = 1;
  if (!std::isfinite(y0)) y0 = 0, y1 = 1;
  // One step only: centred in a one-step-wide axis, its dot off the y axis and under its tick.
  if (x1 <= x0) x0 -= 0.5, x1 = x0 + 1;
  const bool powers = p.y_axis == YAxis::kPowerOfTwo;
  const double y_step = nice_step(y1 - y0, 5, powers);
  // The axis ends on ticks, so that its first and last labels are round values too.
  y0 = std::floor(y0 / y_step + 1e-9) * y_step, y1 = std::ceil(y1 / y_step - 1e-9) * y_step;
  if (y1 <= y0) y1 = y0 + y_step;

  std::vector<std::size_t> strip_rows;  // series with a NaN/Inf, in series order
  for (std::size_t i = 0; i < p.series.size(); ++i)
    if (!p.series[i].nonfinite_x.empty()) strip_rows.push_back(i);
  const double w = p.width - kLeft - kRight, h = p.plot_height;
  const double strip_top = kTop + h + 8, row_h = 12;
  const double strip_h = strip_rows.empty() ? 0 : 8 + row_h * double(strip_rows.size());
  auto X = [&](double x) { return kLeft + (x - x0) / (x1 - x0) * w; };
  auto Y = [&](double y) { return kTop + (1.0 - (y - y0) / (y1 - y0)) * h; };

  std::string body;
  body += "<text x=\"" + n(kLeft) + "\" y=\"18\" class=\"ptitle\">" + escape_markup(p.title) + "</text>\n";
  for (double v : ticks(y0, y1, y_step)) {
    body += "<path class=\"grid\" d=\"M" + n(kLeft) + " " + n(Y(v)) + " H" + n(kLeft + w) + "\"/>";
    body += "<text x=\"" + n(kLeft - 6) + "\" y=\"" + n(Y(v) + 4) + "\" class=\"tick\" text-anchor=\"end\">" +
            (powers ? power_of_two_label(v) : number_label(v)) + "</text>\n";
  }
  body += "<path class=\"axis\" d=\"M" + n(kLeft) + " " + n(kTop) + " V" + n(kTop + h) + " H" + n(kLeft + w) + "\"/>\n";
  const double x_labels = kTop + h + strip_h + 16;
  for (double v : ticks(x0, x1, nice_step(x1 - x0, 6, true)))
    body += "<text x=\"" + n(X(v)) + "\" y=\"" + n(x_labels) + "\" class=\"tick\" text-anchor=\"middle\">" + number_label(v) +
            "</text>\n";
  body += "<text x=\"" + n(kLeft + w / 2) + "\" y=\"" + n(x_labels + 14) + "\" class=\"tick\" text-anchor=\"middle\">" +
          escape_markup(p.x_label) + "</text>\n";
  body += "<text x=\"14\" y=\"" + n(kTop + h / 2) + "\" class=\"tick\" transform=\"rotate(-90 14 " + n(kTop + h / 2) +
          ")\" text-anchor=\"middle\">" + escape_markup(p.y_label) + "</text>\n";
  for (const auto& [y, label] : p.hlines) {
    body += "<path class=\"ref\" d=\"M" + n(kLeft) + " " + n(Y(y)) + " H" + n(kLeft + w) + "\"/>\n";
    body += "<text x=\"" + n(kLeft + w + 4) + "\" y=\"" + n(Y(y) + 4) + "\" class=\"tick\">" + escape_markup(label) + "</text>\n";
  }
  // Markers: one tick per pixel column that holds any, so none is lost when they crowd.
  std::map<int, int> columns;
  for (double x : p.markers_x) columns[int(X(x))]++;
  if (!columns.empty()) {
    std::string d;
    for (const auto& [col, count] : columns) d += "M" + n(col) + " " + n(kTop - 8) + " v10 ";
    body += "<path class=\"marker\" d=\"" + d + "\"><title>" + escape_markup(p.markers_label) + "</title></path>\n";
  }
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
    // A lone point is a dot: as a line it has no length, and nothing is drawn.
    if (order.size() == 1) {
      const auto [lo, hi] = bucket[order.front()];
      body += "<circle class=\"dot\" fill=\"" + s.colour + "\" cx=\"" + n(order.front()) + "\" cy=\"" + n(Y(hi)) +
              "\" r=\"2.5\"><title>" + escape_markup(s.label) + "</title></circle>\n";
      if (lo == hi) continue;
    }
    if (!d.empty())
      body += "<path class=\"line\" stroke=\"" + s.colour + "\"" + (s.dash.empty() ? "" : " stroke-dasharray=\"" + s.dash + "\"") +
              " d=\"" + d + "\"><title>" + escape_markup(s.label) + "</title></path>\n";
  }
  if (!any_point && !p.empty_note.empty())
    body += "<text x=\"" + n(kLeft + w / 2) + "\" y=\"" + n(kTop + h / 2) + "\" class=\"note\" text-anchor=\"middle\">" +
            escape_markup(p.empty_note) + "</text>\n";
  if (!strip_rows.empty()) {
    body += "<text x=\"" + n(kLeft - 6) + "\" y=\"" + n(strip_top + strip_h / 2) + "\" class=\"tick\" text-anchor=\"end\">NaN/Inf</text>\n";
    for (std::size_t r = 0; r < strip_rows.size(); ++r) {
      const Series& s = p.series[strip_rows[r]];
      const double cy = strip_top + 4 + row_h * (double(r) + 0.5);
      std::map<int, bool> cols;
      for (double x : s.nonfinite_x) cols[int(X(x))] = true;
      std::string d;
      for (const auto& [col, unused] : cols) d += "M" + n(col - 3) + " " + n(cy - 3) + " l6 6 m-6 0 l6 -6 ";
      body += "<path class=\"lane\" d=\"M" + n(kLeft) + " " + n(cy) + " H" + n(kLeft + w) + "\" stroke=\"" + s.colour + "\"/>";
      body += "<path class=\"cross\" stroke=\"" + s.colour + "\" d=\"" + d + "\"><title>" + escape_markup(s.label) +
              ": NaN/Inf</title></path>\n";
    }
  }
  std::vector<LegendItem> items;
  for (const auto& s : p.series) items.push_back({s.label, s.colour, s.dash});
  if (!p.markers_x.empty() && !p.markers_label.empty()) items.push_back({p.markers_label, "", "", true});
  double y = x_labels + 36;
  body += legend(items, p.width, y);
  return svg_open(p.width, y) + body + "</svg>\n";
}

std::string bar_chart(const std::string& title, const std::vector<Bar>& bars, const std::string& unit) {
  const double width = 860, row = 24, top = 34;
  constexpr std::size_t kMaxLabel = 64;
  std::size_t longest = 8;
  for (const auto& b : bars) longest = std::max(longest, std::min(b.label.size(), kMaxLabel));
  const double left = std::clamp(kCharWidth * double(longest) + 16, 120.0, 440.0);
  const double unit_room = kCharWidth * double(unit.size() + 8) + 12;
  const double height = top + row * double(std::max<std::size_t>(bars.size(), 1)) + 12;
  double max = 0;
  for (const auto& b : bars) max = std::max(max, b.value);
  if (max <= 0) max = 1;
  std::string o = svg_open(width, height);
  o += "<text x=\"8\" y=\"18\" class=\"ptitle\">" + escape_markup(title) + "</text>\n";
  for (std::size_t i = 0; i < bars.size(); ++i) {
    const double y = top + row * double(i), bw = std::max(1.0, (width - left - unit_room) * bars[i].value / max);
    o += "<text x=\"" + n(left - 8) + "\" y=\"" + n(y + 15) + "\" class=\"tick\" text-anchor=\"end\">" +
         escape_markup(shorten(bars[i].label, kMaxLabel)) + "<title>" + escape_markup(bars[i].label) + "</title></text>\n";
    o += "<path class=\"bar\" d=\"M" + n(left) + " " + n(y + 3) + " h" + n(bw) + " v16 h" + n(-bw) + " z\"><title>" +
         escape_markup(bars[i].note) + "</title></path>\n";
    o += "<text x=\"" + n(left + bw + 6) + "\" y=\"" + n(y + 15) + "\" class=\"tick\">" + number_label(bars[i].value) + " " +
         escape_markup(unit) + "</text>\n";
  }
  return o + "</svg>\n";
}

std::string histogram_plot(const HistogramPlot& p) {
  const double width = 860, h = 170, w = width - kLeft - kRight;
  const int bins = p.max_exp - p.min_exp + 3;
  // Bin b covers [2^(lo), 2^(lo+1)) with lo = min_exp - 1 + b; the outer bins are drawn
  // one power of two wide.
  const double e0 = p.min_exp - 1, e1 = p.max_exp + 2;
  auto X = [&](double e) { return kLeft + (e - e0) / (e1 - e0) * w; };
  double top_share = 0;
  for (const auto& c : p.curves)
    for (double s : c.share) top_share = std::max(top_share, s);
  const double y_step = nice_step(std::max(top_share, 0.01), 4, false);
  const double y1 = std::ceil(std::max(top_share, 0.01) / y_step - 1e-9) * y_step;
  auto Y = [&](double s) { return kTop + (1.0 - s / y1) * h; };

  std::string body = "<text x=\"" + n(kLeft) + "\" y=\"18\" class=\"ptitle\">" + escape_markup(p.title) + "</text>\n";
  for (const auto& b : p.bands) {
    const double a = X(std::max(b.from_exp, e0)), z = X(std::min(b.to_exp, e1));
    if (z <= a) continue;
    body += "<path class=\"band\" fill=\"" + b.colour + "\" d=\"M" + n(a) + " " + n(kTop) + " H" + n(z) + " V" + n(kTop + h) +
            " H" + n(a) + " z\"><title>" + escape_markup(b.label) + "</title></path>";
    body += "<text x=\"" + n((a + z) / 2) + "\" y=\"" + n(kTop + 12) + "\" class=\"tick\" text-anchor=\"middle\">" +
            escape_markup(b.label) + "</text>\n";
  }
  for (double v : ticks(0, y1, y_step)) {
    body += "<path class=\"grid\" d=\"M" + n(kLeft) + " " + n(Y(v)) + " H" + n(kLeft + w) + "\"/>";
    body += "<text x=\"" + n(kLeft - 6) + "\" y=\"" + n(Y(v) + 4) + "\" class=\"tick\" text-anchor=\"end\">" +
            number_label(std::round(v * 1000) / 10) + "%</text>\n";
  }
  body += "<path class=\"axis\" d=\"M" + n(kLeft) + " " + n(kTop) + " V" + n(kTop + h) + " H" + n(kLeft + w) + "\"/>\n";
  for (int e = int(std::ceil(e0 / 8.0)) * 8; e <= e1; e += 8)
    body += "<text x=\"" + n(X(e)) + "\" y=\"" + n(kTop + h + 16) + "\" class=\"tick\" text-anchor=\"middle\">" +
            power_of_two_label(e) + "</text>\n";
  body += "<text x=\"" + n(kLeft + w / 2) + "\" y=\"" + n(kTop + h + 30) +
          "\" class=\"tick\" text-anchor=\"middle\">|gradient| as the scaler left it (before unscale)</text>\n";
  body += "<text x=\"14\" y=\"" + n(kTop + h / 2) + "\" class=\"tick\" transform=\"rotate(-90 14 " + n(kTop + h / 2) +
          ")\" text-anchor=\"middle\">share of values</text>\n";
  std::vector<LegendItem> items;
  for (const auto& c : p.curves) {
    // A step line: up or down at each bin edge, across the bin at its share.
    std::string d = "M" + n(X(e0)) + " " + n(Y(0));
    for (int b = 0; b < bins && b < int(c.share.size()); ++b)
      d += " V" + n(Y(c.share[std::size_t(b)])) + " H" + n(X(e0 + b + 1));
    d += " V" + n(Y(0));
    body += "<path class=\"line\" stroke=\"" + c.colour + "\" d=\"" + d + "\"><title>" + escape_markup(c.label) +
            "</title></path>\n";
    items.push_back({c.label, c.colour, ""});
  }
  double y = kTop + h + 56;
  body += legend(items, width, y);
  return svg_open(width, y) + body + "</svg>\n";
}

}  // namespace ampdiag::analyzer::svg
