// The fix for a module whose buffers hold NaN, or Inf that training wrote (event "buffers-nan").
#include "buffers_fix.h"

#include <string>
#include <vector>

#include "ampdiag/analyzer/causes.h"
#include "suggestions.h"

namespace ampdiag::analyzer::rules {

namespace {

// The buffers of a "buffers-nan" list ("codebook (float16: 7 of 2048 values Inf, finite at
// attach()), ema (float32: ...)") stored in `dtype`: a pin changes how the module computes,
// not what dtype its buffers keep.
std::vector<std::string> buffers_stored_in(const std::string& buffers, const std::string& dtype) {
  const std::string tag = dtype + ":";
  std::vector<std::string> names;
  std::string name;
  int depth = 0;
  for (std::size_t i = 0; i < buffers.size(); ++i) {
    const char c = buffers[i];
    if (c == '(' && depth++ == 0) {
      while (!name.empty() && name.back() == ' ') name.pop_back();
      if (buffers.compare(i + 1, tag.size(), tag) == 0) names.push_back(name);
    } else if (c == ')') {
      --depth;
    } else if (depth == 0) {
      if (c == ',') name.clear();
      else if (c != ' ' || !name.empty()) name += c;
    }
  }
  return names;
}

// The lines that store `names` of the module at `path` in float32 from now on.
void keep_buffers_float32(Suggestion& pin, const std::string& path, const std::vector<std::string>& names) {
  const std::string attr = suggest::python_attribute(path);
  std::string python, cpp;
  for (const std::string& b : names) {
    python += attr + "." + b + " = " + attr + "." + b + ".float()  # or register_buffer(..., dtype=torch.float32)\n";
    cpp += "{ at::Tensor b = module->named_buffers(false)[\"" + b + "\"]; b.set_data(b.to(at::kFloat)); }\n";
  }
  pin.python = python + pin.python;
  pin.cpp = "// module: the one at " + path + "; its float16 buffers in float32, then its pin\n" + cpp + pin.cpp;
}

}  // namespace

// Replacing them: a BatchNorm's running statistics are reset (and recomputed in train
// mode); any other buffer is named for the user to restore. Buffers a step wrote Inf into
// are computed in FP32 from then on: the module's pin, as its forward updates them, and
// float16 ones stored in float32, which the pin alone leaves as they are. A bfloat16 buffer
// already has float32's range: computed in FP32, its update is finite again.
Suggestion buffers_fix(const Run& run, const std::string& path, const std::string& buffers) {
  const std::string name = path.empty() ? "the model" : path;
  if (buffers_went_inf(buffers) && !path.empty()) {
    Suggestion pin = suggest::pin_fp32(run, path);
    const std::vector<std::string> half = buffers_stored_in(buffers, "float16");
    std::string listed;
    for (const std::string& b : half) listed += (listed.empty() ? "" : ", ") + b;
    const std::string wide =
        buffers_stored_in(buffers, "bfloat16").empty() ? "a float32 buffer" : "a float32 or bfloat16 buffer";
    pin.summary = (half.empty() ? "Update " + name + "'s buffers in FP32: run " + name
                                : "Keep " + name + "'s float16 buffers in float32 (" + listed + ") and run " + name) +
                  " in FP32 (autocast off around it, its floating-point inputs cast to float32). They held no Inf at "
                  "attach(), so a step wrote values beyond range into them: " +
                  (half.empty() ? wide + " reaches Inf only past 3.4e38, or from a value computed in float16, "
                                  "as autocast computes a matmul or a convolution in its forward (an EMA codebook's "
                                  "sum of a batch's vectors, one-hot times z, passes 65504)"
                                : "a float16 buffer holds no value beyond 65504 and rounds what its update computes, "
                                  "whatever dtype the module computes in, so pinning it alone cannot help") +
                  ". Start from buffers without Inf: a new run, or a checkpoint from before.";
    if (!half.empty()) keep_buffers_float32(pin, path, half);
    return pin;
  }
  if (buffers.find("running_var") != std::string::npos || buffers.find("running_mean") != std::string::npos)
    return {"Reset " + name + "'s running statistics, which a checkpoint saved after a NaN batch (or an earlier step's "
                "NaN in train mode) left NaN: reset_running_stats(), then a few batches in train mode to recompute "
                "them, or load a checkpoint from before; pinning it to FP32 cannot help.",
            suggest::python_attribute(path) + ".reset_running_stats()",
            "// the BatchNorm module at " + path + ":\nbn->reset_running_stats();", ""};
  return {"Restore " + name + "'s buffers (" + buffers +
              "): a checkpoint, or an earlier step's NaN, wrote NaN into them, and every output made from them is NaN; "
              "pinning it to FP32 cannot help.",
          "", "", ""};
}

}  // namespace ampdiag::analyzer::rules
