// Following a run.db while a training process writes it: what a read of the file adds to
// a Run, read without the Run (on a background thread, say) and merged into it after.
// load_run is itself one read from an empty cursor and one merge, so a Run that follows a
// file holds what load_run would have read from it (tests/analyzer/test_run_delta.cpp).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "ampdiag/analyzer/run.h"

namespace ampdiag::analyzer {

// What one reader of grad_stats or grad_samples gathered (the merge adds them up).
struct GradPart {
  std::vector<std::vector<GradSample>> samples;                // by layer, in the order read
  std::vector<std::pair<double, std::int64_t>> least_nonzero;  // by layer: (|g|, step); step -1: none
  std::vector<std::vector<std::uint64_t>> histogram;           // by layer, summed
  std::map<std::int64_t, StepOrder> order;                     // by step
  std::int64_t rows = 0;
  std::string error;  // a reader that failed: the merge never sees it (read_run_delta throws)
};

struct RunDelta {
  // The file asks to be read from the start again: steps were written below the cursor, it
  // lost rows, it holds another run now, or it has no summaries to read on from.
  bool reload = false;
  std::map<std::string, std::string> meta;
  bool finished = false;
  std::vector<rundb::StepRow> steps;       // rows from the first step read again (replacing) or new
  std::vector<rundb::LayerRow> layers;     // new layers
  std::vector<rundb::ModuleRow> modules;   // new modules
  std::vector<rundb::EventRow> events;     // all of them
  std::vector<rundb::ReplayRow> replays;   // all of them
  std::vector<rundb::PrecisionCheckRow> precision_checks;  // all of them
  std::vector<rundb::WeightNormRow> weight_norms;  // all of them
  std::vector<GradPart> grads;
  // Per layer, the exponent histograms of the finite rows read, summed (the merge adds
  // them to the layer's); empty: none.
  std::vector<std::vector<std::uint64_t>> histograms;
  // Activation rows: per module, steps with NaN/Inf output, steps it was the first such
  // module (forward order), the first such step and the module that finished just before
  // it there, its largest finite |output|, steps it finished last, its largest jump over
  // the modules before it, its place in the last full forward that ran it, its calls in the
  // forward where it was first (ModuleSummary);
  // and per step the first such module.
  struct ModuleDelta {
    std::int64_t nonfinite_steps = 0, first_nonfinite = 0, first_step = -1, before_first = -1, last_steps = 0;
    std::int64_t before_last = -1, position = -1;  // position -1: no full forward read ran it
    bool before_known = false;
    float max_absmax = 0.0f, jump_absmax = 0.0f, jump_before = 0.0f;
    double rms_sum = 0.0;       // per-element RMS of its finite outputs, summed over their rows
    std::int64_t rms_rows = 0;
    std::int64_t zero_step = -1, zero_numel = 0;  // as ModuleSummary's
    // Its calls in the first full forward read where it was first to go NaN/Inf, or more of
    // them where that forward began in an earlier read (calls 0: none).
    CallGrowth growth;
  };
  std::map<std::int64_t, ModuleDelta> module_stats;  // by module id
  std::map<std::int64_t, std::int64_t> first_nonfinite_module;  // by step
  std::int64_t act_rows = 0;
  RunCursor next;  // where the next read goes on (its pending maps are the merge's)
};

// Reads what `path` holds beyond `from` (all of it from RunCursor{}). `options` as for
// load_run; an unfinished file is read either way. Throws rundb::RunDbError for a file it
// cannot use; a delta with `reload` set holds nothing else.
RunDelta read_run_delta(const std::string& path, const RunCursor& from, const LoadOptions& options = {});

// Adds a delta read from `run.cursor` to the run.
void apply_run_delta(Run& run, RunDelta&& delta);

}  // namespace ampdiag::analyzer
