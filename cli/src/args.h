// A small command-line parser: named options (with or without a value) and positionals.
// Errors are UsageError, which the CLI turns into one line on stderr and exit code 2.
#pragma once

#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace ampdiag::cli {

class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Args {
 public:
  // `with_value`: options that take a value; `flags`: options that do not. Both include
  // the leading dashes, e.g. "--format", "-o", "--csv". "--help"/"-h" is always a flag.
  Args(int argc, char** argv, const std::vector<std::string>& with_value, const std::vector<std::string>& flags);

  bool help() const { return flag("--help"); }
  bool flag(const std::string& name) const { return flags_.count(name) != 0; }
  std::string value(const std::string& name, const std::string& fallback = "") const;
  bool has(const std::string& name) const { return values_.count(name) != 0; }
  double number(const std::string& name, double fallback, double min, double max) const;
  long long integer(const std::string& name, long long fallback, long long min, long long max) const;
  std::string choice(const std::string& name, const std::string& fallback, const std::vector<std::string>& allowed) const;
  const std::vector<std::string>& positionals() const { return positionals_; }

 private:
  std::map<std::string, std::string> values_;
  std::map<std::string, bool> flags_;
  std::vector<std::string> positionals_;
};

}  // namespace ampdiag::cli
