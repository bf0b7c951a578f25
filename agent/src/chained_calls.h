// Whether a module run through Agent::forward() is run again and again in one forward, each
// call given the last one's output (a shared block, a cell in a loop): the C++ side of the
// Python agent's _chained_calls.py, for the same event `chained-calls`. Its parameters
// receive their gradient only once every call's backward has run, and a NaN/Inf one call's
// backward makes reaches the calls before it: overflow-origin then names the block, not the
// first of its parameters to go NaN/Inf. Looked at in the first two forwards that run a
// module, then never again.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>

#include <ATen/core/Tensor.h>

namespace ampdiag::agent {

class ChainedCalls {
 public:
  using Forward = std::pair<std::int64_t, std::int64_t>;  // (step, micro-batch)

  // A call of `path` given `input` returned `output` in forward `forward`: true the first
  // time `input` is the output of that module's call before it in the same forward,
  // unchanged or as a view.
  bool call(const std::string& path, const at::Tensor& input, const at::Tensor& output, Forward forward);

 private:
  struct Look {
    Forward forward{-1, -1};
    // Weak: a forward's outputs are not kept alive past it for this.
    c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> output{
        c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>()};
    bool done = false;
  };
  std::unordered_map<std::string, Look> looks_;
};

}  // namespace ampdiag::agent
