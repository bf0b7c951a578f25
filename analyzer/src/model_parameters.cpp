#include "model_parameters.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "rules.h"

namespace ampdiag::analyzer::model_parameters {

using rules::three_digits;

namespace {

constexpr const char* kSeveral = "|x| up to ";
constexpr const char* kReader = ", read by ";

std::optional<Read> parse_one(const std::string& part) {
  const auto colon = part.find(": ");
  const auto reader = part.rfind(kReader);
  if (colon == std::string::npos || colon == 0 || reader == std::string::npos || reader < colon) return std::nullopt;
  Read r;
  r.name = part.substr(0, colon);
  r.reader = part.substr(reader + std::string(kReader).size());
  std::string value = part.substr(colon + 2, reader - colon - 2);
  r.one_value = value.rfind(kSeveral, 0) != 0;
  if (!r.one_value) value.erase(0, std::string(kSeveral).size());
  char* end = nullptr;
  r.value = std::strtod(value.c_str(), &end);
  if (end == value.c_str() || r.reader.empty()) return std::nullopt;
  return r;
}

}  // namespace

std::vector<Read> parse(const std::string& detail) {
  std::vector<Read> reads;
  std::size_t start = 0;
  while (start <= detail.size()) {
    auto end = detail.find("; ", start);
    if (end == std::string::npos) end = detail.size();
    if (auto r = parse_one(detail.substr(start, end - start))) reads.push_back(*r);
    start = end + 2;
  }
  return reads;
}

namespace {

// CLIP's bound on its learnt temperature: at most ln(100), a scale of 100.
constexpr double kClipBound = 100.0;

// The clamp of `name` before its exp(), in the model's forward() (or, where that is not the
// user's to edit, a Hugging Face model's, after each optimizer step, as OpenCLIP does).
Suggestion clamp_before_exp(const std::string& name) {
  Suggestion s;
  s.python = "# in the model's forward(), where it takes " + name + ".exp():\nscale = self." + name +
             ".clamp(max=math.log(100)).exp()\n# or, where the forward() is not yours to edit, after each "
             "optimizer step:\nwith torch.no_grad():\n    model." + name + ".clamp_(max=math.log(100))";
  s.cpp = "// in the model's forward(), where it takes " + name + ".exp():\nauto scale = " + name +
          ".clamp_max(std::log(100.0)).exp();";
  s.untried = true;
  return s;
}

}  // namespace

std::optional<Suggestion> exp_bound(const Run& run, const std::string& detail) {
  for (const Read& r : parse(detail)) {
    // Several values give only their largest |x|: a large negative one's exp() is tiny.
    if (!r.one_value || r.reader != "Exp" || !(std::exp(r.value) > run.fp_max)) continue;
    const std::string half = run.fp_max > 1e6 ? "bfloat16" : "fp16";
    char largest[32];
    std::snprintf(largest, sizeof largest, "%.6g", run.fp_max);
    Suggestion s = clamp_before_exp(r.name);
    s.summary = "Bound " + r.name + " before its exp(): at " + three_digits(r.value) + ", exp() gives " +
                three_digits(std::exp(r.value)) + ", beyond " + half + "'s largest value (" + largest +
                ") before it scales anything. Clamp it in the model's forward() (CLIP clamps its temperature at "
                "ln(100), a scale of 100; or after each optimizer step where the forward() is not yours to edit), "
                "and check its initial value: a parameter the model takes exp() of holds "
                "the logarithm of the scale it stands for (CLIP starts at log(1/0.07) = 2.659).";
    return s;
  }
  return std::nullopt;
}

std::optional<Suggestion> exp_factor_bound(const std::string& module, const std::string& detail) {
  for (const Read& r : parse(detail)) {
    if (!r.one_value || r.reader != "Exp" || !(std::exp(r.value) > kClipBound)) continue;
    Suggestion s = clamp_before_exp(r.name);
    s.summary = "Bound " + r.name + " before its exp(): the code after " + module + " reads it through exp(), and "
                "at " + three_digits(r.value) + " exp() gives " + three_digits(std::exp(r.value)) + ", which enlarges "
                "the gradient that code sends back into " + module + " as much. Clamp it (CLIP clamps its temperature "
                "at ln(100), a scale of 100, which the loss scale absorbs): in the model's forward(), or after each "
                "optimizer step where the forward() is not yours to edit.";
    return s;
  }
  return std::nullopt;
}

}  // namespace ampdiag::analyzer::model_parameters
