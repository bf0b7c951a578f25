#include "overflow_events.h"

#include <algorithm>

#include "ampdiag/rundb/module_paths.h"
#include "suggestions.h"

namespace ampdiag::analyzer::rules {

bool holds_parameters(const Run& run, const std::string& path) {
  return std::any_of(run.layers.begin(), run.layers.end(), [&](const LayerSummary& l) {
    return l.info.module_path == path || l.info.name.rfind(path + ".", 0) == 0;
  });
}

std::set<std::string> pinned_fp32(const Run& run) {
  std::set<std::string> pinned;
  for (const auto& e : run.events)
    if (e.kind == "pinned-fp32") pinned.insert(e.detail);
  return pinned;
}

bool Fp32Gradients::holds(const rundb::LayerRow& layer) const {
  if (layers.count(layer.name)) return true;
  for (const auto& module : pinned)
    if (rundb::within(layer.module_path, module)) return true;
  return false;
}

Fp32Gradients fp32_gradients(const Run& run) {
  Fp32Gradients fp32{pinned_fp32(run), {}};
  for (const auto& e : run.events) {
    if (e.kind != "fp32-gradients") continue;
    for (std::size_t at = 0; at < e.detail.size();) {  // "A_log, emb.weight"
      const std::size_t comma = e.detail.find(", ", at);
      fp32.layers.insert(e.detail.substr(at, comma == std::string::npos ? std::string::npos : comma - at));
      at = comma == std::string::npos ? e.detail.size() : comma + 2;
    }
  }
  return fp32;
}

InputsFrom inputs_from(const Run& run) {
  InputsFrom from;
  for (const auto& e : run.events) {
    const std::size_t at = e.kind == "module-input-from" ? e.detail.find(": ") : std::string::npos;
    if (at != std::string::npos) from.emplace(e.detail.substr(0, at), e.detail.substr(at + 2));
  }
  return from;
}

bool takes_output_of(const Run& run, const InputsFrom& from, const std::string& user, const std::string& module,
                     std::vector<std::string>* through, int hops) {
  constexpr int kHops = 3;
  if (user.empty() || module.empty() || suggest::within(user, module)) return false;
  const auto [begin, end] = from.equal_range(user);
  return std::any_of(begin, end, [&](const auto& entry) {
    const std::string& producer = entry.second;
    if (suggest::within(producer, module)) return true;
    if (hops >= kHops || producer == user || holds_parameters(run, producer) ||
        !takes_output_of(run, from, producer, module, through, hops + 1))
      return false;
    if (through) through->push_back(producer);
    return true;
  });
}

TiedUses tied_uses(const Run& run) {
  TiedUses uses;
  static const std::string kThrough = " through ";
  for (const auto& e : run.events) {
    if (e.kind != "tied-gradient-nonfinite") continue;
    const std::size_t at = e.detail.find(kThrough);
    if (at == std::string::npos) continue;
    const std::string module = e.detail.substr(at + kThrough.size());
    uses.emplace(std::make_pair(e.step, e.detail.substr(0, at)), module == "the model" ? "" : module);
  }
  return uses;
}

BackwardReplay backward_replay(const Run& run, const std::string& module) {
  if (module.empty()) return {};
  const auto [e, rest] = run.module_event("backward-replay", module);
  if (!e) return {};
  const std::size_t at = rest.find(": ");
  return {rest.substr(0, at), at == std::string::npos ? std::string() : rest.substr(at + 2), e->step};
}

OutputGradient output_gradient(const Run& run, const std::string& module) {
  if (module.empty()) return {};
  // The latest look: one judged "finite" is looked at again at a later skip (the run's first
  // skips may overflow in the module's own backward, its later ones through its output).
  const std::string prefix = module + ": ";
  OutputGradient latest;
  for (const auto& e : run.events)
    if (e.kind == "module-output-gradient" && e.detail.rfind(prefix, 0) == 0) latest = {e.detail.substr(prefix.size()), e.step};
  return latest;
}

GradientSenders gradient_senders(const Run& run, const std::string& module) {
  if (module.empty()) return {};
  const auto [e, rest] = run.module_event("module-gradient-sender", module);
  if (!e) return {};
  GradientSenders senders{{}, e->step};
  for (std::size_t at = 0; at <= rest.size();) {
    const std::size_t comma = std::min(rest.find(", ", at), rest.size());
    if (comma > at) senders.paths.push_back(rest.substr(at, comma - at));
    at = comma + 2;
  }
  return senders;
}

std::string whole_model(const Run& run) {
  if (run.layers.empty()) return "";
  std::string whole = run.layers.front().info.module_path;
  for (const auto& layer : run.layers) {
    if (whole.empty()) break;
    whole = rundb::common_module(whole, layer.info.module_path);
  }
  return whole;
}

}  // namespace ampdiag::analyzer::rules
