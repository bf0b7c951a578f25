// training-raised: the training raised inside the Python agent's `with attach(...)` block,
// or an exception unwound a LibTorch loop past its Agent (event training-raised, recorded
// at the step it was in, which never ended; C++'s carries a message where the loop caught
// it and called Agent::training_raised()). The report
// covers the steps before it, and without this finding a run that crashed on its second
// step read "HEALTHY". The common numerical case is torch's clip_grad_norm_(...,
// error_if_nonfinite=True) refusing NaN/Inf gradients in a loop with a loss scaler: the
// scaler's first steps overflow by design while it comes down from init_scale, and every
// growth probe may overflow again; scaler.step() skips those steps, and the option turns
// each of them into a crash. So does torch.autograd.set_detect_anomaly(True), which users turn
// on to find a NaN: it raises at the first NaN a backward makes, the scaler's own included. A
// user's Ctrl-C (KeyboardInterrupt) is no finding.
#include <string>

#include "rules.h"
#include "suggestions.h"

namespace ampdiag::analyzer::rules {

bool clip_refused_nonfinite(const std::string& raised) {
  // torch's message since 1.9: "The total norm of order 2.0 for gradients from `parameters`
  // is non-finite, so it cannot be clipped. To disable this error ... error_if_nonfinite=False"
  return raised.find("non-finite, so it cannot be clipped") != std::string::npos;
}

std::string clip_with_scaler_fix() {
  return "With a GradScaler, leave clip_grad_norm_'s error_if_nonfinite at False (its default): a step whose "
         "gradients hold NaN/Inf is the scaler's to skip (scaler.step() does, and lowers the scale), and its first "
         "steps overflow by design while it comes down from init_scale.";
}

namespace {

// torch's anomaly detection (torch.autograd.set_detect_anomaly(True), or C++'s AnomalyMode)
// on a NaN a backward function made: "Function 'AddmmBackward0' returned nan values in its
// 0th output."
bool anomaly_refused_nan(const std::string& raised) {
  return raised.find("' returned nan values in its ") != std::string::npos;
}

// "AddmmBackward0" out of that message; empty where it names none.
std::string anomaly_function(const std::string& raised) {
  const std::size_t open = raised.find("Function '");
  const std::size_t close = open == std::string::npos ? open : raised.find('\'', open + 10);
  return close == std::string::npos ? "" : raised.substr(open + 10, close - open - 10);
}

std::string anomaly_fix(const Run& run) {
  if (run.has_scaler())
    return "Turn anomaly detection off (torch.autograd.set_detect_anomaly(False)) with a GradScaler: it raises at the "
           "first NaN a backward makes, and the scaler makes them on purpose (its first steps overflow while it comes "
           "down from init_scale, and so may each growth probe) and skips those steps. ampdiag records which layer's "
           "gradient goes NaN/Inf first, and whether that lasts, without stopping the training.";
  return "Run once without anomaly detection (torch.autograd.set_detect_anomaly(False)): that step was never recorded, "
         "and ampdiag then records which module's output and which layer's gradient go NaN/Inf first, where anomaly "
         "detection names only the backward function.";
}

// torch's GradScaler._unscale_grads_ on a float16 gradient (the model was .half()'d).
bool unscale_refused_fp16(const std::string& raised) {
  return raised.find("Attempting to unscale FP16 gradients") != std::string::npos;
}

// torch refusing a constant that float16 cannot hold ("value cannot be converted to type
// c10::Half without overflow"; "at::Half" in older torch): code written for float32 that
// masks with -1e9 or 1e4 squared, given a tensor autocast made in float16.
bool half_fill_overflow(const std::string& raised) {
  return raised.find("cannot be converted to type") != std::string::npos &&
         raised.find("Half without overflow") != std::string::npos;
}

// oneDNN, torch's CPU kernels, has no float16 recurrent layer on most CPUs, and autocast gives
// one float16 inputs: "could not create a primitive descriptor for the LSTM forward
// propagation primitive". The layer's kind ("LSTM"), or empty for another refusal.
std::string onednn_refused_rnn(const std::string& raised) {
  const std::string text = "could not create a primitive descriptor for the ";
  const std::size_t at = raised.find(text);
  if (at == std::string::npos) return "";
  const std::string kind = raised.substr(at + text.size(), raised.find(' ', at + text.size()) - at - text.size());
  if (kind == "vanilla") return "RNN";  // "the vanilla RNN ..."
  return kind == "LSTM" || kind == "GRU" || kind == "RNN" ? kind : "";
}

// The fix for that refusal: the module the exception left (event "training-raised-in",
// "rnn (LSTM)") in FP32, or bfloat16, which those kernels have; in the words of the agent's
// language, since a LibTorch loop has no ampdiag.pin_fp32().
std::string rnn_refusal_fix(const Run& run, const std::string& kind) {
  const rundb::EventRow* in = run.first_event("training-raised-in");
  const std::string module = in ? in->detail.substr(0, in->detail.find(" (")) : "the " + kind;
  const bool python = suggest::python_agent(run);
  const std::string pin = !in ? ""
                          : python ? " (ampdiag.pin_fp32(" + suggest::python_attribute(module) + "))"
                                   : " (ampdiag::Fp32Pins, ampdiag/pin_fp32.h)";
  return "torch's CPU kernels (oneDNN) have no float16 " + kind + " on this CPU, and autocast gave it float16 inputs: "
         "run " + module + " in FP32" + pin + ", autocast off inside it and its inputs cast to float32, or autocast " +
         (python ? "with dtype=torch.bfloat16" : "in at::kBFloat16") + ", which those kernels support.";
}

// torch.amp.GradScaler's own refusals of a loop that calls it out of order, by their text
// (torch/amp/grad_scaler.py), with what the loop should do instead.
struct ScalerRefusal {
  const char* text;
  const char* fix;
};
constexpr ScalerRefusal kScalerRefusals[] = {
    {"No inf checks were recorded for this optimizer",
     "scaler.step(optimizer) found no gradient in any of the optimizer's parameters: the backward before it reached "
     "none of them (a loss made under torch.no_grad() or from a detached tensor, parameters that are all frozen, or "
     "no scaler.scale(loss).backward() since the last update()). Step only an optimizer whose parameters the step's "
     "loss depends on, after its backward."},
    {"unscale_() has already been called on this optimizer since the last update()",
     "Call scaler.unscale_(optimizer) once per optimizer per step, after the step's last backward (with gradient "
     "accumulation: not inside the micro-batch loop), then clip, scaler.step(optimizer) and scaler.update()."},
    {"unscale_() is being called after step()",
     "Unscale and clip before the optimizer steps: scaler.unscale_(optimizer), clip, scaler.step(optimizer), then "
     "scaler.update()."},
    {"step() has already been called since the last update()",
     "Call scaler.update() once after each step's scaler.step() calls, every step: a second scaler.step() before it "
     "is refused."},
    // step(), unscale_() or update() before any scaler.scale(): the scale is made there.
    {"but _scale is None",
     "Scale the loss before its backward: scaler.scale(loss).backward(), not loss.backward(). The scaler makes its "
     "scale at its first scale() call; without one, its step() has no scale to divide the gradients by."},
    {"No inf checks were recorded prior to update",
     "Call scaler.step(optimizer) before scaler.update() in each step: update() reads what the step's unscale found, "
     "and an update() after no step is refused."},
    // torch's fused unscale has no complex kernel (a Fourier layer's cfloat weights): the
    // scaler fails at its first unscale, before any step.
    {"_amp_foreach_non_finite_check_and_unscale_cpu\" not implemented for 'ComplexFloat'",
     "GradScaler cannot unscale complex gradients (torch's unscale has no complex kernel on the CPU): keep each "
     "complex weight as a real Parameter, nn.Parameter(torch.view_as_real(w)), and use torch.view_as_complex(self.w) "
     "in forward; or train in bfloat16 without a scaler."},
    {"Closure use is not currently supported if GradScaler is enabled",
     "GradScaler cannot step an optimizer with a closure (LBFGS re-evaluates the loss inside step()): train that "
     "optimizer in float32 or bfloat16, without a loss scaler."},
};

}  // namespace

std::string raised_fix(const Run& run, const std::string& raised) {
  if (clip_refused_nonfinite(raised) && run.has_scaler()) return clip_with_scaler_fix();
  if (anomaly_refused_nan(raised)) return anomaly_fix(run);
  if (unscale_refused_fp16(raised))
    return "A GradScaler unscales FP32 gradients only: keep the parameters in float32 (no model.half()) and run the "
           "forward under torch.autocast(device_type=..., dtype=torch.float16); the optimizer then updates FP32 master "
           "weights, and the scaler protects the fp16 activations' gradients.";
  if (half_fill_overflow(raised))
    return "A constant beyond float16's range (65504) was written into a float16 tensor: code written for float32, "
           "such as scores.masked_fill(mask, -1e9), given scores that autocast made in float16. Use the tensor's own "
           "limit, masked_fill(mask, torch.finfo(scores.dtype).min), or float('-inf') where no row is masked whole; or "
           "compute those scores in float32 (scores.float()).";
  if (raised.find(kScalerRefusals[0].text) != std::string::npos && run.first_event("gradients-set-to-none"))
    // The agent saw the step's backward reach the optimizer's parameters and their .grad
    // gone at the unscale: the usual cause, said instead of every possible one.
    return "The step's backward reached the optimizer's parameters, and their .grad was None when scaler.step() read "
           "them: something set them to None in between, as optimizer.zero_grad() does (set_to_none=True is its "
           "default). Zero the gradients before the forward, or after scaler.update(), never between backward and "
           "scaler.step().";
  for (const auto& refusal : kScalerRefusals)
    if (raised.find(refusal.text) != std::string::npos) return refusal.fix;
  if (const std::string kind = onednn_refused_rnn(raised); !kind.empty()) return rnn_refusal_fix(run, kind);
  return "";
}

void training_raised(const Run& run, std::vector<Finding>& out) {
  const rundb::EventRow* e = run.first_event("training-raised");
  if (!e || e->detail.rfind("KeyboardInterrupt", 0) == 0 || e->detail.rfind("SystemExit", 0) == 0) return;
  const std::int64_t step = e->step >= 0 ? e->step : (run.steps.empty() ? 0 : run.steps.back().row.step + 1);
  const std::string kind = e->detail.substr(0, e->detail.find(": "));  // C++'s types hold "::"
  // A warning unless the scaler would have carried the training past it.
  Finding f;
  f.rule = "training-raised";
  f.severity = Severity::kWarning;
  f.score = 10.0;
  f.steps = {step};
  std::string raised = e->detail;
  if (!raised.empty() && raised.back() == '.') raised.pop_back();  // torch's messages end a sentence
  f.evidence = "step " + std::to_string(step) + " raised " + raised + "; the run.db holds the " +
               plural(std::int64_t(run.steps.size()), "step") + " before it";
  if (anomaly_refused_nan(e->detail)) {
    const std::string function = anomaly_function(e->detail);
    const std::string in = function.empty() ? std::string() : " (in " + function + ")";
    const std::string python = "torch.autograd.set_detect_anomaly(False)";
    const std::string cpp = "torch::autograd::AnomalyMode::set_enabled(false);";
    if (run.has_scaler()) {
      f.severity = Severity::kError;
      f.score = 103.0;  // the run ended on it, as on the clip refusal below
      f.title = "The training stopped at step " + std::to_string(step) + ": anomaly detection raised on a NaN in the "
                "backward" + in + " that scaler.step() would have skipped";
      if (!run.steps.empty()) f.evidence += "; the loss scale was " + fmt(run.steps.back().row.scale_after);
      f.suggestions.push_back({anomaly_fix(run), python + "  # the scaler skips steps whose gradients hold NaN/Inf",
                               cpp + "  // the scaler skips steps whose gradients hold NaN/Inf", ""});
    } else {
      f.title = "The training stopped at step " + std::to_string(step) + ": anomaly detection raised on a NaN the "
                "backward made" + in;
      f.suggestions.push_back({anomaly_fix(run), python, cpp, ""});
    }
    out.push_back(f);
    return;
  }
  if (!clip_refused_nonfinite(e->detail)) {
    f.title = "The training raised " + kind + " at step " + std::to_string(step) +
              " and stopped: this report covers the steps before it";
    if (unscale_refused_fp16(e->detail))
      f.suggestions.push_back(suggest::fp32_master_weights(run));
    else if (std::string fix = raised_fix(run, e->detail); !fix.empty())
      f.suggestions.push_back({std::move(fix), "", "", ""});
    out.push_back(f);
    return;
  }
  if (!run.has_scaler()) {
    f.title = "The training stopped at step " + std::to_string(step) +
              ": clip_grad_norm_(error_if_nonfinite=True) raised on NaN/Inf gradients";
    f.suggestions.push_back({"That step's gradients held NaN/Inf, and it was never recorded: run past it once without "
                             "error_if_nonfinite=True, and ampdiag records where they start.",
                             "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # error_if_nonfinite=False",
                             "torch::nn::utils::clip_grad_norm_(model->parameters(), max_norm);", ""});
    out.push_back(f);
    return;
  }
  f.severity = Severity::kError;
  f.score = 103.0;  // the run ended on it: above the scaler-use findings (101)
  f.title = "The training stopped at step " + std::to_string(step) +
            ": clip_grad_norm_(error_if_nonfinite=True) raised on NaN/Inf gradients that scaler.step() would have "
            "skipped";
  if (!run.steps.empty()) f.evidence += "; the loss scale was " + fmt(run.steps.back().row.scale_after);
  f.suggestions.push_back({clip_with_scaler_fix(),
                           "scaler.scale(loss).backward()\n"
                           "scaler.unscale_(optimizer)\n"
                           "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # no error_if_nonfinite=True\n"
                           "scaler.step(optimizer)  # skips the step if the gradients hold NaN/Inf\n"
                           "scaler.update()",
                           "scaler.scale(loss).backward();  // ampdiag::GradScaler\n"
                           "scaler.unscale_(optimizer);\n"
                           "torch::nn::utils::clip_grad_norm_(model->parameters(), max_norm);  // error_if_nonfinite "
                           "false\n"
                           "scaler.step(optimizer);  // skips the step if the gradients hold NaN/Inf\n"
                           "scaler.update();",
                           ""});
  out.push_back(f);
}

}  // namespace ampdiag::analyzer::rules
