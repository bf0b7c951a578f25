// Text and Markdown reports: the verdict, then the unstable layers with evidence and the
// fix, then every skipped step's cause.
#include <cmath>
#include <cstdio>
#include <sstream>

#include "ampdiag/analyzer/causes.h"
#include "ampdiag/analyzer/escape.h"
#include "ampdiag/analyzer/render.h"
#include "rules.h"

namespace ampdiag::analyzer {

using rules::fmt;

namespace {

std::string indent(const std::string& text, const std::string& pad) {
  std::string out;
  std::stringstream in(text);
  for (std::string line; std::getline(in, line);) out += pad + line + "\n";
  return out;
}

std::string ranks_text(const Finding& f, std::size_t runs) {
  if (runs < 2) return "";
  std::string s = " [rank";
  for (auto r : f.ranks) s += " " + std::to_string(r);
  return s + "]";
}

}  // namespace

std::string incomplete_text(const RunOverview& o) {
  std::string s;
  if (o.dropped_steps > 0)
    s += ", " + std::to_string(o.dropped_steps) + (o.dropped_steps == 1 ? " step" : " steps") +
         " without their device statistics (they never arrived)";
  if (o.dropped_records > 0)
    s += ", " + std::to_string(o.dropped_records) + " records dropped (the agent's writer fell behind)";
  return s;
}

std::string dropped_batches_text(const RunOverview& o) {
  if (o.dropped_batches == 0) return "";
  return std::to_string(o.dropped_batches) + (o.dropped_batches == 1 ? " batch" : " batches") +
         " dropped by the loop (NaN/Inf forward, no backward), ";
}

std::vector<std::string> device_profile_lines(const RunOverview& o) {
  const DeviceProfile& p = o.device_profile;
  if (p.status.empty()) return {};
  if (p.status == "unavailable")
    return {"device profile: unavailable (" + (p.unavailable.empty() ? std::string("no reason recorded") : p.unavailable) + ")"};
  if (p.steps == 0) return {"device profile: " + p.status + " recorded no device activity (did the model run on a GPU?)"};
  char head[160];
  std::snprintf(head, sizeof head, "device profile: %lld steps, %.0f us of device time per step; ampdiag's own kernels %.3g us (%.2g %%)",
                static_cast<long long>(p.steps), p.step_us, p.ampdiag_us, p.step_us > 0 ? 100.0 * p.ampdiag_us / p.step_us : 0.0);
  std::vector<std::string> lines = {head};
  for (const auto& m : p.modules) {
    char line[160];
    std::snprintf(line, sizeof line, ": %.3g us/step (fp16 %.0f %%, bf16 %.0f %%, fp32 %.0f %%, other %.0f %%)", m.us_per_step,
                  100 * m.fp16, 100 * m.bf16, 100 * m.fp32, 100 * m.other);
    lines.push_back("  " + m.module + line);
  }
  return lines;
}

namespace {

// "FP8 readiness of the <what> ...: A of B <unit> fit E4M3, C fit E5M2", then the least
// ready; `tail` closes the first line.
void add_fp8_group(std::vector<std::string>& lines, const Fp8Overview::Group& g, const char* what, const char* unit,
                   const std::string& scaling, const std::string& tail) {
  if (g.count == 0) {
    lines.push_back(std::string("FP8 readiness of the ") + what + ": no finite histogram to judge");
    return;
  }
  char head[160];
  std::snprintf(head, sizeof head, "FP8 readiness of the %s%s: %lld of %lld %s fit E4M3, %lld fit E5M2", what,
                scaling.c_str(), static_cast<long long>(g.fit_e4m3), static_cast<long long>(g.count), unit,
                static_cast<long long>(g.fit_e5m2));
  lines.push_back(head + tail);
  if (g.least_ready.empty()) return;
  std::string least = "  least E4M3-ready: ";
  for (std::size_t i = 0; i < g.least_ready.size(); ++i) {
    char shares[96];
    std::snprintf(shares, sizeof shares, " (E4M3 %.1f %%, E5M2 %.1f %% normal)", 100.0 * g.least_ready[i].e4m3_normal,
                  100.0 * g.least_ready[i].e5m2_normal);
    least += (i ? "; " : "") + g.least_ready[i].name + shares;
  }
  lines.push_back(least);
}

}  // namespace

std::vector<std::string> fp8_lines(const Fp8Overview& f) {
  if (!f.recorded) return {};
  char scaling[64], tail[128];
  std::snprintf(scaling, sizeof scaling, " (delayed scaling over %lld steps)", static_cast<long long>(f.history));
  std::snprintf(tail, sizeof tail, " (at least %.0f %% of their values normal; ampdiag fp8 has the tables)",
                100.0 * f.fit_share);
  std::vector<std::string> lines;
  add_fp8_group(lines, f.gradients, "gradients", "layers", scaling, tail);
  if (f.activations_recorded) add_fp8_group(lines, f.activations, "activations", "modules", "", "");
  return lines;
}

namespace {

std::string overview_line(const RunOverview& o) {
  return o.path + ": " + std::to_string(o.steps) + (o.steps == 1 ? " step, " : " steps, ") + std::to_string(o.skipped) +
         " skipped, " + dropped_batches_text(o) +
         (o.has_scaler ? "loss scale " + fmt(o.first_scale) + " -> " + fmt(o.last_scale) + " (lowest " + fmt(o.min_scale) + ")"
                       : std::string("no loss scaler")) +
         ", " + o.amp_dtype + " on " + (o.device.empty() ? "?" : o.device) + (o.finished ? "" : ", NOT FINISHED (partial)") +
         (o.write_error.empty() ? std::string()
                                : ", WRITING FAILED: " + std::to_string(o.lost_records) + " records lost (" + o.write_error + ")") +
         incomplete_text(o);
}

std::string skipped_line(const SkippedStep& k, bool show_rank) {
  std::string s = (show_rank ? "rank " + std::to_string(k.rank) + " " : "") + "step " + std::to_string(k.step) +
                  " (scale " + fmt(k.scale) + "): ";
  const std::string forward = forward_sentence(k.forward, k.forward_module);
  if (!forward.empty()) s += forward + "; ";
  if (k.nonfinite_layers.empty()) return s + finite_gradients_sentence(k);
  if (!k.nonfinite_ordered)
    return s + "non-finite gradients in " + std::to_string(k.nonfinite_layer_count) +
           (k.nonfinite_layer_count == 1 ? " layer, " : " layers, ") + k.nonfinite_layers.front() +
           (k.nonfinite_layer_count > 1 ? ", ..." : "") + " (no backward order recorded: which was first is unknown)";
  s += "first non-finite gradient " + k.nonfinite_layers.front();
  if (k.nonfinite_layer_count > 1) s += " (+" + std::to_string(k.nonfinite_layer_count - 1) + " more layers after it)";
  return s;
}

}  // namespace

std::string findings_summary(const Report& r, const Gate& gate) {
  std::size_t failing = 0;
  for (const auto& f : r.findings) failing += gate.fails(f) ? 1 : 0;
  return std::to_string(r.findings.size()) + (r.findings.size() == 1 ? " finding, " : " findings, ") +
         (failing == 0 ? std::string("none fails") : std::to_string(failing) + (failing == 1 ? " fails" : " fail")) +
         " the gate (--fail-on " + gate.spec() + ")";
}

std::string render_text(const Report& r, const Gate& gate, const RenderOptions& o) {
  const char* red = o.color ? "\033[31;1m" : "";
  const char* yellow = o.color ? "\033[33;1m" : "";
  const char* green = o.color ? "\033[32;1m" : "";
  const char* bold = o.color ? "\033[1m" : "";
  const char* dim = o.color ? "\033[2m" : "";
  const char* reset = o.color ? "\033[0m" : "";
  std::string out;
  const bool fails = gate.fails(r);
  if (r.healthy())
    out += std::string(green) + "HEALTHY" + reset + ": no overflow, underflow or loss-scale problem found.\n";
  else
    out += std::string(fails ? red : yellow) + (fails ? "UNHEALTHY" : "WARNINGS") + reset + ": " + findings_summary(r, gate) +
           ".\n";
  for (const auto& run : r.runs) {
    out += std::string(dim) + printable(overview_line(run)) + reset + "\n";
    for (const auto& line : device_profile_lines(run)) out += std::string(dim) + printable(line) + reset + "\n";
    for (const auto& line : fp8_lines(run.fp8)) out += std::string(dim) + printable(line) + reset + "\n";
  }
  int n = 0;
  // Names inside titles, evidence and snippets are data: printable() keeps them from
  // driving the terminal.
  const auto data = [](const std::string& s) { return printable(s); };
  for (const auto& f : r.findings) {
    const char* colour = f.severity == Severity::kError ? red : (f.severity == Severity::kWarning ? yellow : dim);
    out += "\n" + std::string(bold) + std::to_string(++n) + ". " + reset + colour + severity_name(f.severity) + reset + " " +
           bold + "[" + f.rule + "]" + reset + ranks_text(f, r.runs.size()) + " " + data(f.title) + "\n";
    if (!f.module.empty()) out += "   module:   " + printable(f.module) + "\n";
    if (!f.layer.empty()) out += "   layer:    " + printable(f.layer) + "\n";
    out += "   evidence: " + data(f.evidence) + "\n";
    for (const auto& s : f.suggestions) {
      out += "   fix:      " + data(s.summary) + (f.confirmation == "confirmed" && &s == &f.suggestions.front() && !s.untried ? " (confirmed by replay)" : "") + "\n";
      if (!s.cost.empty()) out += "   cost:     " + data(s.cost) + "\n";
      if (!s.python.empty()) out += std::string(dim) + "   Python:\n" + reset + indent(printable(s.python, true), "      ");
      if (!s.cpp.empty()) out += std::string(dim) + "   C++:\n" + reset + indent(printable(s.cpp, true), "      ");
    }
  }
  if (!r.skipped.empty()) {
    out += "\n" + std::string(bold) + "Skipped steps" + reset + " (" + std::to_string(r.skipped.size()) + "), and why:\n";
    for (std::size_t i = 0; i < r.skipped.size() && i < o.max_skipped; ++i)
      out += "  " + printable(skipped_line(r.skipped[i], r.runs.size() > 1)) + "\n";
    if (r.skipped.size() > o.max_skipped)
      out += "  ... " + std::to_string(r.skipped.size() - o.max_skipped) + " more (--format json lists them all)\n";
  }
  return out;
}

std::string render_markdown(const Report& r, const Gate& gate) {
  std::string out = "# ampdiag report\n\n";
  out += r.healthy() ? "**Healthy**: no overflow, underflow or loss-scale problem found.\n\n"
                     : std::string("**") + (gate.fails(r) ? "Unhealthy" : "Warnings") + "**: " +
                           findings_summary(r, gate) + ".\n\n";
  for (const auto& run : r.runs) {
    out += "- " + markdown_text(overview_line(run)) + "\n";
    for (const auto& line : device_profile_lines(run)) out += "  - " + markdown_text(line) + "\n";
    for (const auto& line : fp8_lines(run.fp8)) out += "  - " + markdown_text(line) + "\n";
  }
  int n = 0;
  const auto code_block = [](const char* language, const std::string& code) {
    const std::string text = printable(code, true), fence = markdown_fence(text);
    return "\n" + fence + language + "\n" + text + "\n" + fence + "\n";
  };
  for (const auto& f : r.findings) {
    out += "\n## " + std::to_string(++n) + ". " + severity_name(f.severity) + " " + markdown_code(f.rule) + ": " +
           markdown_text(f.title) + "\n\n";
    if (!f.module.empty()) out += "- module: " + markdown_code(f.module) + "\n";
    if (!f.layer.empty()) out += "- layer: " + markdown_code(f.layer) + "\n";
    out += "- evidence: " + markdown_text(f.evidence) + "\n";
    for (const auto& s : f.suggestions) {
      out += "- fix: " + markdown_text(s.summary) + "\n";
      if (!s.cost.empty()) out += "- cost: " + markdown_text(s.cost) + "\n";
      if (!s.python.empty()) out += code_block("python", s.python);
      if (!s.cpp.empty()) out += code_block("cpp", s.cpp);
    }
  }
  if (!r.skipped.empty()) {
    out += "\n## Skipped steps\n\n";
    for (std::size_t i = 0; i < r.skipped.size() && i < 50; ++i)
      out += "- " + markdown_text(skipped_line(r.skipped[i], r.runs.size() > 1)) + "\n";
    if (r.skipped.size() > 50) out += "- ... " + std::to_string(r.skipped.size() - 50) + " more\n";
  }
  return out;
}

}  // namespace ampdiag::analyzer
