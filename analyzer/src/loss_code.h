// The loss code (event "loss-code", written by the Python agent in a step whose loss, or the
// gradient reaching the model's output, went NaN/Inf while no module's output did): the
// operations between the model's outputs and the loss, and the fixes for those of them
// that make NaN/Inf from finite values.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ampdiag/analyzer/findings.h"
#include "ampdiag/analyzer/run.h"

namespace ampdiag::analyzer::loss_code {

struct Op {
  std::string name;   // autograd's name without "Backward0": "CtcLoss", "Sqrt"
  std::string dtype;  // the dtype it made in forward; "?" where torch did not say
  // A Div's or Mul's constant, as the agent wrote it ("Div(0.07)": x / 0.07), kept out of
  // `name`: 0 where the operand was a tensor of more than one value, or not said.
  double constant = 0.0;
  // How many times larger the operation makes its input: 1 / c for a division by c, c for
  // a multiplication; 1 where it has no constant.
  double gain() const;
};

struct Code {
  std::int64_t step = -1;  // the step it was read in; -1: none was recorded
  std::vector<Op> ops;     // in forward order, nearest the model's output first

  bool empty() const { return ops.empty(); }
  // Whether any operation made a float16 or bfloat16 tensor: the loss ran partly in half.
  bool any_half() const;
  // Whether every operation said its dtype and none computed in half (a half view of the
  // model's output computes nothing; a cast down to half does): computing the loss in FP32
  // cannot help it.
  bool all_full_precision() const;
  // Whether a float16 tensor (the model's output) is cast up to float32 in it: that cast's
  // backward casts the scaled gradient back down to float16, which overflows with the scale,
  // and where the output feeds several terms their Infs of both signs add up to NaN there.
  bool casts_half_up() const;
  // The operations that computed in float16 ("Mm, Div"), not those that only move or
  // view values (Permute, View, ToCopy); at most four.
  std::string float16_compute() const;
  // "ToCopy, LogSoftmax, CtcLoss, Mean (all float32)" or "..., Sum (float16), ...".
  std::string describe() const;
  // The operations that made float16 and that autocast runs in fp16 whatever their inputs'
  // dtype ("Mm", "Bmm and Convolution"; at most four): a pin before them does not reach them.
  std::string autocast_float16() const;
};

// The last operation of `code` that made float16 and multiplies its input by a constant of
// at least kEnlarging (x / tau, a temperature below 1/8; x * 1e4): in float16 every input
// above 65504 / gain passes the range, where float32 holds it. Null where none does. (A
// smaller factor, x * 2, leaves values up to 32752: too near the range to tell a cause.)
// `input_absmax` (0: unknown) is the largest |value| of the model's output: where only
// moves and views come before the operation, that is what it multiplies, and an operation
// whose input times its gain stays within the range made nothing (null then).
constexpr double kEnlarging = 8.0;
const Op* float16_enlarging(const Code& code, double input_absmax = 0.0);
// "the division by 0.07 (Div) multiplies what it divides by 14.29, so every value above
// 4585 passes fp16's 65504" for such an operation.
std::string enlarging_text(const Op& op, double fp_max);
// "ToCopy:float32, CtcLoss:float32" -> ops; malformed items are kept by name, dtype "?".
std::vector<Op> parse(const std::string& detail);

// The loss code read at the first of `steps` (ascending) that has one; empty where none.
// `kind` "model-code": the model's own forward() after its last module, read (by the
// Python agent) where the model's output went NaN/Inf while every module's was finite.
Code at_steps(const Run& run, const std::vector<std::int64_t>& steps, const std::string& kind = "loss-code");

// Where the loss code's backward made the NaN/Inf that reached the model's output (event
// "loss-code-origin", traced by the Python agent at a later step): the operations from the
// model's output to the first whose backward sent NaN/Inf back from finite gradients, that one
// last. Empty where none was traced.
Code origin(const Run& run);

// The loss code as the run's first backward was about to start (event "loss-code-first",
// from the Python agent, once a run): what a finding without a reading at its own steps
// (gradients too large for the scale, the loss finite) can still tell the loss by.
Code first(const Run& run);

// In a run without a GradScaler, the factor the loss code's last operation multiplies the loss
// by before backward() (a Mul by 2 or more, a Div by 1/2 or less: "(loss * 1024).backward()",
// a loss scale set by hand, apex-style); 0 where there is none.
double hand_scale(const Run& run);

// The code after a module, read (by the Python agent) where the gradient reaching its output
// held NaN/Inf: `kind` "output-code", the operations from its output to the loss ("PATH:
// ops"); "output-code-origin", those from its output to the first whose backward made the
// NaN/Inf, that one last. And the model's own parameters that code reads
// ("output-parameters", "PATH: logit_scale: 11.5 (float32, 1 value), read by Exp"; empty
// where none was recorded).
Code after_module(const Run& run, const std::string& module, const std::string& kind);
std::string parameters_after(const Run& run, const std::string& module);

// Where that code runs (event "output-code-place"): the model's own forward() (a model that
// returns its loss), the loss code after the model's output (the module's output is the
// model's), or both; unknown where the agent did not say (the C++ agent, older runs).
enum class Place { kUnknown, kModel, kLoss, kModelThenLoss };
Place place_after(const Run& run, const std::string& module);

// A tensor the loss code was given that held NaN/Inf before backward (event
// "loss-input-nonfinite", "MseLoss target: 1 NaN, 0 Inf of 32 values, float32"; older runs
// without the dtype): a target, a mask, another model's output, nothing this model's modules
// or the loss code made.
struct NonfiniteInput {
  std::int64_t step = -1;   // the first step it was seen in; -1: none
  std::string op, argument; // "MseLoss", "target"
  std::string counts;       // "1 NaN, 0 Inf of 32 values"
  std::string dtype;        // "float16"; empty where the run did not say
  // "float16" or "bfloat16" where it was float32 holding only that type's values (dtype
  // "float32 (float16 values)"): made in half precision, then cast up; else empty.
  std::string made_in;
  std::int64_t seen = 0;    // steps of `steps` it was seen in
  std::int64_t looked = 0;  // steps of `steps` whose loss code was read
};
NonfiniteInput nonfinite_input_at(const Run& run, const std::vector<std::int64_t>& steps);

// Whether the NaN/Inf is in the loss itself or only in its gradient.
enum class Phase { kForward, kBackward };

struct Fix {
  std::string op;     // the operation's name, as in the code
  std::string dtype;  // the dtype it ran in
  Suggestion suggestion;
  bool range = false;  // its NaN/Inf is a value passing the range (exp, cosh), not a singular point
};

// One fix per operation in `code` known to make NaN/Inf from finite values in `phase` (a
// CTC target that cannot be aligned, the gradient of sqrt at 0), in forward order: the
// first is the likeliest origin (the ones after it may only carry its NaN/Inf on). Empty
// where none is known.
std::vector<Fix> fixes(const Code& code, Phase phase);

// "Else, (Div can make NaN/Inf too) look at ..." after the first of `found`: `look` is what
// else to look at, starting "Look at"; `look` itself where nothing was found.
std::string look_also(const std::vector<Fix>& found, const std::string& look);

// The fixes for a NaN/Inf loss made in the loss code: the first known operation's, then
// `look`, then computing the loss in FP32 unless the loss code ran in float32 throughout
// (`look` then says it will not help). Where that operation ran in float16, its NaN/Inf
// may be fp16's range as well (a division by 0.07 overflows as surely as one by 0, a
// probability below 6e-8 is 0 before its log): the FP32 loss comes first. `output_absmax`
// (0: unknown): the largest |value| of the model's output, which float16_enlarging reads.
std::vector<Suggestion> forward_suggestions(const Code& code, const std::string& look, double output_absmax = 0.0);

}  // namespace ampdiag::analyzer::loss_code
