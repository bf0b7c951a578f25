#include "gradient_graph.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include <algorithm>
#include <cctype>
#include <map>
#include <unordered_map>

#include "agent_setup.h"

namespace ampdiag::agent {

namespace {

using torch::autograd::Node;

// The operation a derivative torch generates is for ("Exp" for "ExpBackward0"); "" for any
// other node: a custom Function's (CppNode<T>).
std::string generated_op(const Node& node) {
  const std::string name = node.name();
  const std::size_t at = name.rfind("Backward");
  if (at == std::string::npos || at + 8 == name.size() || name.find_first_of(":<") != std::string::npos) return "";
  const bool numbered =
      std::all_of(name.begin() + std::ptrdiff_t(at + 8), name.end(), [](char c) { return std::isdigit(c) != 0; });
  return numbered ? name.substr(0, at) : "";
}

}  // namespace

std::string made_dtype(const Node& node) {
  if (node.num_inputs() == 0) return "?";
  const at::ScalarType dtype = c10::typeMetaToScalarType(node.input_metadata(0).options().dtype());
  const bool named = dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf || dtype == at::kBFloat16;
  return named ? dtype_name(dtype) : "?";
}

std::optional<GradientGraph> gradient_graph(const at::Tensor& loss,
                                            const std::vector<std::pair<std::string, at::Tensor>>& named,
                                            std::size_t walk_nodes) {
  std::map<const c10::TensorImpl*, const std::string*> names;
  for (const auto& [name, p] : named) names.emplace(p.unsafeGetTensorImpl(), &name);
  GradientGraph graph;
  std::unordered_map<const Node*, std::size_t> index;
  const auto index_of = [&](const Node* node) {
    const auto [it, added] = index.emplace(node, graph.ops.size());
    if (added) {
      graph.ops.push_back(generated_op(*node));
      graph.received.push_back(made_dtype(*node));
    }
    return std::make_pair(it->second, added);
  };
  std::vector<const Node*> stack;
  if (loss.grad_fn()) stack.push_back(loss.grad_fn().get());
  std::vector<char> walked;
  while (!stack.empty()) {
    const Node* node = stack.back();
    stack.pop_back();
    const std::size_t at = index_of(node).first;
    if (walked.size() <= at) walked.resize(at + 1, 0);
    if (walked[at]) continue;
    walked[at] = 1;
    if (graph.ops.size() > walk_nodes) return std::nullopt;
    for (const auto& edge : node->next_edges()) {
      if (!edge.function) continue;
      const auto* accumulate = dynamic_cast<const torch::autograd::AccumulateGrad*>(edge.function.get());
      if (accumulate == nullptr) {
        graph.edges.emplace_back(at, index_of(edge.function.get()).first);
        stack.push_back(edge.function.get());
      } else if (const auto name = names.find(accumulate->variable.unsafeGetTensorImpl()); name != names.end()) {
        graph.parts.emplace_back(at, *name->second);
      }
    }
  }
  return graph;
}

}  // namespace ampdiag::agent
