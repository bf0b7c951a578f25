// forward-nonfinite: the first module whose output is NaN/Inf in forward, confirmed or
// cleared by the agent's FP32 replays (causes.h), and the NaN/Inf loss made after the modules.
#include <algorithm>
#include <cmath>
#include <map>
#include <string>

#include <cstdio>

#include "ampdiag/analyzer/causes.h"
#include "loss_code.h"
#include "model_parameters.h"
#include "forward_recurrence.h"
#include "module_code.h"
#include "rules.h"
#include "buffers_fix.h"
#include "suggestions.h"

namespace ampdiag::analyzer::rules {

namespace {

// The evidence a replay whose FP32 output was finite gives.
std::string confirmed_evidence(const Run& run, double fp32_absmax) {
  const std::string absmax = replay_absmax(fp32_absmax);
  if (suggest::beyond_fp16(run, fp32_absmax))
    return std::string("confirmed: re-run once in FP32 on copies of the same inputs, its output was finite but up to ") +
           absmax + ", beyond fp16's largest value (65504): whatever uses it in fp16 overflows next";
  return std::string("confirmed: re-run once in FP32 on copies of the same inputs, its output was finite") +
         (std::isfinite(fp32_absmax) ? std::string(" (max |x| ") + absmax + ")" : "");
}

// Where the loop dropped those batches (event "forward-dropped"): a guard on the loss hides
// the overflow from the scaler and loses the batch, so it is no sign the model absorbed it.
std::string dropped_evidence(std::int64_t dropped) {
  return "the loop dropped the batch in " + plural(dropped, "step") +
         " before backward (no gradient reached the forward that went NaN/Inf: a guard such as "
         "`if not torch.isfinite(loss): continue` loses the batch, it does not avoid the overflow)";
}

// The largest |value| of the model's output: its own row's, else that of the module nearest
// it (a model whose forward() ends in its last submodule); 0 where neither was recorded.
double model_output_absmax(const Run& run) {
  if (const ModuleSummary* own = run.module_named(""); own && own->max_absmax > 0.0f) return own->max_absmax;
  const ModuleSummary* last = run.last_module();
  return last ? double(last->max_absmax) : 0.0;
}

// Steps where `module` was the forward's cause and the loss went NaN/Inf.
std::int64_t nonfinite_losses_caused(const Run& run, const std::string& module) {
  std::int64_t n = 0;
  for (const auto& s : run.steps)
    if (nonfinite_from_module(run, s) && run.loss_nonfinite(s.row) &&
        forward_cause(run, run.modules[std::size_t(s.first_nonfinite_module)].info.path).module == module)
      ++n;
  return n;
}

Finding confirmed_overflow(const Run& run, const ModuleSummary& m, const std::string& before, Severity severity,
                           double score) {
  const rundb::ReplayRow* r = run.replay_of(m.info.path);
  Finding f;
  f.rule = "forward-nonfinite";
  f.severity = severity;
  f.module = m.info.path;
  f.confirmation = "confirmed";
  f.score = score;
  f.title = m.info.path + " overflows fp16 in forward, after " + before + "'s NaN/Inf by design";
  f.evidence = "its output was NaN/Inf in " + plural(m.nonfinite_steps, "step") + "; " + confirmed_evidence(run, r->fp32_absmax) +
               "; " + before + ", first in forward order, makes NaN/Inf from finite inputs in FP32 too";
  if (m.first_step >= 0) f.steps.push_back(m.first_step);
  f.suggestions = suggest::confirmed_fixes(run, m.info.path, r->fp32_absmax);
  return f;
}

// The steps whose loss was NaN/Inf although every probed module's output was finite: the
// NaN/Inf was made after the modules, where no replay can look. Empty steps: none. An error
// (for the caller to keep or lower) where the gradients went NaN/Inf with it; a warning
// where they stayed finite (a mean over no element: the step's update was not lost).
Finding loss_after_modules(const Run& run, std::int64_t known_losses) {
  Finding f;
  std::int64_t n = 0, hurt = 0;
  std::vector<std::int64_t> steps;
  for (const auto& s : run.steps) {
    if (step_cause(run, s).forward != ForwardSource::kLoss) continue;
    ++n;
    steps.push_back(s.row.step);
    hurt += s.row.skipped || s.gradients_nonfinite();
  }
  if (n == 0) return f;
  f.steps.push_back(steps.front());
  const loss_code::Code code = loss_code::at_steps(run, steps);
  f.rule = "forward-nonfinite";
  f.severity = hurt ? Severity::kError : Severity::kWarning;
  f.score = hurt ? 80.0 : 30.0;
  f.title = "The loss is NaN/Inf while every probed module's output is finite: it is made after the modules";
  f.blame = "the loss code after the model's last module";
  f.evidence = "loss non-finite in " + std::to_string(n) + " of " + plural(known_losses, "step") + ", first at step " +
               std::to_string(f.steps.front()) + ", with no NaN/Inf in any probed module's output in those steps; " +
               (hurt ? "the gradients went NaN/Inf with it in " + plural(hurt, "step")
                     : std::string("the gradients stayed finite, so no update was lost, but the logged loss is NaN/Inf"));
  if (!code.empty())
    f.evidence += "; the operations from the model's output to the loss (step " + std::to_string(code.step) +
                  "): " + code.describe();
  f.suggestions = loss_code::forward_suggestions(
      code,
      "Look at the code after the model's last module: the loss, and the model's own forward() after its last "
      "submodule. Keep log() and divisions away from 0 (a mean over no element, as when every label is "
      "ignore_index, is 0/0); a sum, pow or exp in fp16 overflows above 65504.",
      model_output_absmax(run));
  // A target (or another model's output) the loss was given already held NaN/Inf.
  if (const loss_code::NonfiniteInput in = loss_code::nonfinite_input_at(run, steps); in.seen > 0) {
    const std::string what = in.op + "'s " + in.argument;
    // A half-precision one may be fp16's after all: made under autocast outside the model
    // (advantages normalised by std + 1e-8, whose 1e-8 is 0 in fp16). A float32 one may be
    // too: a frozen teacher's fp16 logits overflowed, then cast for the loss.
    const bool half = in.dtype == "float16" || in.dtype == "bfloat16" || !in.made_in.empty();
    // Where it was made: its own dtype, or the half type whose values alone it held.
    const std::string made = in.made_in.empty() ? in.dtype : in.made_in;
    // A loss code that runs matmuls in fp16 itself (a style loss's Gram matrices beside float16
    // style targets) may overflow too once the target is mended: not cleared of it.
    const std::string matmuls = code.autocast_float16();
    const std::string cleared = matmuls.empty() ? "not the model or the loss code" : "not the model";
    if (in.seen == in.looked)
      f.title = "The loss is NaN/Inf because " + what + " already held NaN/Inf" +
                (!in.made_in.empty() ? ", a tensor made in " + made + " outside the model: " + cleared
                 : half              ? ", a " + in.dtype + " tensor made outside the model: " + cleared
                                     : ": " + cleared);
    f.evidence += "; before backward, the " + in.argument + " given to " + in.op + " held NaN/Inf in " +
                  std::to_string(in.seen) + " of the " + plural(in.looked, "step") + " whose loss code was read (step " +
                  std::to_string(in.step) + ": " + in.counts + (in.dtype.empty() ? "" : ", " + in.dtype) +
                  (in.made_in.empty() ? "" : ", every finite value a " + in.made_in + " one: made in " + in.made_in + ", then cast up") +
                  ")";
    f.blame = what;
    f.suggestions.insert(
        f.suggestions.begin(),
        {"Find where " + what + " gets NaN/Inf before the loss: a missing value in the dataset (drop or mask such "
             "samples), or another model's output (a teacher, an encoder run under no_grad) that went NaN/Inf; "
             "pinning this model's modules" + std::string(half ? "" : " or computing the loss in FP32") +
             " cannot help.",
         "keep = torch.isfinite(y).all(-1)  # or fix the data: assert torch.isfinite(y).all()\n"
         "loss = loss_fn(out[keep], y[keep])",
         "auto keep = torch::isfinite(y).all(-1);\nauto loss = loss_fn(out.index({keep}), y.index({keep}));", ""});
    if (half) {
      const std::string device = suggest::device_type(run);
      const std::string at_device = suggest::cpp_device_type(run);
      f.suggestions.insert(
          f.suggestions.begin(),
          {what + (in.made_in.empty() ? " was " + in.dtype : " was made in " + made) +
               ": where the loop computes it under autocast, compute it in FP32 (.float() first, autocast off around "
               "it)." + (made == "float16" ? " In float16 an epsilon such as 1e-8 is 0, so (x - mean) / (std + 1e-8) "
                                             "is 0/0 = NaN when every value is equal, and a sum, a square or an exp() "
                                             "above 65504 is Inf: exp() of anything above 11.09 (SwAV's Sinkhorn codes, "
                                             "exp(scores / 0.05) under no_grad)."
                                           : std::string()),
           "with torch.autocast(device_type=\"" + device + "\", enabled=False):\n"
           "    adv = adv.float()\n"
           "    adv = (adv - adv.mean()) / (adv.std() + 1e-8)  # e.g. advantages: 1e-8 is 0 in float16",
           "at::autocast::set_autocast_enabled(" + at_device + ", false);\n"
           "adv = adv.to(torch::kFloat);\n"
           "adv = (adv - adv.mean()) / (adv.std() + 1e-8);  // e.g. advantages: 1e-8 is 0 in float16\n"
           "at::autocast::set_autocast_enabled(" + at_device + ", true);",
           ""});
    }
    if (in.seen == in.looked) {
      f.suggestions.resize(half ? 2 : 1);  // nothing else is to blame, but the loss code's own fp16 matmuls
      if (!matmuls.empty())
        f.suggestions.push_back(suggest::fp32_loss("Once " + what + " is mended, the loss code's own " + matmuls +
                                                   " run in float16 too, and each value they make sums many "
                                                   "products, which can pass 65504 on its own:"));
    }
  }
  return f;
}

// The steps whose model input held NaN (events "input-nan", written where an output was
// NaN/Inf): a corrupted batch, which no precision change fixes. Empty steps: none.
Finding input_nan(const Run& run) {
  Finding f;
  std::int64_t n = 0, hurt = 0;
  std::string detail;
  for (const auto& s : run.steps) {
    if (step_cause(run, s).forward != ForwardSource::kInput) continue;
    if (n++ == 0) f.steps.push_back(s.row.step);
    hurt += s.row.skipped || run.loss_nonfinite(s.row);
  }
  if (n == 0) return f;
  for (const auto& e : run.events)
    if (e.kind == "input-nan" && e.step == f.steps.front()) detail = e.detail;
  f.rule = "input-nan";
  f.severity = hurt ? Severity::kError : Severity::kInfo;
  f.score = hurt ? 90.0 : 5.0;
  // The agents name NaN where there is any, else an Inf that is no additive mask's -inf.
  const bool inf = detail.find("NaN") == std::string::npos && detail.find("Inf") != std::string::npos;
  const std::string what = inf ? "Inf" : "NaN";
  f.title = hurt ? "The model's input already held " + what + ": none of its modules made the forward non-finite"
                 : "The model's input held " + what + ", and the loss stayed finite";
  f.evidence = "in " + plural(n, "step") + " with a NaN/Inf output, from step " + std::to_string(f.steps.front()) +
               ", the model's input already held " + what + (detail.empty() ? "" : " (" + detail + ")") + "; " +
               std::to_string(hurt) + " of them skipped or with a NaN/Inf loss";
  if (hurt) f.blame = "the " + what + " in the model's input";  // what a symptom's fix points to
  if (hurt && inf)
    f.suggestions.push_back({"Find where the input got its Inf before the model: a log of 0 in preprocessing "
                             "(log(x + eps) computed in fp16, where an eps such as 1e-10 rounds to 0: compute the "
                             "features in float32, outside autocast), a division by 0, or code that computes it (an "
                             "encoder run before the model under no_grad: attach one ModuleDict holding both to have "
                             "its modules watched); pinning this model's modules to FP32 cannot help.",
                             "assert torch.isfinite(x).all(), \"NaN/Inf in the batch\"",
                             "TORCH_CHECK(torch::isfinite(x).all().item<bool>(), \"NaN/Inf in the batch\");"});
  else if (hurt)
    f.suggestions.push_back({"Find where the input got its NaN before the model: bad samples in the data pipeline (a "
                             "missing value, a 0/0 in preprocessing), or code that computes it (an encoder run before "
                             "the model under no_grad, as a diffusion model's text encoder: attach one ModuleDict "
                             "holding both to have its modules watched); pinning this model's modules to FP32 cannot "
                             "help.",
                             "assert not torch.isnan(x).any(), \"NaN in the batch\"",
                             "TORCH_CHECK(!torch::isnan(x).any().item<bool>(), \"NaN in the batch\");"});
  return f;
}
// The culprit's input already held finite values that fp16 cannot hold (event
// "input-beyond-fp16", which the Python agent writes where its FP32 replay was finite under
// float16 autocast): the cast to fp16 made them Inf before it computed anything. `what`
// empty where none did; `model_input` where that input is the model's own (the data).
struct InputBeyond {
  std::string what;
  bool model_input = false;
};

InputBeyond input_beyond_fp16(const Run& run, const std::string& path) {
  if (!run.fp16()) return {};
  InputBeyond in{run.module_event("input-beyond-fp16", path).second};
  static const std::string model_input = "; the model's input";
  if (in.what.size() > model_input.size() &&
      in.what.compare(in.what.size() - model_input.size(), model_input.size(), model_input) == 0) {
    in.what.resize(in.what.size() - model_input.size());
    in.model_input = true;
  }
  return in;
}

// The fix for a model input beyond fp16's range: the data, whatever the model does with it.
Suggestion scale_the_input() {
  return {"Bring the model's input into fp16's range in the data pipeline: standardize each feature with the training "
          "set's mean and std (a log transform for a heavy-tailed one such as a price or a count). Autocast casts "
          "values of 65520 and more to Inf before the first layer computes anything.",
          "mean, std = train_x.mean(0), train_x.std(0)  # once, over the training set\n"
          "x = (x - mean) / std  # each batch, before model(x)",
          "auto mean = train_x.mean(0), stdev = train_x.std(0);  // once, over the training set\n"
          "x = (x - mean) / stdev;  // each batch, before the model",
          "",
          true};
}
}  // namespace

// The module that finished just before `path` in the first forward with a row for every call
// where `path` was the first NaN/Inf module; without such a forward, the one that first
// finished just before it (module ids are given in that order, which a module first called
// in a later step breaks). Null where `path` is no module or nothing finished before it.
const ModuleSummary* finished_before(const Run& run, const std::string& path) {
  const ModuleSummary* m = run.module_named(path);
  if (!m) return nullptr;
  const std::int64_t before = m->before_known ? m->before_first : m->info.id - 1;
  return before >= 0 && std::size_t(before) < run.modules.size() ? &run.modules[std::size_t(before)] : nullptr;
}

// The module inside `owner` (the model: "") that finished just before `first_seen`; "" where
// none did or `first_seen` is no module.
std::string own_code_after(const Run& run, const std::string& owner, const std::string& first_seen) {
  if (!run.module_named(first_seen)) return "";
  if (const ModuleSummary* before = finished_before(run, first_seen)) {
    const std::string& path = before->info.path;
    if (owner.empty() || path.rfind(owner + ".", 0) == 0) return path;
  }
  return "";
}

// Where in `owner`'s own code (the model's: "") the NaN/Inf that `first_seen` received was
// made: "between A and first_seen", A the module inside `owner` that finished just before
// it in forward order (its output was finite, or it would have been first); "before
// first_seen" where none inside `owner` did.
std::string own_code_place(const Run& run, const std::string& owner, const std::string& first_seen) {
  if (!run.module_named(first_seen)) return "";
  const std::string after = own_code_after(run, owner, first_seen);
  return after.empty() ? "before " + first_seen : "between " + after + " and " + first_seen;
}

// The model's own output NaN/Inf while every module's output was finite (the Python agent
// records it as module "", the model, with its FP32 replay): made by the model's forward()
// after its last module, as logits computed with F.linear(h, self.emb.weight). Names that
// module and the operations after it (event "model-code") and tells to run them in FP32.
void model_code_after_modules(const Run& run, const std::vector<std::int64_t>& steps, Finding& f) {
  const ModuleSummary* before = run.last_module();
  const std::string last = before ? before->info.path : "";
  const std::string after = last.empty() ? "after its last submodule" : "after " + last + ", its last submodule";
  const loss_code::Code code = loss_code::at_steps(run, steps, "model-code");
  f.title = "The model's output is NaN/Inf while every module's output is finite: its own forward() makes it " + after;
  if (!code.empty()) {
    f.evidence += "; the operations from " + (last.empty() ? std::string("its last submodule") : last) +
                  "'s output to the model's (step " + std::to_string(code.step) + "): " + code.describe();
    // What that code reads besides the modules' outputs: a temperature whose exp() scales
    // logits (CLIP's logit_scale) makes the overflow that the operations only carry.
    for (const auto& e : run.events)
      if (e.kind == "model-parameters" && e.step == code.step) {
        f.evidence += "; the model's own parameters (held by no submodule) that code reads: " + e.detail;
        if (auto bound = model_parameters::exp_bound(run, e.detail)) f.suggestions.push_back(*bound);
        break;
      }
  }
  f.suggestions.push_back(suggest::fp32_model_code(run, after, code.float16_compute()));
}

// The agent's own pin of `path` or of a module holding it (event "autopin": attach(autopin=N)),
// as (pinned path, step it applies from); null where none.
const rundb::EventRow* autopinned(const Run& run, const std::string& path) {
  if (path.empty()) return nullptr;
  for (const auto& e : run.events)
    if (e.kind == "autopin" && !e.detail.empty() && suggest::within(path, e.detail)) return &e;
  return nullptr;
}

void forward_nonfinite(const Run& run, const Thresholds&, std::vector<Finding>& out) {
  std::int64_t nonfinite_loss = 0, first_bad_loss = -1, known_losses = 0;
  for (const auto& s : run.steps) {
    if (!run.loss_known(s.row)) continue;
    ++known_losses;
    if (!std::isfinite(s.row.loss)) {
      ++nonfinite_loss;
      if (first_bad_loss < 0) first_bad_loss = s.row.step;
    }
  }
  struct Culprit {
    ForwardCause cause;
    std::int64_t first = 0, first_step = -1;
    std::int64_t hurt = 0;     // of those steps, skipped, dropped, or with NaN/Inf gradients or loss
    std::int64_t absorbed = 0;     // of those steps, none of that
    std::int64_t calibration = 0;  // of the hurt ones, the scale's calibration skips (the loss finite)
    std::int64_t dropped = 0;  // of those steps, where the loop dropped the batch (forward-dropped)
    std::int64_t evaluations = 0;  // of those steps, where it was an evaluation's forward (evaluation-nonfinite)
    std::vector<std::int64_t> steps;  // ascending
  };
  // Steps whose input held NaN are the data's (input-nan), whatever module showed it first,
  // and those after an update that wrote NaN/Inf into the parameters are its (nonfinite-update).
  std::map<std::string, Culprit> culprits;
  std::map<std::int64_t, ForwardCause> cause_of;  // by module id
  std::int64_t with_module = 0;
  const std::vector<bool> harmful = harmful_skip_mask(run);
  for (std::size_t i = 0; i < run.steps.size(); ++i) {
    const StepSummary& s = run.steps[i];
    if (!nonfinite_from_module(run, s)) continue;
    ++with_module;
    auto it = cause_of.find(s.first_nonfinite_module);
    if (it == cause_of.end())
      it = cause_of.emplace(s.first_nonfinite_module,
                            forward_cause(run, run.modules[std::size_t(s.first_nonfinite_module)].info.path)).first;
    Culprit& c = culprits[it->second.module];
    if (c.first++ == 0) c.cause = it->second;
    if (c.first_step < 0 || s.row.step < c.first_step) c.first_step = s.row.step;
    c.steps.push_back(s.row.step);
    // A batch the loop dropped before backward is lost to the overflow as a skipped step is.
    const bool dropped = run.forward_dropped(s.row.step);
    c.dropped += dropped;
    c.evaluations += run.evaluation_nonfinite(s.row.step);
    const bool hurt = dropped || s.row.skipped || s.gradients_nonfinite() || run.loss_nonfinite(s.row);
    c.hurt += hurt;
    c.absorbed += !hurt;
    c.calibration += hurt && s.row.skipped && !harmful[i] && !dropped && !run.loss_nonfinite(s.row);
  }
  // Where the model absorbed the NaN/Inf in some steps (a tanh or a clamp after it), the
  // scaler's skips while it finds its level, with a finite loss, are the gradients'
  // overflow at a scale still too high, not this output's.
  for (auto& [path, c] : culprits)
    if (c.absorbed > 0) c.hurt -= c.calibration;
  std::vector<std::pair<std::string, Culprit>> ranked(culprits.begin(), culprits.end());
  std::sort(ranked.begin(), ranked.end(), [](const auto& a, const auto& b) {
    return (a.second.hurt > 0) != (b.second.hurt > 0) ? a.second.hurt > 0 : a.second.first > b.second.first;
  });
  bool top = true;
  for (const auto& [path, c] : ranked) {
    const ForwardCause& cause = c.cause;
    const std::string name = path.empty() ? "the model's own forward()" : path;
    Finding f;
    f.rule = "forward-nonfinite";
    f.severity = top ? Severity::kError : Severity::kWarning;
    f.module = path;
    f.confirmation = cause.confirmation;
    f.score = 95.0 * double(c.first) / double(std::max<std::int64_t>(1, with_module)) + (top ? 5.0 : 0.0);
    f.title = name + " is the first module whose output is NaN/Inf in forward";
    const std::string where = cause.own_code ? own_code_place(run, path, cause.first_seen) : "";
    if (cause.own_code) f.made_after = own_code_after(run, path, cause.first_seen);
    if (cause.own_code)
      f.title = (path.empty() ? "The first NaN/Inf in forward is made in the model's own forward(), outside its submodules"
                              : path + " produces the first NaN/Inf in forward, in its own code") +
                (where.empty() ? "" : ", " + where);
    f.evidence = "first non-finite output in forward order in " + std::to_string(c.first) + " of " +
                 plural(std::int64_t(run.steps.size()), "step") + ", from step " + std::to_string(c.first_step);
    f.steps.push_back(c.first_step);
    // Where the loop dropped the batches, their losses never reached the agent: no count to give.
    if (nonfinite_loss > 0) f.evidence += "; the loss was NaN/Inf in " + plural(nonfinite_loss, "step");
    if (c.dropped > 0) f.evidence += "; " + dropped_evidence(c.dropped);
    if (c.evaluations > 0)
      f.evidence += "; in " + plural(c.evaluations, "step") +
                    " it went NaN/Inf in an evaluation (the model in eval mode with gradients on), which trains nothing";
    if (cause.own_code)
      f.evidence += "; " + cause.first_seen + " showed it first but only received it (its FP32 replay was still NaN/Inf)";
    const InputBeyond beyond = cause.confirmation == "confirmed" ? input_beyond_fp16(run, path) : InputBeyond{};
    if (cause.confirmation == "confirmed") {
      f.evidence += "; " + confirmed_evidence(run, cause.fp32_absmax);
      f.score += 1.0;
      if (!beyond.what.empty()) {
        f.title = beyond.model_input ? "The model's input holds values beyond fp16's range: " + name +
                                           ", the first module to use them, turns them into Inf"
                                     : name + "'s input already holds values beyond fp16's range, which it turns into Inf";
        const bool named = beyond.what.rfind("the model's ", 0) == 0;  // the Python agent names the model's argument
        f.evidence += "; its input already held values fp16 cannot hold (" + beyond.what +
                      (beyond.model_input && !named ? ", the model's input itself" : "") +
                      "): autocast casts them to Inf for its fp16 operations before it computes anything";
      }
    } else if (cause.confirmation == "unconfirmed") {
      f.evidence += "; unconfirmed: " + cause.reason;
    }
    // Its overflows stopping once the agent pinned it is the pin's confirmation in training;
    // the finding stays, for the pin lasts only while attached.
    if (const rundb::EventRow* pin = autopinned(run, path)) {
      const auto after = std::count_if(c.steps.begin(), c.steps.end(), [&](std::int64_t st) { return st >= pin->step; });
      f.evidence += "; ampdiag pinned " + (pin->detail == path ? std::string("it") : pin->detail) +
                    " to FP32 at step " + std::to_string(pin->step) + " (autopin), " +
                    (after == 0 ? std::string("and it has not been first since: the pin held in training, and lasts "
                                              "only while attached (see autopin)")
                                : "and it was still first in " + plural(std::int64_t(after), "step") + " after");
    }
    if (cause.intrinsic) {
      // Not fp16's range: pinning cannot help, and a mask whose -inf the model absorbs
      // (the loss stayed finite) is no problem at all.
      const std::int64_t lost = nonfinite_losses_caused(run, path), hurt = lost + c.dropped;
      // Where the loss went NaN/Inf, a module after it that overflowed fp16 may have made it so.
      const ModuleSummary* after = hurt ? overflow_after_intrinsic(run, path) : nullptr;
      if (hurt == 0 || after) {
        if (after) {
          out.push_back(confirmed_overflow(run, *after, name, top ? Severity::kError : Severity::kWarning, f.score + 1.0));
          top = false;
        }
        f.severity = Severity::kInfo;
        f.score = 5.0;
        f.title = name + " outputs NaN/Inf from finite inputs, in FP32 too" +
                  (after ? "" : ", and the loss stays finite") + ": by design (a -inf mask), not an overflow";
        f.evidence += after ? "; the NaN/Inf that reached the loss came from " + after->info.path : "; the loss stayed finite";
        out.push_back(f);
        continue;  // the next culprit, if any, is the top one
      }
      if (lost > 0) f.evidence += "; the loss was NaN/Inf in " + plural(lost, "step") + " it started";
      f.blame = name;  // what a symptom's fix points to: no overflow
      if (const std::string buffers = replayed_buffers(run, path); !buffers_went_inf(buffers) && !buffers.empty()) {
        f.title = name + " makes NaN from finite inputs because its buffers hold NaN, not its code or fp16's range";
        f.evidence += "; when its FP32 replay ran, its buffers held NaN: " + buffers;
        f.suggestions.push_back(buffers_fix(run, path, buffers));
      } else if (!buffers.empty()) {
        f.title = name + " makes NaN/Inf from finite inputs because training wrote Inf into its buffers";
        f.evidence += "; when its FP32 replay ran, its buffers held Inf that they did not hold at attach(): " + buffers;
        f.suggestions.push_back(buffers_fix(run, path, buffers));
      } else {
        f.title = name + " makes NaN/Inf from finite inputs even in FP32: its code, not fp16's range";
        f.evidence += module_code_evidence(run, path);
        if (auto bound = bound_the_exponent_beyond_fp32(run, path)) f.suggestions.push_back(*bound);
        if (auto root = keep_the_root_off_zero(run, path)) f.suggestions.push_back(*root);
        f.suggestions.push_back({"Look at " + name + "'s code: from finite inputs it returns NaN/Inf in FP32 too (a log or "
                                 "a division by 0, an exp beyond float32, an inf fill, a softmax over a row whose every "
                                 "entry is masked: an empty sequence in a padding mask); pinning it to FP32 cannot help.",
                                 "", ""});
      }
      out.push_back(f);
      top = false;
      continue;
    }
    // A replayed module's fixes carry their own bf16 line.
    const bool replayed_pin = !path.empty() && cause.confirmation == "confirmed";
    if (replayed_pin) {
      f.suggestions = suggest::confirmed_fixes(run, path, cause.fp32_absmax);
      f.evidence += module_code_evidence(run, path);
      const std::vector<Suggestion> own = own_code_fixes(run, path, cause.fp32_absmax);
      f.suggestions.insert(f.suggestions.begin(), own.begin(), own.end());
      // Beyond fp16's range in FP32 too, from weights of its own that start far too large, with
      // no module above it to pin with what uses its output (a tied LM head 6e4 times too
      // large: logits up to 89850): nothing the replay confirmed is left to lead but bf16, and
      // the gain is the likelier cause; the other fixes stay, for a gain by design. With such
      // a module, its pin holds the overflow (a ViT block's MLP), and stays first.
      bool its_own = false;
      if (own.empty() && suggest::beyond_fp16(run, cause.fp32_absmax) && suggest::range_parent(run, path).empty())
        if (auto reinit = reinitialise_after(run, path, {}, &its_own); reinit && its_own) {
          by_design(f.suggestions.front());
          f.suggestions.insert(f.suggestions.begin(), *reinit);
        }
    } else if (!path.empty()) {
      f.suggestions.push_back(suggest::pin_fp32(run, path));
    } else if (!cause.own_code) {
      model_code_after_modules(run, c.steps, f);
    } else {
      f.suggestions.push_back({"Look at the model's own forward() " + (where.empty() ? "between its submodules" : where) +
                                   ": the NaN/Inf is made there, outside any module ampdiag hooks (an exp, a division "
                                   "or a sum in fp16; wrap that code in a module to have it named).",
                               "", ""});
    }
    if (run.fp16() && !replayed_pin) f.suggestions.push_back(suggest::use_bf16(run));
    if (cause.own_code) {
      f.evidence += input_code_evidence(run, cause.first_seen);
      const std::string who = path.empty() ? "the model's own forward()" : path + "'s own code";
      if (auto scaled = enlarging_in_input_code(run, cause.first_seen, who, where))
        f.suggestions.insert(f.suggestions.begin(), *scaled);
      if (auto exp = exp_in_input_code(run, cause.first_seen, who, where)) f.suggestions.insert(f.suggestions.begin(), *exp);
      if (auto matmul = matmul_in_input_code(run, cause.first_seen, who, where))
        f.suggestions.insert(f.suggestions.begin(), *matmul);
    }
    if (const CallGrowth* growth = recurrence(run, cause))
      recurrence_fixes(run, name, *growth, f);
    else if (const std::string calls = repeated_calls(run, cause); !calls.empty())
      f.evidence += "; " + calls;
    if (beyond.model_input) f.suggestions.insert(f.suggestions.begin(), scale_the_input());
    if (c.hurt == 0) {
      // The model absorbed it (a max, a mask): a latent overflow, not a lost step. Or only
      // evaluations showed it, which train nothing.
      f.severity = Severity::kWarning;
      if (c.evaluations < c.first && c.calibration > 0 && c.absorbed > 0)
        f.evidence += "; the model absorbed it: the loss stayed finite in those steps, and the only ones skipped (" +
                      std::to_string(c.calibration) + ") were the loss scale's calibration";
      else if (c.evaluations < c.first)
        f.evidence += "; the model absorbed it: none of those steps was skipped or had NaN/Inf gradients or loss";
    }
    out.push_back(f);
    top = top && c.hurt == 0;
  }
  if (Finding f = input_nan(run); !f.steps.empty()) out.push_back(f);
  if (!run.modules.empty()) {
    if (Finding f = loss_after_modules(run, known_losses); f.steps.size() > 0) {
      if (!top) f.severity = Severity::kWarning;
      out.push_back(f);
    }
  } else if (nonfinite_loss > 0) {
    Finding f;
    f.rule = "forward-nonfinite";
    f.severity = Severity::kError;
    f.score = 80.0;
    f.title = "The loss is NaN/Inf, but no module output was probed to say where it started";
    f.evidence = "loss non-finite in " + std::to_string(nonfinite_loss) + " of " + plural(known_losses, "step") +
                 ", first at step " + std::to_string(first_bad_loss);
    f.steps.push_back(first_bad_loss);
    if (run.first_event("compiled-after-attach")) {
      // The hooks were there, and torch.compile traced them into its graph, where they do nothing.
      f.evidence += "; the model was compiled with torch.compile after attach(), so its forward was not watched";
      f.suggestions.push_back({"Call attach() after torch.compile: the compiled model's hooks then run outside its graph.",
                               "model = torch.compile(model)\nhandle = ampdiag.attach(model, scaler)", ""});
    } else {
      f.suggestions.push_back({"Record activations: in Python attach with activations=True (the default); in C++ wrap "
                               "module outputs with agent.probe(\"path\", x).",
                               "handle = ampdiag.attach(model, scaler, activations=True)", "x = agent.probe(\"encoder.0\", x);"});
    }
    out.push_back(f);
  }
}

}  // namespace ampdiag::analyzer::rules
