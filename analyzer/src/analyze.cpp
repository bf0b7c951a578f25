// analyze(): runs every rule on every rank, merges what the ranks agree on, ranks the
// findings and explains every skipped step.
#include "ampdiag/analyzer/analyze.h"

#include <algorithm>
#include <cmath>
#include <map>

#include "rules.h"

namespace ampdiag::analyzer {

const char* severity_name(Severity s) {
  switch (s) {
    case Severity::kInfo: return "info";
    case Severity::kWarning: return "warning";
    case Severity::kError: return "error";
  }
  return "unknown";
}

bool Report::healthy() const {
  for (const auto& f : findings)
    if (f.severity != Severity::kInfo) return false;
  return true;
}

const std::vector<std::string>& rule_ids() {
  static const std::vector<std::string> ids = {"scale-collapse", "overflow-origin", "forward-nonfinite", "low-headroom",
                                               "underflow",      "skip-rate",       "rank-disagreement"};
  return ids;
}

Report analyze(const std::vector<Run>& runs, const Thresholds& t) {
  Report report;
  std::vector<Finding> all;
  for (const auto& run : runs) {
    std::vector<Finding> found;
    rules::scale_collapse(run, t, found);
    rules::overflow_origin(run, t, found);
    rules::forward_nonfinite(run, t, found);
    rules::low_headroom(run, t, found);
    rules::underflow(run, t, found);
    rules::skip_rate(run, t, found);
    for (auto& f : found) {
      f.ranks = {run.rank};
      all.push_back(std::move(f));
    }

    RunOverview o;
    o.path = run.path;
    o.rank = run.rank;
    o.steps = std::int64_t(run.steps.size());
    o.calibration_skips = rules::calibration_skips(run);
    o.first_scale = run.steps.front().row.scale_before;
    o.last_scale = run.steps.back().row.scale_after;
    o.min_scale = INFINITY;
    for (const auto& s : run.steps) {
      o.skipped += s.row.skipped;
      o.min_scale = std::min(o.min_scale, s.row.scale_after);
      if (!s.row.skipped) continue;
      SkippedStep k;
      k.rank = run.rank;
      k.step = s.row.step;
      k.scale = s.row.scale_before;
      k.loss = s.row.loss;
      k.nonfinite_layer_count = std::int64_t(s.nonfinite_layers.size());
      for (std::size_t i = 0; i < s.nonfinite_layers.size() && i < 5; ++i)
        k.nonfinite_layers.push_back(run.layers[std::size_t(s.nonfinite_layers[i])].info.name);
      if (s.first_nonfinite_module >= 0)
        k.forward_module = rules::forward_culprit(run, run.modules[std::size_t(s.first_nonfinite_module)].info.path);
      report.skipped.push_back(k);
    }
    o.layers = std::int64_t(run.layers.size());
    o.modules = std::int64_t(run.modules.size());
    o.grad_rows = run.grad_rows;
    o.act_rows = run.act_rows;
    o.finished = run.finished;
    o.amp_dtype = run.meta_or("amp_dtype", "float16");
    o.device = run.meta_or("device", "");
    report.runs.push_back(o);
  }
  rules::rank_disagreement(runs, t, all);

  // The same finding on several ranks is one finding seen on those ranks.
  std::map<std::string, std::size_t> seen;
  for (auto& f : all) {
    const std::string key = f.rule + "|" + f.module + "|" + f.layer + "|" + f.title;
    const auto it = seen.find(f.rule == "rank-disagreement" ? key + std::to_string(f.ranks.front()) : key);
    if (it == seen.end()) {
      seen[f.rule == "rank-disagreement" ? key + std::to_string(f.ranks.front()) : key] = report.findings.size();
      report.findings.push_back(std::move(f));
    } else {
      Finding& kept = report.findings[it->second];
      kept.ranks.insert(kept.ranks.end(), f.ranks.begin(), f.ranks.end());
      kept.score = std::max(kept.score, f.score);
    }
  }
  // Culprits (findings that name a module or layer) before symptoms of the same severity.
  std::stable_sort(report.findings.begin(), report.findings.end(), [](const Finding& a, const Finding& b) {
    if (a.severity != b.severity) return a.severity > b.severity;
    const bool a_names = !a.module.empty() || !a.layer.empty(), b_names = !b.module.empty() || !b.layer.empty();
    if (a_names != b_names) return a_names;
    return a.score > b.score;
  });
  return report;
}

}  // namespace ampdiag::analyzer
