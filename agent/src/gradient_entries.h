// The C++ agent's hooks for EntryWatches (agent/core/entry_watches.h, where the decisions
// and the events are explained): the gradient reaching a watched module's output is checked
// at its first probed call of each step (host tensors only: a device check would wait for the
// device), and what was seen goes to the core as the step ends. A "nonfinite" verdict arms
// the look for the module that sent them (gradient_senders.h).
#pragma once

#include "code_after.h"
#include "entry_watches.h"
#include "gradient_senders.h"

#include <ATen/core/Tensor.h>

#include <atomic>
#include <memory>
#include <string>
#include <vector>

namespace ampdiag::agent {

class GradientEntries {
 public:
  // Module `path`'s probed output `y` in a training forward: the first call of the step of
  // each module watched gets a hook on the gradient that reaches it.
  void output(const std::string& path, const at::Tensor& y);
  // Module `path` about to run on `x` through Agent::forward(): what to give it, and its
  // output after (GradientSenders::input, returned).
  at::Tensor input(const std::string& path, const at::Tensor& x) { return senders_.input(path, x); }
  void returned(const at::Tensor& y) { senders_.returned(y); }
  // scaler.scale()'s input: where the code after the named module, and a NaN/Inf loss's
  // code, are read (code_after.h).
  void loss(const at::Tensor& loss, bool nonfinite) { code_after_.loss(loss, nonfinite); }
  // The model's own parameters, which that code may read (a temperature).
  void own_parameters(std::vector<std::pair<std::string, at::Tensor>> params) {
    code_after_.own_parameters(std::move(params));
  }
  // As a host step ends (see EntryWatches::step_ended): the events to write, the sender look's first.
  std::vector<EntryWatches::Event> step_ended(const std::string& named, const std::vector<std::string>& others);

 private:
  struct Look {
    // EntryWatches::Reached, set by autograd (maybe on another thread).
    std::shared_ptr<std::atomic<int>> reached = std::make_shared<std::atomic<int>>(EntryWatches::kNotSeen);
  };

  std::vector<std::string> paths() const;

  EntryWatches core_;
  std::vector<Look> looks_;  // one per core_.watches(), in its order
  GradientSenders senders_;
  CodeAfter code_after_;  // the code after the named module, where it received NaN/Inf
};

}  // namespace ampdiag::agent
