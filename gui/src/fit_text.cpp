#include "fit_text.h"

namespace ampdiag::gui {

std::string fit_end(const std::string& text, float width, const std::function<float(const std::string&)>& measure) {
  if (measure(text) <= width) return text;
  static const std::string kCut = "...";
  if (measure(kCut) > width) return "";
  // The smallest start from which "..." and the rest fit (a later start is shorter): the
  // names are measured a row per frame, so a search, not a walk.
  std::size_t fits = text.size(), lo = 1;
  while (lo < fits) {
    const std::size_t mid = lo + (fits - lo) / 2;
    if (measure(kCut + text.substr(mid)) <= width) fits = mid;
    else lo = mid + 1;
  }
  return kCut + text.substr(fits);
}

}  // namespace ampdiag::gui
