// What the C++ samples share: their command line, an autocast scope, and the summary
// they print. Each sample is a real LibTorch training loop with fp16 autocast on CPU,
// ampdiag::GradScaler and the agent.
#pragma once

#include <ATen/autocast_mode.h>

#include <cstdint>
#include <exception>
#include <string>
#include <vector>

#include "ampdiag/agent.h"
#include "ampdiag/grad_scaler.h"
#include "ampdiag/pin_fp32.h"

namespace ampdiag::samples {

struct SampleArgs {
  std::string db;                    // run.db to write
  std::int64_t steps = 0;
  std::uint64_t seed = 0;
  std::int64_t every = 1;
  bool histogram = false;            // --histogram: record exponent histograms
  std::vector<std::string> pins;     // --pin-fp32 MODULE (repeatable)
};

struct SampleInfo {
  const char* name;                  // program name
  const char* what;                  // one line: the failure it reproduces
  const char* default_db;
  std::int64_t default_steps;
  std::vector<std::string> pinnable; // module paths --pin-fp32 accepts
};

// Parses argv; prints usage and exits 0 for --help, 2 for a bad argument.
SampleArgs parse_sample_args(int argc, char** argv, const SampleInfo& info);

// The agent settings the command line asks for (the db is replaced if it exists).
AgentOptions agent_options(const SampleArgs& args);

// What main() returns when something it cannot recover from was thrown (the agent could
// not create its run.db, say): one line on stderr, exit code 2, never an abort.
int exit_with_error(const char* argv0, const std::exception& e);

// fp16 autocast on the CPU for its lifetime (the C++ twin of torch.autocast("cpu")).
class CpuAutocast {
 public:
  explicit CpuAutocast(at::ScalarType dtype = at::kHalf);
  ~CpuAutocast();
  CpuAutocast(const CpuAutocast&) = delete;
  CpuAutocast& operator=(const CpuAutocast&) = delete;

 private:
  bool was_enabled_;
  at::ScalarType was_dtype_;
};

// Tracks the run and prints what a user would want to see at the end.
class RunSummary {
 public:
  void step(double loss, bool skipped, double scale);
  void print(const SampleInfo& info, const SampleArgs& args, const Agent& agent) const;

 private:
  std::int64_t steps_ = 0, skipped_ = 0, nonfinite_losses_ = 0;
  double first_loss_ = 0, last_loss_ = 0, last_scale_ = 0, min_scale_ = 0;
};

}  // namespace ampdiag::samples
