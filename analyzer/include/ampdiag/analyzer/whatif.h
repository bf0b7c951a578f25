// What-if loss-scaler replay: the recorded run's gradient magnitudes (the largest finite
// |g| per step, divided by the scale it was recorded at) run through another scaler
// configuration, predicting its skipped steps and scale trajectory.
//
// What is known of a step under scale s, recorded at scale S:
//   - its forward went NaN/Inf (a probed module, or a NaN/Inf loss): skipped at any scale;
//   - finite at S with statistics: its largest |g| is m * S, so it overflows iff m * s > max;
//   - finite at S without statistics (sampling): finite for s <= S, unknown above;
//   - overflowed at S (censored: m is only known to exceed max / S): overflows for s >= S,
//     unknown below.
// Unknown steps are resolved both ways: two replays bound the prediction. The estimate in
// between gives an unknown step the magnitude of the nearest recorded steps around it,
// kept within what the recording says of it (above max / S for an overflow, at most
// max / S for a finite step); a censored step with no larger neighbour is taken to be just
// above max / S (the smallest overflow consistent with it). Gradients are
// assumed not to depend on the scaler (the same data, the same weights up to the skipped
// updates), and only the parameters' gradients are seen: an overflow inside backward that
// leaves them finite is not (the prediction is then optimistic).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "ampdiag/analyzer/run.h"

namespace ampdiag::analyzer {

struct ScalerConfig {
  double init_scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  std::int64_t growth_interval = 2000;
  double min_scale = 0.0;  // a floor for back-offs (not torch's: some scalers have one); 0: none

  // Throws std::invalid_argument naming the bad setting (as torch's GradScaler checks them).
  void check() const;
  std::string describe() const;  // "init 65536, growth 2 every 2000, backoff 0.5"
};

// The configuration the run was recorded with (meta), torch's defaults where it says nothing.
ScalerConfig recorded_config(const Run& run);

// One bounding replay.
struct ScalerReplay {
  std::int64_t skipped = 0;
  // Of those, the back-offs of the scale's descent from init_scale to where the gradients
  // fit, once a run, as the report counts them (it does not count them against the run).
  std::int64_t calibration = 0;
  std::int64_t steady() const { return skipped - calibration; }
  double lowest_scale = 0.0, final_scale = 0.0;  // scale used by a step; after the last update
  std::vector<double> scales;                    // the scale each step ran at
  std::vector<bool> skips;
};

struct WhatIf {
  ScalerConfig config;
  std::int64_t steps = 0;
  ScalerReplay estimate;                 // unknown steps from their neighbours (see above)
  ScalerReplay optimistic, pessimistic;  // unknown steps finite / overflowing
  std::int64_t always_skipped = 0;       // forward NaN/Inf: skipped at any scale
  std::int64_t censored = 0;             // overflowed when recorded, so only bounded below
  std::int64_t unrecorded = 0;           // finite when recorded but without statistics
  // Steps whose outcome differs between the two replays: where the bounds come from.
  std::vector<std::int64_t> uncertain_steps;
  // With the exponent histograms (histogram=True): the share of the recorded finite non-zero
  // gradient values that the estimate's scales would flush to zero in fp16 (below 2^-25,
  // which rounds to 0), over the steps it does not skip; -1 when not known. Values already
  // zero when recorded are not counted (they have no exponent).
  double underflow = -1.0;
};

// Per step, the exponent histograms of its gradients summed over the layers (the
// rundb::kHistBins bins of finite non-zero values as recorded, at the step's scale).
using StepHistograms = std::map<std::int64_t, std::vector<std::uint64_t>>;
StepHistograms read_step_histograms(const std::string& path);

// Throws std::invalid_argument for a run without a loss scaler (bf16) or a bad config.
WhatIf what_if(const Run& run, const ScalerConfig& config, const StepHistograms* histograms = nullptr);

// A small grid of configurations around torch's defaults, best first: fewest estimated
// skips after the calibration, then the least underflow where known, then fewest in the
// pessimistic bound, then the fewest skips in all, then the highest lowest scale.
std::vector<WhatIf> search_configs(const Run& run, const StepHistograms* histograms = nullptr);

// Whether `candidate` does better than the run's own configuration replayed (`recorded`):
// fewer estimated skips, or as many with less underflow (both known) or fewer in the
// pessimistic bound. A higher lowest scale alone is no reason to change a scaler.
bool improves_on(const WhatIf& candidate, const WhatIf& recorded);

// Whether to recommend `best` over the recorded configuration: it improves on it, and the
// run's loss did not diverge (the replay takes the gradients as given; a loop whose
// gradients grew without bound is fixed in the loop, not the scaler).
bool recommends(const Run& run, const WhatIf& best, const WhatIf& recorded);

// What to do after a search whose best is `best`: its torch.amp.GradScaler call where it
// improves on `recorded`, else to keep the recorded configuration, and why.
std::string recommendation(const Run& run, const WhatIf& best, const WhatIf& recorded, std::size_t searched);

// The steps the run's own scaler skipped.
std::int64_t recorded_skips(const Run& run);

// The torch call that makes `c`: torch.amp.GradScaler("cpu", init_scale=..., ...).
std::string grad_scaler_call(const Run& run, const ScalerConfig& c);

// The what-if in brief, for the GUI: the recorded configuration's skips, the best of the
// grid (estimate, bounds, lowest scale) and its GradScaler call. Ranked without the
// histograms (by skips, then the bounds and the lowest scale). Empty for a run without a
// loss scaler.
std::vector<std::string> whatif_lines(const Run& run);

}  // namespace ampdiag::analyzer
