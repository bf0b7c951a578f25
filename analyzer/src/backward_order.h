// Which modules a gradient passed through in backward, read from the forward's order: those
// without parameters between two layers (a pairwise distance), and those that ran after a
// module in forward (their backward ran before its own).
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>

#include "ampdiag/analyzer/findings.h"
#include "ampdiag/analyzer/run.h"

namespace ampdiag::analyzer::rules {

// Probed modules holding no parameter between `first`'s module and `last_finite`'s, added
// to `out` (at most three in all).
void parameterless_between(const Run& run, const rundb::LayerRow& first, const rundb::LayerRow& last_finite,
                           std::set<std::string>& out);

// The modules the agent saw run again and again in one forward, each call taking the last
// one's output (event "chained-calls": ALBERT's shared layer, a cell called in a loop).
std::set<std::string> chained_modules(const Run& run);

// The innermost of `chained` that is `module_path` or holds it; empty where none.
std::string chained_block(const std::set<std::string>& chained, const std::string& module_path);

// Probed modules inside `block` holding no parameter, in the order modules first finished,
// added to `out` (at most three in all): the backward of each of its calls runs through them.
void parameterless_inside(const Run& run, const std::string& block, std::set<std::string>& out);

// What the backward of a module without parameters computes on: the largest finite value
// recorded at its output or at its input (the output of the module it takes, event
// module-input-from), over `modules`. A cube of a value above 40 passes fp16's range inside
// that backward (tanh-approximated GELU's), a square above 256, an exp() above 11.
struct LargestValue {
  std::string module;  // whose backward computes on it
  std::string source;  // whose output held it: `module`, or the module whose output it takes
  float absmax = 0.0f;
};
LargestValue largest_value_through(const Run& run, const std::set<std::string>& modules);

// The FP32 pin of the first one or two of `between`, modules without parameters a gradient
// passed, untried: they get no replay of their own, and the other kind of NaN, an fp16 value
// inside their backward beyond 65504, is theirs to pin (a custom activation whose backward
// takes exp() of its fp16 input: pinned, it trains). Added after the look at their backward
// (f's last fix), "If instead ..."; before it, where one of them computes on values whose cube
// passes fp16's top (largest_value_through), with those values as evidence, the look then "If
// pinned it still goes NaN/Inf, ..." (ALBERT's gelu_new on FFN outputs near 2e4).
void pin_parameterless(const Run& run, const std::set<std::string>& between, Finding& f);

// `ran_before` and the modules whose finite gradients arrived before the NaN/Inf ones of the
// layers in `first` (layer id -> times first).
std::set<std::string> modules_after(const Run& run, const std::map<std::int64_t, std::int64_t>& first,
                                     std::set<std::string> ran_before);

}  // namespace ampdiag::analyzer::rules
