// What the C++ samples share: their command line, an autocast scope, and the summary
// they print. Each sample is a real LibTorch training loop with fp16 autocast (on the CPU,
// or on CUDA with --device cuda), ampdiag::GradScaler and the agent.
#pragma once

#include <ATen/autocast_mode.h>
#include <c10/core/Device.h>

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
  c10::Device device = c10::kCPU;    // --device cpu|cuda|cuda:N (the CPU when CUDA has no device)
};

struct SampleInfo {
  const char* name;                  // program name
  const char* what;                  // one line: the failure it reproduces
  const char* default_db;
  std::int64_t default_steps;
  std::vector<std::string> pinnable; // module paths --pin-fp32 accepts
};

// Parses argv; prints usage and exits 0 for --help, 2 for a bad argument. --device cuda
// on a machine without a CUDA device says so in one line and runs on the CPU.
SampleArgs parse_sample_args(int argc, char** argv, const SampleInfo& info);

// The agent settings the command line asks for (the db is replaced if it exists).
AgentOptions agent_options(const SampleArgs& args);

// What main() returns when something it cannot recover from was thrown (the agent could
// not create its run.db, say): one line on stderr, exit code 2, never an abort.
int exit_with_error(const char* argv0, const std::exception& e);

// Autocast to `dtype` on `device`'s type for its lifetime (the C++ twin of torch.autocast).
class Autocast {
 public:
  Autocast(c10::Device device, at::ScalarType dtype = at::kHalf);
  ~Autocast();
  Autocast(const Autocast&) = delete;
  Autocast& operator=(const Autocast&) = delete;

 private:
  c10::DeviceType type_;
  bool was_enabled_;
  at::ScalarType was_dtype_;
};

// Tracks the run and prints what a user would want to see at the end. The per-step loss
// and scale stay on their device until print(): a CUDA sample never waits for the device
// on its own account.
class RunSummary {
 public:
  void step(const at::Tensor& loss, bool skipped, const GradScaler& scaler);
  void print(const SampleInfo& info, const SampleArgs& args, const Agent& agent) const;

 private:
  std::vector<at::Tensor> losses_, scales_;
  std::int64_t skipped_ = 0;
};

}  // namespace ampdiag::samples
