// Which parameters' gradients autocast computes in FP32: the decision both agents share (the
// C++ agent's agent/src/fp32_gradients.cpp and the Python agent's _fp32_gradients.py walk the
// autograd graph under the first scaled loss and describe it; nothing here knows torch).
//
// A parameter is named where every node handing it a part computes that part from a float32
// (or float64) gradient: exp() of a float32 A_log, an RMSNorm weight multiplying float32
// values, a float32 embedding table. fp16 neither bounds such a gradient at 65504 nor flushes
// it below its normal range (event "fp32-gradients", which the analyzer reads). A node that
// only hands on what it receives, reshaped or cast (a view, a transpose, autocast's cast),
// hands on fp16 values where it received them, so a weight transposed before autocast casts
// it (LibTorch's Linear: TBackward0 under ToCopyBackward0) is not named. Nor is a part from a
// custom Function's backward, whose code computes in whatever precision it chooses.
#pragma once

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

namespace ampdiag::agent {

inline constexpr std::size_t kFp32WalkNodes = 20000;  // a larger graph is not judged
inline constexpr std::size_t kFp32Named = 256;        // names in the event, at most
inline constexpr const char* kFp32GradientsKind = "fp32-gradients";

// The walked graph, nodes by index.
struct GradientGraph {
  // Per node: the operation its derivative is for ("Exp" for ExpBackward0, "" for a custom
  // Function's backward) and the dtype of the gradient it receives ("float32", "?").
  std::vector<std::string> ops, received;
  std::vector<std::pair<std::size_t, std::size_t>> edges;  // (node, a node it hands a gradient to)
  std::vector<std::pair<std::size_t, std::string>> parts;  // (node, a parameter it hands a part to)
};

// Whether the operation only hands on the values it receives (a view, a transpose, a cast).
bool passes_on(const std::string& op);

// The parameters of `graph` whose every part is computed from a float32 or float64 gradient,
// sorted, each once.
std::vector<std::string> fp32_gradient_params(const GradientGraph& graph);

// The event's detail for them ("A_log, emb.weight"; up to kFp32Named), "" for none.
std::string fp32_gradients_detail(const std::vector<std::string>& params);

}  // namespace ampdiag::agent
