// FP8 readiness per layer and module: under per-tensor delayed scaling (each step's scale
// from the largest |x| of the previous `history` steps, the usual FP8 recipe), which share
// of each gradient's and each module output's values E4M3 (max 448) and E5M2 (max 57344)
// would hold in their normal range, and which would not fit. Computed from the exponent histograms the agent records
// with histogram=True, one binade at a time. docs/ANALYZER.md has the model.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ampdiag/analyzer/findings.h"
#include "ampdiag/analyzer/run.h"

namespace ampdiag::analyzer {

struct Fp8Format {
  const char* name;
  double max;          // largest finite value
  int min_normal_exp;  // smallest normal value is 2^min_normal_exp
};
constexpr Fp8Format kE4M3{"E4M3", 448.0, -6};
constexpr Fp8Format kE5M2{"E5M2", 57344.0, -14};

struct Fp8Options {
  std::int64_t history = 16;  // steps of amax history the scale is taken from
  int margin_bits = 0;        // scale lowered by this many binades below what the amax allows
  double fit_share = 0.99;    // a layer fits when this share of its values is in the normal range
  void check() const;         // throws std::invalid_argument naming the option
};

// Shares of a tensor's finite non-zero values (0..1), as recorded.
struct Fp8Shares {
  double normal = 0, below = 0, above = 0;  // in the normal range; under it (subnormal or zero); over the max
};

// One layer's gradient or one module's output.
struct Fp8Layer {
  std::string name;                  // the layer, or the module's path
  std::int64_t steps = 0;            // finite steps with a histogram
  std::int64_t saturated_steps[2] = {};  // steps whose |g| exceeded the format's max (E4M3, E5M2)
  Fp8Shares shares[2];               // E4M3, E5M2
  bool fits[2] = {};
};

struct Fp8Readiness {
  Fp8Options options;
  bool histograms = false;       // the run recorded them (else nothing can be said)
  std::vector<Fp8Layer> layers;  // gradients: least E5M2 normal share first, then least E4M3
  // Activations (module outputs, forward values: no loss scale), in the same order; the
  // agent records their histograms with the gradients' when it probes the forward (files
  // from before it did have none).
  bool activation_histograms = false;
  std::vector<Fp8Layer> activations;
  // Recorded with histograms, but never finite (every row held NaN or Inf, or was all
  // zeros): nothing to judge.
  std::vector<std::string> unjudged_layers, unjudged_modules;
};

// Reads the per-step histograms of `run`'s file (run.path), streaming.
Fp8Readiness fp8_readiness(const Run& run, const Fp8Options& options = {});

// The readiness in brief for each of the report's runs that recorded histograms (the same
// run order as analyze() was given): the report's FP8 lines. Reads each file once more.
void add_fp8_overview(Report& report, const std::vector<Run>& runs, const Fp8Options& options = {});

}  // namespace ampdiag::analyzer
