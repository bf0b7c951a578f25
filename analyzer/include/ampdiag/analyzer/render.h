// Renders a Report: text (terminal), JSON, Markdown, JUnit XML, self-contained HTML.
#pragma once

#include <set>
#include <string>
#include <vector>

#include "ampdiag/analyzer/findings.h"
#include "ampdiag/analyzer/run.h"

namespace ampdiag::analyzer {

// Which findings fail the gate: "error" (default: any error), "all" (any warning or
// error), "none", or a comma-separated list of rule ids (any warning or error of those).
class Gate {
 public:
  explicit Gate(const std::string& spec = "error");  // throws std::invalid_argument
  bool fails(const Finding& f) const;
  bool fails(const Report& r) const;
  const std::string& spec() const { return spec_; }

 private:
  std::string spec_;
  std::set<std::string> rules_;
  bool all_ = false, errors_ = false, none_ = false;
};

struct RenderOptions {
  bool color = false;            // ANSI colour (text only)
  std::size_t max_skipped = 20;  // skipped steps listed in text/markdown
};

// The verdict's count, as every format words it: "5 findings, 4 fail the gate (--fail-on
// error)", "1 finding, none fails the gate (--fail-on error)".
std::string findings_summary(const Report& r, const Gate& gate);
// ", 3 steps without their device statistics (never arrived)" and the like; empty when the
// run was recorded whole.
std::string incomplete_text(const RunOverview& o);
// "3 batches dropped by the loop (NaN/Inf forward, no backward), " where the loop dropped
// any (RunOverview::dropped_batches); empty where none.
std::string dropped_batches_text(const RunOverview& o);
// The device profile in a few lines (the first says whether it ran and what ampdiag's own
// kernels cost); none when profiling was not asked for.
std::vector<std::string> device_profile_lines(const RunOverview& o);
// FP8 readiness in a line or two (add_fp8_overview); none without gradient histograms.
std::vector<std::string> fp8_lines(const Fp8Overview& f);

std::string render_text(const Report& r, const Gate& gate, const RenderOptions& o = {});
std::string render_markdown(const Report& r, const Gate& gate);
std::string render_json(const Report& r, const Gate& gate);
std::string render_junit(const Report& r, const Gate& gate);
std::string render_html(const Report& r, const Gate& gate, const std::vector<Run>& runs);

}  // namespace ampdiag::analyzer
