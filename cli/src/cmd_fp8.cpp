// ampdiag fp8: which layers' gradients and modules' outputs would fit FP8 (E4M3, E5M2)
// under delayed scaling.
#include <cstdio>
#include <stdexcept>

#include "ampdiag/analyzer/fp8.h"
#include "commands.h"
#include "table_output.h"
#include "terminal.h"

namespace ampdiag::cli {

namespace {

constexpr const char* kHelp = R"(usage: ampdiag fp8 RUN.db [options]

FP8 readiness per layer (gradients) and per module (activations: the module's output),
from the exponent histograms the agent records with attach(..., histogram=True) or
AgentOptions::histogram: under per-tensor delayed scaling (each step's scale is the power
of two that puts the largest |x| of the previous N steps in the format's top binade), the
share of each tensor's values that E4M3 (max 448, normal from 2^-6) and E5M2 (max 57344,
normal from 2^-14) hold in their normal range, the shares below it (subnormal or zero)
and above it (clipped), the steps whose largest value the scale did not cover, and
whether it fits. Least E5M2-ready first. Text prints the gradients' table, then the
activations'; CSV and JSON one table whose `tensor` column says which.

options:
  --history N      steps of amax history (default 16)
  --margin B       scale B binades lower than the amax allows (default 0)
  --fit-share X    a layer fits when at least this share of its values is normal (default 0.99)
  --top N          only the first N layers and the first N modules
  --format F       text (default), csv or json (--csv for csv)
  -o, --output F   write there instead of stdout
  --allow-partial  read a run.db still being written, or whose process died
)";

std::string pct(double share) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f", 100 * share);
  return b;
}

}  // namespace

int cmd_fp8(int argc, char** argv) {
  const Args args(argc, argv, {"--history", "--margin", "--fit-share", "--top", "--format", "-o", "--output"},
                  {"--csv", "--allow-partial"});
  if (args.help()) {
    std::fputs(kHelp, stdout);
    return 0;
  }
  if (args.positionals().size() != 1) throw UsageError("give exactly one run.db (see --help)");
  analyzer::Fp8Options o;
  o.history = args.integer("--history", o.history, 1, 1000000);
  o.margin_bits = int(args.integer("--margin", o.margin_bits, 0, 32));
  o.fit_share = args.number("--fit-share", o.fit_share, 0.0, 1.0);
  const long long top = args.integer("--top", 0, 0, 1LL << 40);
  const std::string format = table_format(args);
  const auto runs = load_runs(args.positionals(), args.flag("--allow-partial"), 0);
  analyzer::Fp8Readiness r;
  try {
    r = analyzer::fp8_readiness(runs.front(), o);
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
  if (!r.histograms)
    throw UsageError(runs.front().path +
                     " has no exponent histograms: record the run with attach(..., histogram=True) "
                     "(C++: AgentOptions::histogram = true)");
  // One table's rows: the first --top of `all`, after `lead` (the tensor column, or none).
  using Table = std::vector<std::vector<std::string>>;
  const auto add_rows = [&](Table& table, std::vector<std::string> lead, const std::vector<analyzer::Fp8Layer>& all) {
    for (std::size_t i = 0; i < all.size() && (top == 0 || i < std::size_t(top)); ++i) {
      const auto& l = all[i];
      std::vector<std::string> cells = lead;
      for (std::string cell : {l.name, std::to_string(l.steps), pct(l.shares[0].normal), pct(l.shares[0].below),
                               pct(l.shares[0].above), std::to_string(l.saturated_steps[0]), pct(l.shares[1].normal),
                               pct(l.shares[1].below), pct(l.shares[1].above), std::to_string(l.saturated_steps[1])})
        cells.push_back(std::move(cell));
      cells.push_back(l.fits[0] ? "E4M3, E5M2" : (l.fits[1] ? "E5M2" : "neither"));
      table.push_back(std::move(cells));
    }
  };
  // The header: `lead` (tensor and name, or in text `layer` / `module`), then the statistics.
  const auto header = [](std::vector<std::string> lead) {
    for (const char* column : {"steps", "e4m3_normal_pct", "e4m3_below_pct", "e4m3_above_pct", "e4m3_saturated_steps",
                               "e5m2_normal_pct", "e5m2_below_pct", "e5m2_above_pct", "e5m2_saturated_steps", "fits"})
      lead.push_back(column);
    return Table{lead};
  };
  std::string text;
  if (format != "text") {
    Table table = header({"tensor", "name"});
    add_rows(table, {"gradient"}, r.layers);
    add_rows(table, {"activation"}, r.activations);
    text = render_table(table, format);
  } else {
    // One table per kind, without the tensor column its heading already names.
    const auto section = [&](bool gradients, const std::vector<analyzer::Fp8Layer>& all,
                             const std::vector<std::string>& unjudged) {
      Table table = header({gradients ? "layer" : "module"});
      add_rows(table, {}, all);
      std::size_t fit[2] = {};
      for (const auto& l : all) fit[0] += l.fits[0], fit[1] += l.fits[1];
      char head[256];
      std::snprintf(head, sizeof head,
                    "%s: %zu of %zu %s fit E4M3 and %zu fit E5M2 (at least %.3g %% of their values in the normal "
                    "range; delayed scaling over %lld steps, margin %d)\n\n",
                    gradients ? "Gradients" : "Activations (module outputs)", fit[0], all.size(),
                    gradients ? "layers" : "modules", fit[1], 100 * o.fit_share, static_cast<long long>(o.history), o.margin_bits);
      std::string never;
      if (!unjudged.empty()) {
        never = std::to_string(unjudged.size()) + (gradients ? " more layers" : " more modules") +
                " had histograms but never a finite, non-zero " + (gradients ? "gradient" : "output") + " to judge:";
        for (std::size_t i = 0; i < unjudged.size() && i < 8; ++i) never += (i ? ", " : " ") + unjudged[i];
        never += unjudged.size() > 8 ? ", ...\n\n" : "\n\n";
      }
      return head + never + render_table(table, "text");
    };
    text = section(true, r.layers, r.unjudged_layers) + "\n";
    if (r.activation_histograms)
      text += section(false, r.activations, r.unjudged_modules);
    else
      text += "Activations: no histograms recorded (the run probed no forward, attach(..., activations=False), or an "
              "older ampdiag wrote it)\n";
  }
  write_output(output_path(args), text);
  return 0;
}

}  // namespace ampdiag::cli
