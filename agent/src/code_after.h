// The C++ agent's reading of the code after the module a skip names, as the Python agent's
// _code_after.py (where the events are explained): where the gradient reaching that module's
// output holds NaN/Inf, the operations from its output to the loss (event "output-code"),
// and, at a later step, the first of them whose backward sent NaN/Inf back from finite
// gradients, with those between the output and it ("output-code-origin"), and the model's
// own parameters beside that code ("output-parameters": a temperature read through exp()); and
// the loss code, from the last probed output, read once ("loss-code-first") and in a step whose
// host loss went NaN/Inf ("loss-code").
// The analyzer then tells a pin that stops at a matmul autocast keeps in fp16 from one that
// keeps the gradient in FP32, and bounds such a temperature. Host tensors only.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "entry_watches.h"

namespace torch::autograd {
struct Node;
}

namespace ampdiag::agent {

// A node named without holding it (holding a node holds its graph): its address and sequence
// number, which a node later made at the same address does not share.
using NodeMark = std::pair<const torch::autograd::Node*, std::uint64_t>;
NodeMark mark_of(const at::Tensor& t);  // {nullptr, 0} for a tensor without grad_fn

// The operations that made `y`, down to `stops` (the step's probed outputs, a module's input)
// and the parameters, in forward order, the kOwnNodes nearest `y`, with their numbers, as the
// Python agent's nodes_under() and event "loss-code" write them ("Mul(20):float16,
// Exp:float16"); empty where `y` is data or one of `stops`. Read before a backward frees what
// the nodes saved: events "input-code" and "module-code" (agent.cpp).
constexpr std::size_t kOwnNodes = 64;
std::string code_under(const at::Tensor& y, const std::vector<NodeMark>& stops);

class CodeAfter {
 public:
  static constexpr int kLooks = 4;             // modules whose code after them is read, a run
  static constexpr std::size_t kWalkNodes = 4096;
  static constexpr std::size_t kTraceNodes = 1024;  // a longer code is not traced
  static constexpr int kTraceSteps = 64;       // steps a trace waits for a backward that makes NaN/Inf there
  static constexpr std::size_t kNamed = 32;    // operations an event names

  CodeAfter();
  ~CodeAfter();

  // The model's own parameters (held by no submodule), by name: those the code reads are named.
  void own_parameters(std::vector<std::pair<std::string, at::Tensor>> params);
  static constexpr int kLossCodeLooks = 8;     // steps whose loss code is read for its NaN/Inf, a run

  // scaler.scale()'s input this step: the code after the traced module is hooked, if its
  // output was seen this step. Where `nonfinite` (a host loss gone NaN/Inf while every probed
  // output stayed finite), the loss code from the step's last probed output is read, as the
  // Python agent's event "loss-code", once a step, for the analyzer to name what made it.
  void loss(const at::Tensor& loss, bool nonfinite);
  // A probed module's output in a training forward: the traced module's is kept for the step.
  void output(const std::string& path, const at::Tensor& y);
  // A hook for the gradient reaching module `path`'s output (the named module's): where it
  // holds NaN/Inf, that code is read (in backward, names and dtypes only).
  std::function<void(const at::Tensor&)> on_gradient(const std::string& path, const at::Tensor& y);
  // As a host step ends: the events to write; the step's hooks removed.
  std::vector<EntryWatches::Event> step_ended();

 private:
  struct Shared;
  std::shared_ptr<Shared> shared_;  // with the hooks in the graph, which may outlive a step
};

}  // namespace ampdiag::agent
