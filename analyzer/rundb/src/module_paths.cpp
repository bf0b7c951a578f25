#include "ampdiag/rundb/module_paths.h"

namespace ampdiag::rundb {

std::string common_module(const std::string& a, const std::string& b) {
  std::size_t end = 0;  // length of the common prefix made of whole components
  for (std::size_t i = 0;; ++i) {
    const bool a_end = i == a.size() || a[i] == '.', b_end = i == b.size() || b[i] == '.';
    if (a_end && b_end) end = i;
    if (i == a.size() || i == b.size() || a[i] != b[i]) break;
  }
  return a.substr(0, end);
}

bool within(const std::string& path, const std::string& outer) {
  return path == outer ||
         (path.size() > outer.size() && path.compare(0, outer.size(), outer) == 0 && path[outer.size()] == '.');
}

std::string parent_of(const std::string& path) {
  const auto dot = path.rfind('.');
  return dot == std::string::npos ? std::string() : path.substr(0, dot);
}

}  // namespace ampdiag::rundb
