// ampdiag report: the analysis in any of five formats, and the CI gate.
#include <cstdio>
#include <string>

#include "ampdiag/analyzer/analyze.h"
#include "ampdiag/analyzer/fp8.h"
#include "ampdiag/analyzer/render.h"
#include "commands.h"
#include "table_output.h"
#include "terminal.h"

namespace ampdiag::cli {

namespace {

constexpr const char* kHelp = R"(usage: ampdiag report RUN.db [RUN.db ...] [options]

The unstable layers first, each with evidence (steps, numbers) and a copy-paste fix; then
every skipped optimizer step and its cause. Several files are the ranks of one run.

options:
  --format F              text (default), json, markdown, junit, html
  -o, --output FILE       write there instead of stdout (html: a self-contained page)
  --fail-on SPEC          exit 1 when findings fail the gate: error (default: any error),
                          all (any warning or error), none, or rule ids, comma-separated:
@RULES@
  --scale-floor X         scale-collapse below this loss scale (default 128)
  --backoff-run N         scale-collapse after N back-offs without recovering (default 8)
  --headroom-bits X       low-headroom within X bits of the largest value (default 1)
  --headroom-fraction X   ...in at least this share of sampled steps (default 0.5)
  --underflow-fraction X  underflow when zeros + fp16 subnormals exceed this share (default 0.5)
  --skip-rate X           skip-rate above this share of steps that were not calibration (default 0.10)
  --rank-bits X           rank-disagreement beyond X bits of abs-max (default 4)
  --stalled-fraction X    stalled-updates above this share of a layer's updates rounding away (default 0.5)
  --precision-error X     precision-loss from this relative error against FP32 (default 0.1)
  --allow-partial         report on a run.db still being written, or whose process died
  --threads N             threads reading the file (default: all cores)
  --color WHEN            auto (default), always, never
)";

// kHelp with the rule ids the gate accepts (analyzer::rule_ids), wrapped under --fail-on.
std::string help() {
  const std::string indent(26, ' ');
  std::string rules, line = indent;
  const auto& ids = analyzer::rule_ids();
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const std::string word = ids[i] + (i + 1 < ids.size() ? "," : " (docs/ANALYZER.md)");
    if (line.size() > indent.size() && line.size() + 1 + word.size() > 92) {
      rules += line + "\n";
      line = indent;
    }
    line += (line.size() > indent.size() ? " " : "") + word;
  }
  rules += line;
  std::string text = kHelp;
  text.replace(text.find("@RULES@"), 7, rules);
  return text;
}

}  // namespace

int cmd_report(int argc, char** argv) {
  const Args args(argc, argv,
                  {"--format", "-o", "--output", "--fail-on", "--scale-floor", "--backoff-run", "--headroom-bits",
                   "--headroom-fraction", "--underflow-fraction", "--skip-rate", "--rank-bits", "--stalled-fraction",
                   "--precision-error",
                   "--threads", "--color"},
                  {"--allow-partial"});
  if (args.help()) {
    std::fputs(help().c_str(), stdout);
    return 0;
  }
  if (args.positionals().empty()) throw UsageError("give at least one run.db (see --help)");
  const std::string format = args.choice("--format", "text", {"text", "json", "markdown", "junit", "html"});
  const analyzer::Gate gate = [&] {
    try {
      return analyzer::Gate(args.value("--fail-on", "error"));
    } catch (const std::invalid_argument& e) {
      throw UsageError(e.what());
    }
  }();
  analyzer::Thresholds t;
  t.scale_floor = args.number("--scale-floor", t.scale_floor, 0.0, 1e38);
  t.backoff_run = args.integer("--backoff-run", t.backoff_run, 1, 1000000);
  t.headroom_bits = args.number("--headroom-bits", t.headroom_bits, 0.0, 64.0);
  t.headroom_fraction = args.number("--headroom-fraction", t.headroom_fraction, 0.0, 1.0);
  t.underflow_fraction = args.number("--underflow-fraction", t.underflow_fraction, 0.0, 1.0);
  t.skip_rate = args.number("--skip-rate", t.skip_rate, 0.0, 1.0);
  t.rank_bits = args.number("--rank-bits", t.rank_bits, 0.0, 128.0);
  t.stalled_fraction = args.number("--stalled-fraction", t.stalled_fraction, 0.0, 1.0);
  t.precision_error = args.number("--precision-error", t.precision_error, 0.0, 100.0);
  const bool color = use_color(args);
  const std::string out = output_path(args);
  const int threads = int(args.integer("--threads", 0, 0, 256));

  const auto runs = load_runs(args.positionals(), args.flag("--allow-partial"), threads);
  for (const auto& run : runs)
    if (!run.finished)
      std::fprintf(stderr, "ampdiag report: %s is not finished: this report covers the %zu %s written so far\n",
                   run.path.c_str(), run.steps.size(), run.steps.size() == 1 ? "step" : "steps");
  analyzer::Report report = analyzer::analyze(runs, t);
  analyzer::add_fp8_overview(report, runs);
  std::string text;
  if (format == "json") text = analyzer::render_json(report, gate);
  else if (format == "markdown") text = analyzer::render_markdown(report, gate);
  else if (format == "junit") text = analyzer::render_junit(report, gate);
  else if (format == "html") text = analyzer::render_html(report, gate, runs);
  else {
    analyzer::RenderOptions o;
    o.color = color && out.empty();
    text = analyzer::render_text(report, gate, o);
  }
  write_output(out, text);
  return gate.fails(report) ? 1 : 0;
}

}  // namespace ampdiag::cli
