// Args: see args.h.
#include "args.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>

namespace ampdiag::cli {

Args::Args(int argc, char** argv, const std::vector<std::string>& with_value, const std::vector<std::string>& flags) {
  auto known = [](const std::vector<std::string>& list, const std::string& a) {
    return std::find(list.begin(), list.end(), a) != list.end();
  };
  for (int i = 0; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      flags_["--help"] = true;
      continue;
    }
    if (a.size() > 1 && a[0] == '-') {
      std::string value;
      const auto eq = a.find('=');
      const bool inline_value = a.rfind("--", 0) == 0 && eq != std::string::npos;
      if (inline_value) {
        value = a.substr(eq + 1);
        a = a.substr(0, eq);
      }
      if (known(with_value, a)) {
        if (!inline_value) {
          if (i + 1 >= argc) throw UsageError(a + " needs a value");
          value = argv[++i];
        }
        values_[a] = value;
      } else if (known(flags, a) && !inline_value) {
        flags_[a] = true;
      } else {
        throw UsageError("unknown option '" + a + "' (see --help)");
      }
    } else {
      positionals_.push_back(a);
    }
  }
}

std::string Args::value(const std::string& name, const std::string& fallback) const {
  const auto it = values_.find(name);
  return it == values_.end() ? fallback : it->second;
}

double Args::number(const std::string& name, double fallback, double min, double max) const {
  if (!has(name)) return fallback;
  const std::string text = value(name);
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0' || errno != 0 || !std::isfinite(v) || v < min || v > max)
    throw UsageError(name + " takes a number between " + std::to_string(min) + " and " + std::to_string(max) + ", not '" +
                     text + "'");
  return v;
}

long long Args::integer(const std::string& name, long long fallback, long long min, long long max) const {
  if (!has(name)) return fallback;
  const std::string text = value(name);
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || errno != 0 || v < min || v > max)
    throw UsageError(name + " takes an integer between " + std::to_string(min) + " and " + std::to_string(max) +
                     ", not '" + text + "'");
  return v;
}

std::string Args::choice(const std::string& name, const std::string& fallback, const std::vector<std::string>& allowed) const {
  const std::string v = value(name, fallback);
  if (std::find(allowed.begin(), allowed.end(), v) != allowed.end()) return v;
  std::string list;
  for (const auto& a : allowed) list += (list.empty() ? "" : ", ") + a;
  throw UsageError(name + " must be one of " + list + ", not '" + v + "'");
}

}  // namespace ampdiag::cli
