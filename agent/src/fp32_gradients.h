// The parameters whose gradient autocast computes in FP32, as the Python agent's
// _fp32_gradients.py names them (event "fp32-gradients", docs/PYTHON.md): every node in the
// graph that hands a part to the parameter's accumulator received a float32 or float64
// gradient (exp() of a float32 A_log, an RMSNorm weight multiplying float32 values, a
// float32 embedding table; not a Linear's weight, which autocast casts to fp16 first). Read
// once, from the graph under the first scaled loss, only where the walk covers it whole.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace ampdiag::agent {

inline constexpr std::size_t kFp32WalkNodes = 20000;

// The names of the parameters in `named` whose every part under `loss`'s graph arrives so,
// sorted; nullopt where that graph has more than `walk_nodes` nodes. A part handed on by a
// custom autograd Function's backward counts as fp16: its code chooses its precision.
std::optional<std::vector<std::string>> fp32_gradient_names(const at::Tensor& loss,
                                                            const std::vector<std::pair<std::string, at::Tensor>>& named,
                                                            std::size_t walk_nodes = kFp32WalkNodes);

}  // namespace ampdiag::agent
