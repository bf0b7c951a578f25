// What the agents recorded about where a backward overflow was made, as overflow-origin
// reads it: the events of their looks at a module's output gradient, its backward replay,
// the modules given its output, tied parameters and FP32 pins (docs/FORMAT.md, events).
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "ampdiag/analyzer/run.h"

namespace ampdiag::analyzer::rules {

// Whether the module at `path`, or one inside it, holds a recorded parameter.
bool holds_parameters(const Run& run, const std::string& path);

// The modules the run already ran in FP32 (the Python agent's event "pinned-fp32": pinned by
// attach(pins=...) or by the user's own pin_fp32() before it).
std::set<std::string> pinned_fp32(const Run& run);
// Where the run computed gradients in FP32, which fp16 neither bounds at its top nor flushes:
// the layers of the modules it pinned (pinned_fp32) and the parameters whose every backward
// part autocast computed in FP32 (the Python agent's event "fp32-gradients": a Mamba mixer's
// A_log, a float32 embedding table).
struct Fp32Gradients {
  std::set<std::string> pinned;  // modules
  std::set<std::string> layers;  // parameter names
  bool holds(const rundb::LayerRow& layer) const;
};
Fp32Gradients fp32_gradients(const Run& run);

// Module -> the modules whose output its first argument was, unchanged or viewed (the
// agents' event "module-input-from", "USER: PRODUCER"): its backward sends that output its
// gradient.
using InputsFrom = std::multimap<std::string, std::string>;
InputsFrom inputs_from(const Run& run);

// Whether `user` took the output of `module` (or of a module inside it), directly or through
// modules without parameters (a Dropout between an encoder and the head), whose backward
// only passes the gradient on and has no gradient of its own to show where it ran.
// `through`, where given, receives those modules, nearest `module` first.
bool takes_output_of(const Run& run, const InputsFrom& from, const std::string& user, const std::string& module,
                     std::vector<std::string>* through = nullptr, int hops = 0);

// (step, layer name) -> the module whose use of that tied parameter went NaN/Inf first in
// the step (the agent's event "tied-gradient-nonfinite": "emb.weight through head").
using TiedUses = std::map<std::pair<std::int64_t, std::string>, std::string>;
TiedUses tied_uses(const Run& run);

// The agent's replay of a module's backward (event "backward-replay", "PATH: OUTCOME:
// DETAIL", see the Python agent's _backward_replay.py): outcome "finite" (NaN/Inf as it
// ran, none in FP32), "intrinsic" (NaN/Inf in FP32 from finite values) or "unconfirmed";
// empty where none ran for it.
struct BackwardReplay {
  std::string outcome, detail;
  std::int64_t step = -1;
};
BackwardReplay backward_replay(const Run& run, const std::string& module);

// The agent's look at the gradient reaching a module's output, at a skipped step whose
// first NaN/Inf gradient was that module's (event "module-output-gradient", "PATH: SEEN",
// the Python agent's _gradient_entry.py): "nonfinite" where the NaN/Inf came in through its
// output, made by the code after it in forward; "finite" where its own backward made them;
// empty where none was taken. Of two looks (one judged "finite" is looked at again at a later
// skip), the latest.
struct OutputGradient {
  std::string seen;
  std::int64_t step = -1;
};
OutputGradient output_gradient(const Run& run, const std::string& module);

// The agent's look at which module given a module's output sent the NaN/Inf that reached
// it (event "module-gradient-sender", "PATH: USER[, USER]", the Python agent's
// _gradient_sender.py): each received a finite gradient at its own output and sent NaN/Inf
// back to the argument made from PATH's output, in backward order. Where several modules
// take that output (two heads on one backbone), the one whose backward ran just before is
// not necessarily the one.
struct GradientSenders {
  std::vector<std::string> paths;
  std::int64_t step = -1;
};
GradientSenders gradient_senders(const Run& run, const std::string& module);

// The innermost module holding every layer: "" for most models, "module" for a
// DistributedDataParallel wrapper's. Holding both of two layers, it names no place in the model.
std::string whole_model(const Run& run);

}  // namespace ampdiag::analyzer::rules
