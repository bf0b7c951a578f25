// Which modules a gradient passed through in backward, read from the forward's order.
#include "backward_order.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>
#include <vector>

#include "ampdiag/rundb/module_paths.h"
#include "overflow_events.h"
#include "rules.h"
#include "suggestions.h"

namespace ampdiag::analyzer::rules {

// Probed modules holding no parameter that finished their forward after `first`'s module
// and before `last_finite`'s: a gradient going from one layer to the other in backward
// passes through their backward too. Read back from `last_finite`'s module through the
// module that finished just before each in the last forward with every call's row, which
// must reach `first`'s (else none: they ran in different forwards, or too far apart to
// say). Without such forwards, by module ids, which follow the order modules first
// finished: a module first called later (an expert, a branch) comes after them all. At
// most a few, by path.
void parameterless_between(const Run& run, const rundb::LayerRow& first, const rundb::LayerRow& last_finite,
                           std::set<std::string>& out) {
  const ModuleSummary* from = run.module_named(first.module_path);
  const ModuleSummary* to = run.module_named(last_finite.module_path);
  if (!from || !to) return;
  std::vector<std::string> found;
  if (to->position >= 0) {
    constexpr int kHops = 64;
    std::int64_t id = to->before_last;
    for (int hop = 0; id != from->info.id; ++hop) {
      if (id < 0 || hop == kHops) return;
      const ModuleSummary& m = run.modules[std::size_t(id)];
      if (!holds_parameters(run, m.info.path)) found.push_back(m.info.path);
      id = m.before_last;
    }
    std::reverse(found.begin(), found.end());  // nearest `first`'s first, as by ids
  } else {
    for (std::int64_t id = from->info.id + 1; id < to->info.id; ++id) {
      const std::string& path = run.modules[std::size_t(id)].info.path;
      if (!holds_parameters(run, path)) found.push_back(path);
    }
  }
  for (const auto& path : found)
    if (out.size() < 3) out.insert(path);
}

std::set<std::string> chained_modules(const Run& run) {
  std::set<std::string> chained;
  for (const auto& e : run.events)
    if (e.kind == "chained-calls") chained.insert(e.detail);
  return chained;
}

std::string chained_block(const std::set<std::string>& chained, const std::string& module_path) {
  std::string innermost;  // the longest of those that hold it
  for (const auto& block : chained)
    if (!block.empty() && block.size() > innermost.size() && rundb::within(module_path, block)) innermost = block;
  return innermost;
}

void parameterless_inside(const Run& run, const std::string& block, std::set<std::string>& out) {
  for (const auto& m : run.modules)
    if (out.size() < 3 && m.info.path != block && rundb::within(m.info.path, block) && !holds_parameters(run, m.info.path))
      out.insert(m.info.path);
}

LargestValue largest_value_through(const Run& run, const std::set<std::string>& modules) {
  LargestValue largest;
  const InputsFrom from = inputs_from(run);
  const auto consider = [&](const std::string& module, const std::string& source) {
    const ModuleSummary* s = run.module_named(source);
    if (s && s->max_absmax > largest.absmax) largest = {module, source, s->max_absmax};
  };
  for (const auto& module : modules) {
    consider(module, module);
    const auto [begin, end] = from.equal_range(module);
    for (auto it = begin; it != end; ++it) consider(module, it->second);
  }
  return largest;
}

void pin_parameterless(const Run& run, const std::set<std::string>& between, Finding& f) {
  const std::string& first = *between.begin();
  const std::string second = between.size() > 1 ? *std::next(between.begin()) : std::string();
  Suggestion pin = second.empty() ? suggest::pin_fp32(run, first) : suggest::pin_fp32_both(run, first, second, "");
  const std::string names = second.empty() ? first : first + " and " + second;
  const std::string none = std::string(between.size() == 1 ? "It holds" : "They hold") +
                           " no parameters, so no replay of its backward was made.";
  pin.summary = "If instead a value inside " + names + "'s backward passes fp16's range (an exp() above 11, a cube above "
                "40: at a scale this low the scale no longer matters, an fp16 intermediate does): run " + names +
                " in FP32. " + none;
  pin.untried = true;
  // Values that large in what its backward computes on are evidence for the pin, and a
  // singular point has none.
  const LargestValue large = largest_value_through(run, between);
  if (f.suggestions.empty() || !(large.absmax > std::cbrt(run.fp_max)) ||
      f.suggestions.back().summary.rfind(suggest::kSingularLook, 0) != 0) {
    f.suggestions.push_back(pin);
    return;
  }
  const auto look = f.suggestions.end() - 1;
  const std::string held = large.source == large.module ? large.module + "'s outputs"
                                                        : large.module + "'s input, " + large.source + "'s output,";
  f.evidence += "; " + held + " reached " + fmt(large.absmax) + ", whose cube passes " + fmt(run.fp_max);
  pin.summary = "Run " + names + " in FP32: " + large.module + " computes on values up to " + fmt(large.absmax) +
                ", and a cube of them (tanh-approximated GELU takes one), a square above 256 or an exp() above 11 "
                "passes fp16's range inside its backward at any loss scale. " + none;
  look->summary = "If pinned it still goes NaN/Inf, look at the backward of " +
                  look->summary.substr(std::strlen(suggest::kSingularLook));
  f.suggestions.insert(look, pin);
}

// `ran_before`, and the modules holding a layer whose finite gradient arrived before the NaN/Inf
// one of a layer in `first` (layer id -> times first) in a step where that went first
// (Run::arrived_before): their backward ran before, so they come after it in forward.
std::set<std::string> modules_after(const Run& run, const std::map<std::int64_t, std::int64_t>& first,
                                     std::set<std::string> ran_before) {
  for (const auto& [layer, times] : first)
    if (const auto it = run.arrived_before.find(layer); it != run.arrived_before.end())
      for (const std::int64_t id : it->second) ran_before.insert(suggest::module_for_layer(run, run.layers[std::size_t(id)].info));
  return ran_before;
}

}  // namespace ampdiag::analyzer::rules
