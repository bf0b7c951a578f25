// autopin: what the agent pinned to FP32 on its own (attach(autopin=N)), and what happened
// after: the user makes the pin permanent in code.
#include <cstdlib>
#include <string>
#include <utility>

#include "rules.h"
#include "suggestions.h"

namespace ampdiag::analyzer::rules {

namespace {

// Why the agent pinned `path`: event "autopin-parent" ("PARENT: CHILD, FP32 output up to X")
// where it pinned the parent of a module whose FP32 output was beyond fp16's range.
std::string why_pinned(const Run& run, const std::string& path) {
  if (const auto [e, child] = run.module_event("autopin-parent", path); e)
    return "it holds " + child +
           ", beyond fp16's range: the FP32 replay had confirmed that module as the origin of a NaN/Inf in forward, "
           "and pinned alone it would hand that output to the code that uses it, which overflows where it runs in fp16";
  if (const auto [e, lost] = run.module_event("autopin-precision", path); e)
    return "a precision check found its " + run.meta_or("amp_dtype", "float16") + " output " + lost +
           " (relative L2), with no NaN/Inf: the same call in FP32 is what the pin gives";
  return "its FP32 replay had confirmed it as the origin of a NaN/Inf in forward";
}

// The module the agent confirmed after its limit was reached, and the limit: event
// "autopin-limit", "PATH was confirmed too, but autopin=N modules are pinned already; ...".
std::pair<std::string, std::string> left_unpinned(const Run& run) {
  const rundb::EventRow* e = run.first_event("autopin-limit");
  if (!e) return {};
  const std::size_t too = e->detail.find(" was confirmed too"), at = e->detail.find("autopin=");
  if (too == std::string::npos || at == std::string::npos) return {};
  const std::size_t end = e->detail.find(' ', at);
  return {e->detail.substr(0, too), e->detail.substr(at + 8, end == std::string::npos ? end : end - at - 8)};
}

}  // namespace

void autopin(const Run& run, std::vector<Finding>& out) {
  const auto [unpinned, limit] = left_unpinned(run);
  const rundb::EventRow* last = nullptr;
  for (const auto& e : run.events)
    if (e.kind == "autopin" && !e.detail.empty()) last = &e;
  for (const auto& e : run.events) {
    if (e.kind != "autopin" || e.detail.empty()) continue;
    const std::string& path = e.detail;  // the agent writes the module path, nothing else
    std::int64_t before = 0, skipped_before = 0, after = 0, skipped_after = 0;
    for (const auto& s : run.steps) {
      const bool at_or_after = s.row.step >= e.step;
      (at_or_after ? after : before) += 1;
      (at_or_after ? skipped_after : skipped_before) += s.row.skipped ? 1 : 0;
    }
    Finding f;
    f.rule = "autopin";
    f.severity = Severity::kInfo;
    f.module = path;
    f.score = 1.0;
    f.steps = {e.step};
    f.title = "auto-pinned " + path + " to FP32 at step " + std::to_string(e.step) + "; after it, " +
              plural(skipped_after, "skip");
    f.evidence = why_pinned(run, path) + "; from step " +
                 std::to_string(e.step) + " on, " + std::to_string(skipped_after) + " of " + plural(after, "step") +
                 " skipped (before it, " + std::to_string(skipped_before) + " of " + plural(before, "step") + ")";
    Suggestion pin = suggest::pin_fp32(run, path);
    pin.summary = "Make the pin permanent in code (ampdiag pinned " + path + " only while attached): " + pin.summary;
    f.suggestions.push_back(std::move(pin));
    // The skips after the last pin may be the next module's, which the limit left alone.
    if (&e == last && !unpinned.empty()) {
      f.evidence += "; then " + unpinned + " was confirmed too and left unpinned: autopin=" + limit +
                    " allows " + plural(std::atoll(limit.c_str()), "module");
      f.suggestions.push_back(
          {"Let ampdiag pin the modules it confirms after this one too (autopin=N pins up to N), then make each pin "
           "permanent in code.",
           "handle = ampdiag.attach(model, scaler, autopin=4)", "options.autopin = 4;  // ampdiag::AgentOptions", ""});
    }
    out.push_back(std::move(f));
  }
}

}  // namespace ampdiag::analyzer::rules
