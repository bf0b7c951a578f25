#include "fp32_gradients.h"

#include <algorithm>
#include <map>
#include <set>

namespace ampdiag::agent {

bool passes_on(const std::string& op) {
  static const std::set<std::string> kOps = {"ToCopy",  "T",      "Transpose",  "Permute", "View",
                                             "ReshapeAlias", "UnsafeView", "Expand", "Clone",   "Squeeze",
                                             "Unsqueeze", "Alias", "Slice",      "Select",  "AsStrided",
                                             "Split",   "SplitWithSizes", "Unbind", "Narrow"};
  return kOps.count(op) > 0;
}

std::vector<std::string> fp32_gradient_params(const GradientGraph& graph) {
  const std::size_t n = graph.ops.size();
  const auto half = [](const std::string& dtype) { return dtype == "float16" || dtype == "bfloat16"; };
  // Whether the gradient each node receives holds fp16 values: its dtype, or handed on from
  // one that did. Read from the loss down, each node once all that hand it a gradient were.
  std::vector<char> fp16_values(n, 0);
  std::vector<std::vector<std::size_t>> children(n);
  std::vector<std::size_t> waiting(n, 0);
  for (std::size_t i = 0; i < n; ++i) fp16_values[i] = half(graph.received[i]);
  for (const auto& [node, child] : graph.edges) {
    if (node >= n || child >= n) continue;
    children[node].push_back(child);
    ++waiting[child];
  }
  std::vector<std::size_t> ready;
  for (std::size_t i = 0; i < n; ++i)
    if (waiting[i] == 0) ready.push_back(i);
  while (!ready.empty()) {
    const std::size_t node = ready.back();
    ready.pop_back();
    const bool hands_fp16 = fp16_values[node] && passes_on(graph.ops[node]);
    for (const std::size_t child : children[node]) {
      fp16_values[child] = fp16_values[child] || hands_fp16;
      if (--waiting[child] == 0) ready.push_back(child);
    }
  }
  const auto computed_in_fp32 = [&](std::size_t node) {
    if (node >= n || graph.ops[node].empty()) return false;
    const std::string& dtype = graph.received[node];
    return (dtype == "float32" || dtype == "float64") && !(fp16_values[node] && passes_on(graph.ops[node]));
  };
  std::map<std::string, bool> all_fp32;  // parameter -> every part so far computed in FP32
  for (const auto& [node, param] : graph.parts) {
    const bool fp32 = computed_in_fp32(node);
    const auto [it, added] = all_fp32.emplace(param, fp32);
    if (!added) it->second = it->second && fp32;
  }
  std::vector<std::string> found;
  for (const auto& [param, fp32] : all_fp32)
    if (fp32) found.push_back(param);
  return found;  // a map's keys: sorted
}

std::string fp32_gradients_detail(const std::vector<std::string>& params) {
  std::string detail;
  for (std::size_t i = 0; i < params.size() && i < kFp32Named; ++i) detail += (i ? ", " : "") + params[i];
  return detail;
}

}  // namespace ampdiag::agent
