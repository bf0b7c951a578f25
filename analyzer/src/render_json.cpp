// JSON and JUnit XML reports, for scripts and CI.
#include <map>

#include "ampdiag/analyzer/analyze.h"
#include "ampdiag/analyzer/causes.h"
#include "ampdiag/analyzer/render.h"
#include "ampdiag/analyzer/json.h"
#include "markup.h"

namespace ampdiag::analyzer {

namespace {

using json::number;
using json::quote;

std::string device_profile_json(const DeviceProfile& p) {
  if (p.status.empty()) return "null";
  std::string o = "{\"status\": " + quote(p.status) + ", \"unavailable\": " +
                  (p.unavailable.empty() ? std::string("null") : quote(p.unavailable)) + ", \"steps\": " + number(p.steps) +
                  ", \"step_us\": " + number(p.step_us) + ", \"ampdiag_us\": " + number(p.ampdiag_us) + ", \"modules\": [";
  for (std::size_t i = 0; i < p.modules.size(); ++i) {
    const auto& m = p.modules[i];
    o += std::string(i ? ", " : "") + "{\"module\": " + quote(m.module) + ", \"us_per_step\": " + number(m.us_per_step) +
         ", \"fp16\": " + number(m.fp16) + ", \"bf16\": " + number(m.bf16) + ", \"fp32\": " + number(m.fp32) +
         ", \"other\": " + number(m.other) + "}";
  }
  return o + "]}";
}

std::string fp8_least_ready(const Fp8Overview::Group& g, const char* key) {
  std::string o = "[";
  for (std::size_t i = 0; i < g.least_ready.size(); ++i)
    o += std::string(i ? ", " : "") + "{\"" + key + "\": " + quote(g.least_ready[i].name) +
         ", \"e4m3_normal\": " + number(g.least_ready[i].e4m3_normal) +
         ", \"e5m2_normal\": " + number(g.least_ready[i].e5m2_normal) + "}";
  return o + "]";
}

// The gradients' group at the top level (as before activations were judged), the
// activations' nested; null when the run recorded no activation histograms.
std::string fp8_json(const Fp8Overview& f) {
  if (!f.recorded) return "null";
  const auto& g = f.gradients;
  std::string o = "{\"history\": " + number(f.history) + ", \"fit_share\": " + number(f.fit_share) +
                  ", \"layers\": " + number(g.count) + ", \"fit_e4m3\": " + number(g.fit_e4m3) +
                  ", \"fit_e5m2\": " + number(g.fit_e5m2) + ", \"least_ready\": " + fp8_least_ready(g, "layer");
  const auto& a = f.activations;
  o += ", \"activations\": ";
  if (!f.activations_recorded) return o + "null}";
  return o + "{\"modules\": " + number(a.count) + ", \"fit_e4m3\": " + number(a.fit_e4m3) + ", \"fit_e5m2\": " +
         number(a.fit_e5m2) + ", \"least_ready\": " + fp8_least_ready(a, "module") + "}}";
}

}  // namespace

std::string render_json(const Report& r, const Gate& gate) {
  std::string o = "{\n  \"format\": \"ampdiag-report\",\n  \"version\": 1,\n";
  o += "  \"healthy\": " + std::string(r.healthy() ? "true" : "false") + ",\n";
  o += "  \"gate\": {\"fail_on\": " + quote(gate.spec()) + ", \"fails\": " + (gate.fails(r) ? "true" : "false") + "},\n";
  o += "  \"runs\": [";
  for (std::size_t i = 0; i < r.runs.size(); ++i) {
    const auto& x = r.runs[i];
    o += std::string(i ? "," : "") + "\n    {\"path\": " + quote(x.path) + ", \"rank\": " + number(x.rank) +
         ", \"steps\": " + number(x.steps) + ", \"skipped\": " + number(x.skipped) +
         ", \"calibration_skips\": " + number(x.calibration_skips) + ", \"first_scale\": " + number(x.first_scale) +
         ", \"last_scale\": " + number(x.last_scale) + ", \"min_scale\": " + number(x.min_scale) +
         ", \"layers\": " + number(x.layers) + ", \"modules\": " + number(x.modules) + ", \"grad_rows\": " +
         number(x.grad_rows) + ", \"act_rows\": " + number(x.act_rows) + ", \"finished\": " + (x.finished ? "true" : "false") +
         ", \"write_error\": " + (x.write_error.empty() ? std::string("null") : quote(x.write_error)) +
         ", \"lost_records\": " + number(x.lost_records) + ", \"dropped_steps\": " + number(x.dropped_steps) +
         ", \"dropped_records\": " + number(x.dropped_records) + ", \"dropped_batches\": " + number(x.dropped_batches) +
         ", \"amp_dtype\": " + quote(x.amp_dtype) + ", \"device\": " + quote(x.device) + ", \"run_id\": " + quote(x.run_id) +
         ", \"world_size\": " + number(x.world_size) + ", \"has_scaler\": " + (x.has_scaler ? "true" : "false") +
         ", \"harmful_skips\": " + number(x.harmful_skips) + ", \"skip_rate\": " + number(x.skip_rate) +
         ",\n     \"device_profile\": " + device_profile_json(x.device_profile) +
         ", \"fp8\": " + fp8_json(x.fp8) + "}";
  }
  o += "\n  ],\n  \"findings\": [";
  for (std::size_t i = 0; i < r.findings.size(); ++i) {
    const auto& f = r.findings[i];
    o += std::string(i ? "," : "") + "\n    {\"rule\": " + quote(f.rule) + ", \"severity\": " + quote(severity_name(f.severity)) +
         ", \"fails_gate\": " + (gate.fails(f) ? "true" : "false") + ", \"module\": " + quote(f.module) +
         ", \"layer\": " + quote(f.layer) + ", \"title\": " + quote(f.title) + ", \"evidence\": " + quote(f.evidence) +
         ", \"confirmation\": " + quote(f.confirmation) +
         ", \"score\": " + number(f.score) + ",\n     \"ranks\": [";
    for (std::size_t k = 0; k < f.ranks.size(); ++k) o += (k ? ", " : "") + number(f.ranks[k]);
    o += "], \"steps\": [";
    for (std::size_t k = 0; k < f.steps.size(); ++k) o += (k ? ", " : "") + number(f.steps[k]);
    o += "],\n     \"suggestions\": [";
    for (std::size_t k = 0; k < f.suggestions.size(); ++k) {
      const auto& s = f.suggestions[k];
      o += std::string(k ? ", " : "") + "{\"summary\": " + quote(s.summary) + ", \"python\": " + quote(s.python) +
           ", \"cpp\": " + quote(s.cpp) + ", \"cost\": " + (s.cost.empty() ? std::string("null") : quote(s.cost)) + "}";
    }
    o += "]}";
  }
  o += "\n  ],\n  \"skipped_steps\": [";
  for (std::size_t i = 0; i < r.skipped.size(); ++i) {
    const auto& k = r.skipped[i];
    o += std::string(i ? "," : "") + "\n    {\"rank\": " + number(k.rank) + ", \"step\": " + number(k.step) +
         ", \"scale\": " + number(k.scale) + ", \"loss\": " + number(k.loss) + ", \"forward_module\": " +
         quote(k.forward_module) +
         ", \"forward_source\": " + quote(forward_source_name(k.forward)) + ", \"nonfinite_layer_count\": " + number(k.nonfinite_layer_count) +
         ", \"backward_order_known\": " + (k.nonfinite_ordered ? "true" : "false") +
         ", \"gradients_recorded\": " + (k.gradients_recorded || !k.nonfinite_layers.empty() ? "true" : "false") +
         ", \"nonfinite_rank\": " + (k.nonfinite_rank < 0 ? std::string("null") : number(k.nonfinite_rank)) +
         ", \"nonfinite_layers\": [";
    for (std::size_t j = 0; j < k.nonfinite_layers.size(); ++j) o += (j ? ", " : "") + quote(k.nonfinite_layers[j]);
    o += "]}";
  }
  o += "\n  ]\n}\n";
  return o;
}

std::string render_junit(const Report& r, const Gate& gate) {
  std::map<std::string, std::vector<const Finding*>> by_rule;
  for (const auto& f : r.findings) by_rule[f.rule].push_back(&f);
  int failures = 0;
  std::string cases;
  for (const auto& id : rule_ids()) {
    cases += "    <testcase classname=\"ampdiag\" name=\"" + id + "\">\n";
    std::string failing, notes;
    for (const Finding* f : by_rule[id]) {
      const std::string line = std::string(severity_name(f->severity)) + ": " + f->title + " -- " + f->evidence + "\n";
      (gate.fails(*f) ? failing : notes) += line;
    }
    if (!failing.empty()) {
      ++failures;
      cases += "      <failure message=\"" + escape_markup(by_rule[id].front()->title) + "\">" + escape_markup(failing) + "</failure>\n";
    }
    if (!notes.empty()) cases += "      <system-out>" + escape_markup(notes) + "</system-out>\n";
    cases += "    </testcase>\n";
  }
  std::string name = r.runs.empty() ? "run" : r.runs.front().path;
  return "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<testsuites>\n  <testsuite name=\"ampdiag " + escape_markup(name) +
         "\" tests=\"" + std::to_string(rule_ids().size()) + "\" failures=\"" + std::to_string(failures) +
         "\" errors=\"0\">\n" + cases + "  </testsuite>\n</testsuites>\n";
}

}  // namespace ampdiag::analyzer
