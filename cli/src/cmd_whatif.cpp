// ampdiag whatif: the run's gradient magnitudes replayed through another loss scaler.
#include <cstdio>
#include <stdexcept>

#include "ampdiag/analyzer/json.h"
#include "ampdiag/analyzer/whatif.h"
#include "commands.h"
#include "table_output.h"
#include "terminal.h"

namespace ampdiag::cli {

namespace {

constexpr const char* kHelp = R"(usage: ampdiag whatif RUN.db [options]

Replays the run's recorded gradient magnitudes (the largest finite |g| of each step,
divided by the loss scale it ran at) through another torch.amp.GradScaler configuration,
and predicts its skipped steps and scale trajectory. Steps that overflowed when recorded
are censored (their magnitude is only known to be above the range) and steps recorded
without statistics are known only on one side: where that decides a step, the prediction
is a range, with the steps that make it. Options not given keep the run's own settings;
with none of them, a small grid is searched and the best configuration recommended if it
does better than the recorded one (fewer skips once the scale has come down from
init_scale to where the gradients fit; as many, with less underflow or a lower
pessimistic bound), else keeping the recorded one.

options:
  --init-scale S        initial loss scale
  --growth-factor G     scale multiplier after growth-interval steps without overflow
  --backoff-factor B    scale multiplier after an overflow
  --growth-interval N   steps without overflow before the scale grows
  --min-scale M         never back off below M (not a torch option; 0: no floor)
  --format F            text (default) or json
  -o, --output FILE     write there instead of stdout
  --allow-partial       replay a run.db still being written, or whose process died
)";

using analyzer::json::number;
using analyzer::json::quote;

std::string num(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%g", v);
  return b;
}

std::string range(std::int64_t lo, std::int64_t hi) {
  return lo == hi ? std::to_string(lo) : std::to_string(lo) + " to " + std::to_string(hi);
}

std::string range(double lo, double hi) { return lo == hi ? num(lo) : num(lo) + " to " + num(hi); }

std::string steps_list(const std::vector<std::int64_t>& steps) {
  std::string s;
  for (std::size_t i = 0; i < steps.size() && i < 8; ++i) s += (i ? ", " : "") + std::to_string(steps[i]);
  if (steps.size() > 8) s += ", ...";
  return s;
}

std::string prediction_text(const analyzer::WhatIf& w) {
  std::string s = "  skipped steps: " + std::to_string(w.estimate.skipped);
  if (!w.uncertain_steps.empty())
    s += " (bounds " + range(w.optimistic.skipped, w.pessimistic.skipped) + ": the recording cannot tell steps " +
         steps_list(w.uncertain_steps) + ")";
  if (w.estimate.calibration > 0)
    s += "\n  of them, coming down from init_scale until the gradients fit (once a run): " +
         std::to_string(w.estimate.calibration);
  s += "\n  loss scale: lowest " + num(w.estimate.lowest_scale) + ", final " + num(w.estimate.final_scale);
  if (!w.uncertain_steps.empty())
    s += " (bounds: lowest " + range(w.pessimistic.lowest_scale, w.optimistic.lowest_scale) + ", final " +
         range(w.pessimistic.final_scale, w.optimistic.final_scale) + ")";
  if (w.underflow >= 0) {
    char share[32];
    std::snprintf(share, sizeof share, "%.3g %%", 100 * w.underflow);
    s += std::string("\n  flushed to zero in fp16: ") + share + " of the recorded non-zero gradient values";
  }
  return s + "\n";
}

std::string prediction_json(const analyzer::WhatIf& w) {
  std::string uncertain;
  for (std::size_t i = 0; i < w.uncertain_steps.size(); ++i) uncertain += (i ? ", " : "") + number(w.uncertain_steps[i]);
  return "{\"config\": {\"init_scale\": " + number(w.config.init_scale) + ", \"growth_factor\": " +
         number(w.config.growth_factor) + ", \"backoff_factor\": " + number(w.config.backoff_factor) +
         ", \"growth_interval\": " + number(w.config.growth_interval) + ", \"min_scale\": " + number(w.config.min_scale) +
         "}, \"estimate\": {\"skipped\": " + number(w.estimate.skipped) +
         ", \"calibration_skipped\": " + number(w.estimate.calibration) + ", \"lowest_scale\": " +
         number(w.estimate.lowest_scale) + ", \"final_scale\": " + number(w.estimate.final_scale) +
         "}, \"skipped\": [" + number(w.optimistic.skipped) + ", " + number(w.pessimistic.skipped) +
         "], \"lowest_scale\": [" + number(w.pessimistic.lowest_scale) + ", " + number(w.optimistic.lowest_scale) +
         "], \"final_scale\": [" + number(w.pessimistic.final_scale) + ", " + number(w.optimistic.final_scale) +
         "], \"uncertain_steps\": [" + uncertain + "], \"underflow_share\": " +
         (w.underflow >= 0 ? number(w.underflow) : std::string("null")) + "}";
}

}  // namespace

int cmd_whatif(int argc, char** argv) {
  const Args args(argc, argv,
                  {"--init-scale", "--growth-factor", "--backoff-factor", "--growth-interval", "--min-scale", "--format",
                   "-o", "--output"},
                  {"--allow-partial"});
  if (args.help()) {
    std::fputs(kHelp, stdout);
    return 0;
  }
  if (args.positionals().size() != 1) throw UsageError("give one run.db (see --help)");
  const std::string format = args.choice("--format", "text", {"text", "json"});
  const std::string out = output_path(args);
  const auto runs = load_runs(args.positionals(), args.flag("--allow-partial"), 0);
  const analyzer::Run& run = runs.front();
  const analyzer::ScalerConfig recorded = analyzer::recorded_config(run);
  const bool search = !(args.has("--init-scale") || args.has("--growth-factor") || args.has("--backoff-factor") ||
                        args.has("--growth-interval") || args.has("--min-scale"));
  analyzer::ScalerConfig asked = recorded;
  asked.init_scale = args.number("--init-scale", recorded.init_scale, 1e-30, 1e38);
  asked.growth_factor = args.number("--growth-factor", recorded.growth_factor, 1.0, 1e6);
  asked.backoff_factor = args.number("--backoff-factor", recorded.backoff_factor, 0.0, 1.0);
  asked.growth_interval = args.integer("--growth-interval", recorded.growth_interval, 1, 1000000000);
  asked.min_scale = args.number("--min-scale", 0.0, 0.0, 1e38);
  // The underflow share needs each step's exponent histograms (attach(histogram=True)).
  analyzer::StepHistograms histograms;
  if (run.meta_or("histogram", "0") == "1") histograms = analyzer::read_step_histograms(run.path);
  const analyzer::StepHistograms* hist = histograms.empty() ? nullptr : &histograms;
  std::vector<analyzer::WhatIf> predictions;
  analyzer::WhatIf as_recorded;
  try {  // a run without a scaler (bf16), a bad setting
    as_recorded = analyzer::what_if(run, recorded, hist);
    predictions = search ? analyzer::search_configs(run, hist)
                         : std::vector<analyzer::WhatIf>{analyzer::what_if(run, asked, hist)};
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
  const std::int64_t skipped = analyzer::recorded_skips(run);

  std::string text;
  if (format == "json") {
    text = "{\"run\": " + quote(run.path) + ", \"steps\": " + number(as_recorded.steps) + ", \"recorded\": {\"skipped\": " +
           number(skipped) + ", \"replayed\": " + prediction_json(as_recorded) + "}, \"known\": {\"always_skipped\": " +
           number(as_recorded.always_skipped) + ", \"censored\": " + number(as_recorded.censored) +
           ", \"unrecorded\": " + number(as_recorded.unrecorded) + "}, \"searched\": " + (search ? "true" : "false") +
           ", \"improves_on_recorded\": " + (analyzer::recommends(run, predictions.front(), as_recorded) ? "true" : "false") +
           ", \"predictions\": [";
    for (std::size_t i = 0; i < predictions.size(); ++i) text += (i ? ", " : "") + prediction_json(predictions[i]);
    text += "]}\n";
  } else {
    text = run.path + ": " + std::to_string(as_recorded.steps) + " steps recorded with " + recorded.describe() + ": " +
           std::to_string(skipped) + " skipped.\n";
    text += "What the recording tells: " + std::to_string(as_recorded.always_skipped) +
            " steps NaN/Inf whatever the scale (in forward, the loss's backward or the parameters), " + std::to_string(as_recorded.censored) +
            " overflowed (only a lower bound on their gradients), " + std::to_string(as_recorded.unrecorded) +
            " finite without statistics (sampling).\n";
    if (!hist) text += "No exponent histograms were recorded (attach(histogram=True)): no underflow prediction.\n";
    else if (as_recorded.underflow >= 0)
      text += "As recorded, " + num(100 * as_recorded.underflow) + " % of the non-zero gradient values were below fp16's range.\n";
    if (search) {
      text += "\nSearched " + std::to_string(predictions.size()) + " configurations; the best first:\n";
      for (std::size_t i = 0; i < predictions.size() && i < 5; ++i)
        text += "\n" + predictions[i].config.describe() + ":\n" + prediction_text(predictions[i]);
      text += "\nRecommended: " + analyzer::recommendation(run, predictions.front(), as_recorded, predictions.size()) + "\n";
    } else {
      text += "\n" + asked.describe() + ":\n" + prediction_text(predictions.front());
    }
  }
  write_output(out, text);
  return 0;
}

}  // namespace ampdiag::cli
