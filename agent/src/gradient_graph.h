// The C++ agent's walk for the fp32-gradients decision (agent/core/fp32_gradients.h, where it
// is explained), as the Python agent's _fp32_gradients.py: the graph under the first scaled
// loss, described node by node, where it has at most kFp32WalkNodes nodes.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "fp32_gradients.h"  // the core's (agent/core)

namespace torch::autograd {
struct Node;
}

namespace ampdiag::agent {

// The dtype of the tensor `node` made in forward ("float32"; "?" where it does not say), as
// the Python agent's made_dtype().
std::string made_dtype(const torch::autograd::Node& node);

// The graph under `loss`, its parts handed to the parameters in `named`; nullopt where it has
// more than `walk_nodes` nodes.
std::optional<GradientGraph> gradient_graph(const at::Tensor& loss,
                                            const std::vector<std::pair<std::string, at::Tensor>>& named,
                                            std::size_t walk_nodes = kFp32WalkNodes);

}  // namespace ampdiag::agent
