// Which module's backward sends the NaN/Inf that reaches a module X through its output: the
// decisions both agents share (the C++ agent's gradient_senders.h and the Python agent's
// _gradient_sender.py hook the tensors and report what they saw; nothing here knows torch).
//
// Where the gradient reaching X's output already held NaN/Inf (EntryWatches: "X:
// nonfinite"), the code that uses X's output made them. With several users of that output (a
// classifier and a box head on one backbone), the one whose backward ran just before X's
// need not be the one: autograd sums what each sends. So X is watched: at each step the agent
// looks at every call of a module given X's output (its first floating-point argument made
// from X's output by operations of one input each) and sees the gradient it receives at its
// output and the one it sends back to that argument. At the next skip that names X, the
// innermost such modules that received a finite gradient and sent NaN/Inf made them in their
// own backward: event "module-gradient-sender", "X: Y" (in the order they sent, "X: Y, Z"
// where several did). A watch no skip of X answers within kWatchSteps steps is dropped, a
// watch on another module moves it there, and each module is looked at once.
#pragma once

#include <set>
#include <string>
#include <vector>

namespace ampdiag::agent {

class SenderWatch {
 public:
  static constexpr int kWatchSteps = 64;
  static constexpr const char* kKind = "module-gradient-sender";

  // One call this step of a module given X's output, as the agent saw it.
  struct Call {
    std::string path;
    int received = -1;  // the gradient at its outputs: -1 not seen, 0 finite, 1 NaN/Inf
    int sent = -1;      // the order in backward in which it sent NaN/Inf back (-1: it did not)
  };

  // Watch `path` (X) from the next step; ignored where it was looked at already.
  void arm(const std::string& path);
  bool armed() const { return !target_.empty(); }
  const std::string& target() const { return target_; }
  // Whether a call of module `path` can be one given X's output: not X, nor inside or around it.
  bool user(const std::string& path) const;

  // As a host step ends; `named`: the module its first NaN/Inf gradient names ("" where it
  // was not skipped with a finite loss). Returns the event's detail, "" for none.
  std::string step_ended(const std::string& named, const std::vector<Call>& calls);

 private:
  std::string target_;
  int left_ = 0;
  std::set<std::string> judged_;
};

}  // namespace ampdiag::agent
