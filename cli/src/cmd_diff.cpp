// ampdiag diff: what got worse from one run to the next (exit 1 on a regression).
#include <cmath>
#include <cstdio>
#include <map>
#include <set>

#include "ampdiag/analyzer/analyze.h"
#include "ampdiag/analyzer/escape.h"
#include "ampdiag/analyzer/json.h"
#include "ampdiag/analyzer/render.h"
#include "commands.h"
#include "table_output.h"
#include "terminal.h"

namespace ampdiag::cli {

namespace {

constexpr const char* kHelp = R"(usage: ampdiag diff BASE.db NEW.db [options]

Compares NEW with BASE and lists regressions: findings NEW has that BASE does not, a
higher skip rate, a lower loss scale, layers that lost headroom. Exit 1 when there is a
regression, 0 when there is none.

options:
  --skip-rate-delta X   a regression when the skip rate rises by more than X (default 0.05)
  --headroom-delta X    a regression when a layer's gradient grows by more than X bits, i.e. it
                        leaves the loss scale that much less room (default 2)
  --format F            text (default) or json
  -o, --output FILE     write there instead of stdout
  --allow-partial       read run.db files still being written
)";

std::string json_list(const std::vector<std::string>& items) {
  std::string o = "[";
  for (std::size_t i = 0; i < items.size(); ++i) o += (i ? ", " : "") + analyzer::json::quote(items[i]);
  return o + "]";
}

// Per layer, the least headroom with the loss scale taken out: log2(fp_max * scale /
// absmax), the scale the layer could take. A run whose scale grew is not a regression.
std::map<std::string, double> least_unscaled_headroom(const analyzer::Run& run) {
  std::map<std::int64_t, double> scale;
  for (const auto& s : run.steps) scale[s.row.step] = s.row.scale_before;
  std::map<std::string, double> out;
  for (const auto& l : run.layers) {
    double least = INFINITY;
    for (const auto& s : l.samples) {
      const auto it = scale.find(s.step);
      if (s.nonfinite || !(s.absmax > 0) || it == scale.end() || !(it->second > 0)) continue;
      least = std::min(least, analyzer::headroom_bits(s.absmax, run.fp_max) + std::log2(it->second));
    }
    out[l.info.name] = least;
  }
  return out;
}

}  // namespace

int cmd_diff(int argc, char** argv) {
  const Args args(argc, argv, {"--skip-rate-delta", "--headroom-delta", "--format", "-o", "--output"}, {"--allow-partial"});
  if (args.help()) {
    std::fputs(kHelp, stdout);
    return 0;
  }
  if (args.positionals().size() != 2) throw UsageError("give BASE.db and NEW.db (see --help)");
  const double skip_delta = args.number("--skip-rate-delta", 0.05, 0.0, 1.0);
  const double headroom_delta = args.number("--headroom-delta", 2.0, 0.0, 64.0);
  const std::string format = args.choice("--format", "text", {"text", "json"});
  const auto base_runs = load_runs({args.positionals()[0]}, args.flag("--allow-partial"), 0);
  const auto new_runs = load_runs({args.positionals()[1]}, args.flag("--allow-partial"), 0);
  const auto base = analyzer::analyze(base_runs), now = analyzer::analyze(new_runs);

  std::vector<std::string> regressions, improvements;
  std::set<std::string> base_keys, new_keys;
  auto key = [](const analyzer::Finding& f) { return f.rule + " " + (f.module.empty() ? f.layer : f.module); };
  for (const auto& f : base.findings) base_keys.insert(key(f));
  for (const auto& f : now.findings) {
    new_keys.insert(key(f));
    if (f.severity != analyzer::Severity::kInfo && !base_keys.count(key(f)))
      regressions.push_back("new " + std::string(analyzer::severity_name(f.severity)) + " [" + f.rule + "] " + f.title);
  }
  for (const auto& f : base.findings)
    if (!new_keys.count(key(f))) improvements.push_back("gone: [" + f.rule + "] " + f.title);
  // The report's skip rate: skipped steps that are neither calibration nor growth probes.
  const double base_skip = base.runs.front().skip_rate, new_skip = now.runs.front().skip_rate;
  char line[256];
  if (new_skip > base_skip + skip_delta) {
    std::snprintf(line, sizeof line, "skip rate %.1f%% -> %.1f%%", base_skip * 100, new_skip * 100);
    regressions.push_back(line);
  }
  if (now.runs.front().min_scale < base.runs.front().min_scale / 2) {
    std::snprintf(line, sizeof line, "lowest loss scale %g -> %g", base.runs.front().min_scale, now.runs.front().min_scale);
    regressions.push_back(line);
  }
  const auto base_h = least_unscaled_headroom(base_runs.front()), new_h = least_unscaled_headroom(new_runs.front());
  for (const auto& [name, h] : new_h) {
    const auto b = base_h.find(name);
    if (b == base_h.end() || !std::isfinite(b->second) || !std::isfinite(h)) continue;
    if (h < b->second - headroom_delta) {
      std::snprintf(line, sizeof line, ": gradient grew, room for the loss scale %.1f -> %.1f bits", b->second, h);
      regressions.push_back(name + line);
    }
  }
  std::string out;
  if (format == "json") {
    out = "{\"regression\": " + std::string(regressions.empty() ? "false" : "true") +
          ", \"regressions\": " + json_list(regressions) + ", \"improvements\": " + json_list(improvements) + "}\n";
  } else {
    out = analyzer::printable(args.positionals()[1] + " vs " + args.positionals()[0]) + ": " +
          (regressions.empty() ? "no regression" : std::to_string(regressions.size()) + (regressions.size() == 1 ? " regression" : " regressions")) + "\n";
    for (const auto& r : regressions) out += "  worse:  " + analyzer::printable(r) + "\n";
    for (const auto& r : improvements) out += "  better: " + analyzer::printable(r) + "\n";
  }
  write_output(output_path(args), out);
  return regressions.empty() ? 0 : 1;
}

}  // namespace ampdiag::cli
