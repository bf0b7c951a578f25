// The C++ agent's hooks for SenderWatch (agent/core/sender_watch.h, where the decisions and
// the event are explained), as the Python agent's _gradient_sender.py: once the gradient
// reaching module X's output was judged NaN/Inf, each module run through Agent::forward()
// on a tensor made from X's output by operations of one input each (views, activations,
// pooling: up to kTraceHops of them) is given an alias of it, so that the gradient its
// backward sends back arrives there alone (autograd sums what X's several users send into
// X's output); the gradient it receives at its output is checked too. Host tensors only: a
// device check would wait for the device.
#pragma once

#include "sender_watch.h"

#include <ATen/core/Tensor.h>

#include <atomic>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace ampdiag::agent {

class GradientSenders {
 public:
  static constexpr int kTraceHops = 16;

  // Out of line: the autograd node type is complete only where the hooks are made.
  GradientSenders();
  ~GradientSenders();

  // Watch X = `path` (SenderWatch::arm).
  void arm(const std::string& path) { core_.arm(path); }
  // Module `path`'s probed output `y`: X's outputs are what its users are given.
  void output(const std::string& path, const at::Tensor& y);
  // Module `path` about to run on `x` through Agent::forward(): what to give it.
  at::Tensor input(const std::string& path, const at::Tensor& x);
  // The output of the call input() was last asked for: the gradient it receives.
  void returned(const at::Tensor& y);
  // As a host step ends (SenderWatch::step_ended): the event's detail, "" for none.
  std::string step_ended(const std::string& named);

 private:
  struct Call {
    std::string path;
    std::atomic<int> received{-1}, sent{-1};  // set by autograd, maybe on another thread
  };
  // What Tensor::grad_fn() holds an autograd node by (a shared or an intrusive pointer, by
  // torch version).
  using NodeRef = std::decay_t<decltype(std::declval<const at::Tensor&>().grad_fn())>;
  using Node = typename NodeRef::element_type;
  bool made_from(const Node* node) const;

  SenderWatch core_;
  std::vector<NodeRef> made_;  // this step's nodes of X's outputs
  std::vector<std::shared_ptr<Call>> calls_;                    // this step's calls given X's output
  std::vector<std::shared_ptr<Call>> pending_;  // the calls running now, innermost last (null: not looked at)
  std::shared_ptr<std::atomic<int>> sends_ = std::make_shared<std::atomic<int>>(0);
};

}  // namespace ampdiag::agent
