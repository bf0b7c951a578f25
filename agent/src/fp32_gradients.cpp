#include "fp32_gradients.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include <algorithm>
#include <cctype>
#include <map>
#include <set>
#include <unordered_map>

namespace ampdiag::agent {

namespace {

using torch::autograd::Node;

// The operation a derivative torch generates is for ("Exp" for "ExpBackward0"); "" for any
// other node: a custom Function's (CppNode<T>), which computes in whatever precision its
// code chooses, whatever it receives.
std::string generated_op(const Node& node) {
  const std::string name = node.name();
  const std::size_t at = name.rfind("Backward");
  if (at == std::string::npos || at + 8 == name.size() || name.find_first_of(":<") != std::string::npos) return "";
  const bool numbered =
      std::all_of(name.begin() + std::ptrdiff_t(at + 8), name.end(), [](char c) { return std::isdigit(c) != 0; });
  return numbered ? name.substr(0, at) : "";
}

// Nodes that hand on the values they receive, reshaped or cast, computing none: the part a
// weight gets through its transpose after autocast's cast (LibTorch's Linear: TBackward0
// under ToCopyBackward0) holds the fp16 values that cast received.
bool passes_on(const std::string& op) {
  static const std::set<std::string> kOps = {"ToCopy", "T",     "Transpose", "Permute", "View",   "ReshapeAlias",
                                             "UnsafeView", "Expand", "Clone", "Squeeze", "Unsqueeze", "Alias",
                                             "Slice",  "Select", "AsStrided", "Split", "SplitWithSizes", "Unbind",
                                             "Narrow"};
  return kOps.count(op) > 0;
}

at::ScalarType received(const Node& node) {
  return node.num_inputs() == 0 ? at::ScalarType::Undefined
                                : c10::typeMetaToScalarType(node.input_metadata(0).options().dtype());
}

}  // namespace

std::optional<std::vector<std::string>> fp32_gradient_names(const at::Tensor& loss,
                                                            const std::vector<std::pair<std::string, at::Tensor>>& named,
                                                            std::size_t walk_nodes) {
  std::map<const c10::TensorImpl*, std::string> names;
  for (const auto& [name, p] : named) names.emplace(p.unsafeGetTensorImpl(), name);
  std::unordered_map<const Node*, std::vector<const Node*>> children;  // the walked nodes' non-accumulator ones
  std::map<const c10::TensorImpl*, std::vector<const Node*>> parts;    // parameter -> the nodes handing it a part
  std::vector<const Node*> stack;
  if (loss.grad_fn()) stack.push_back(loss.grad_fn().get());
  while (!stack.empty()) {
    const Node* node = stack.back();
    stack.pop_back();
    if (children.count(node)) continue;
    if (children.size() >= walk_nodes) return std::nullopt;
    auto& kids = children[node];
    for (const auto& edge : node->next_edges()) {
      if (!edge.function) continue;
      const auto* accumulate = dynamic_cast<const torch::autograd::AccumulateGrad*>(edge.function.get());
      if (accumulate == nullptr) {
        kids.push_back(edge.function.get());
        stack.push_back(edge.function.get());
      } else if (names.count(accumulate->variable.unsafeGetTensorImpl())) {
        parts[accumulate->variable.unsafeGetTensorImpl()].push_back(node);
      }
    }
  }
  // Whether the gradient each node receives holds fp16 values: its dtype, or handed on from
  // one that did. Read from the loss down, every node after all that hand it a gradient.
  std::unordered_map<const Node*, bool> half;
  std::unordered_map<const Node*, int> waiting;
  for (const auto& [node, kids] : children) {
    const at::ScalarType dtype = received(*node);
    half[node] = half[node] || dtype == at::kHalf || dtype == at::kBFloat16;
    for (const Node* kid : kids) ++waiting[kid];
  }
  std::vector<const Node*> ready;
  for (const auto& [node, kids] : children)
    if (waiting[node] == 0) ready.push_back(node);
  while (!ready.empty()) {
    const Node* node = ready.back();
    ready.pop_back();
    const bool hands_half = half[node] && passes_on(generated_op(*node));
    for (const Node* kid : children[node]) {
      half[kid] = half[kid] || hands_half;
      if (--waiting[kid] == 0) ready.push_back(kid);
    }
  }
  const auto computed_in_fp32 = [&](const Node* node) {
    const std::string op = generated_op(*node);
    const at::ScalarType dtype = received(*node);
    return !op.empty() && (dtype == at::kFloat || dtype == at::kDouble) && !(half[node] && passes_on(op));
  };
  std::vector<std::string> found;
  for (const auto& [param, nodes] : parts)
    if (std::all_of(nodes.begin(), nodes.end(), computed_in_fp32)) found.push_back(names.at(param));
  std::sort(found.begin(), found.end());
  return found;
}

}  // namespace ampdiag::agent
