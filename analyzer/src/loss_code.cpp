// The loss code's operations, and what each of them needs to stay finite.
#include "loss_code.h"

#include "suggestions.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <set>

namespace ampdiag::analyzer::loss_code {

namespace {

bool half(const std::string& dtype) { return dtype == "float16" || dtype == "bfloat16"; }

// What an operation does wrong at the values where it is NaN/Inf, in each phase: empty
// where it is finite there in that phase. Only operations that make NaN/Inf from finite
// values in any precision: the fp16 overflows of the others are fp32_loss()'s.
struct Known {
  std::vector<std::string> names;
  Suggestion forward, backward;
  // Where the operation ran in half precision, the constant by which its fix keeps the
  // argument off a point may round away (1e-12 is 0 in float16, 1 - 1e-7 is 1 in both
  // halves): the fix then casts the argument to float32 first (each snippet's text to
  // replace, Python and C++), and says why. Empty where the fix holds in any precision.
  struct InFloat32 {
    std::string python_from, python_to, cpp_from, cpp_to, why;
    bool bfloat16 = false;  // bfloat16 rounds it away too (it keeps fp32's range, not its precision)
  } in_float32{};
  // Its NaN/Inf is a value passing the range (exp, cosh), not a point where it is undefined
  // or infinite (log of 0, sqrt's gradient at 0).
  bool range = false;
};

constexpr const char* kTiny =
    " It ran in float16, where 1e-12 rounds to 0: clamp in float32, in the loss computed in FP32 (its own fix), since "
    "the large gradient near the clamp overflows when sent back in float16.";

constexpr const char* kCtcPython =
    "ctc = nn.CTCLoss(blank=0, zero_infinity=True)\n"
    "# a Hugging Face Wav2Vec2ForCTC (or another *ForCTC model) passes its config's:\n"
    "model.config.ctc_zero_infinity = True";

const std::vector<Known>& known() {
  static const std::vector<Known> table = {
      {{"CtcLoss"},
       {"CTCLoss is Inf for a sample whose target cannot be aligned with its input (a target longer than the input's "
        "frames, counting a blank between repeated labels), in any precision: zero_infinity=True gives those samples "
        "a zero loss and gradient (in a Hugging Face *ForCTC model, which computes the loss itself: "
        "config.ctc_zero_infinity=True), or drop them from the batch.",
        kCtcPython, "torch::nn::CTCLoss ctc(torch::nn::CTCLossOptions().blank(0).zero_infinity(true));", ""},
       {"CTCLoss's gradient is NaN for a sample whose target cannot be aligned with its input: zero_infinity=True "
        "gives those samples a zero loss and gradient (in a Hugging Face *ForCTC model, which computes the loss "
        "itself: config.ctc_zero_infinity=True), or drop them from the batch.",
        kCtcPython, "torch::nn::CTCLoss ctc(torch::nn::CTCLossOptions().blank(0).zero_infinity(true));", ""}},
      {{"NllLoss", "NllLoss2D"},
       {"nll_loss / cross_entropy with reduction='mean' is 0/0 = NaN when every target of the batch is ignore_index: "
        "skip such batches, or sum and divide by the count of kept targets, at least 1.",
        "loss = F.cross_entropy(logits, y, ignore_index=-100, reduction=\"sum\") / (y != -100).sum().clamp_min(1)",
        "auto loss = torch::nn::functional::cross_entropy(logits, y, torch::nn::functional::CrossEntropyFuncOptions()"
        ".ignore_index(-100).reduction(torch::kSum)) / (y != -100).sum().clamp_min(1);",
        ""},
       {}},
      {{"Log", "Log2", "Log10"},
       {"log() of 0 is -Inf, and of a negative number NaN: clamp its argument, or take log_softmax / logsigmoid "
        "instead of the log of a softmax / sigmoid.",
        "logp = p.clamp_min(1e-12).log()  # or F.log_softmax(logits, -1)",
        "auto logp = p.clamp_min(1e-12).log();  // or torch::log_softmax(logits, -1)", ""},
       {"log()'s gradient at 0 is infinite: clamp its argument, or take log_softmax / logsigmoid instead of the log "
        "of a softmax / sigmoid.",
        "logp = p.clamp_min(1e-12).log()  # or F.log_softmax(logits, -1)",
        "auto logp = p.clamp_min(1e-12).log();  // or torch::log_softmax(logits, -1)", ""},
       {"p.clamp_min", "p.float().clamp_min", "p.clamp_min", "p.to(torch::kFloat).clamp_min", kTiny}},
      {{"Sqrt", "Rsqrt"},
       {"sqrt() of a negative number is NaN (rounding can leave a difference of squares just below 0): clamp its "
        "argument at 0.",
        "d = x.clamp_min(0).sqrt()", "auto d = x.clamp_min(0).sqrt();", ""},
       {"sqrt()'s gradient at 0 is infinite (the distance from a point to itself): keep its argument above 0.",
        "d = (x + 1e-12).sqrt()  # sqrt(0)'s gradient is infinite",
        "auto d = (x + 1e-12).sqrt();  // sqrt(0)'s gradient is infinite", ""},
       {"(x + 1e-12)", "(x.float() + 1e-12)", "(x + 1e-12)", "(x.to(torch::kFloat) + 1e-12)", kTiny}},
      {{"Acos", "Asin"},
       {"acos() / asin() beyond [-1, 1] is NaN (rounding makes a cosine of 1.0000001): clamp the argument.",
        "angle = torch.acos(cos.clamp(-1 + 1e-7, 1 - 1e-7))", "auto angle = torch::acos(cos.clamp(-1 + 1e-7, 1 - 1e-7));",
        ""},
       {"acos() / asin()'s gradient at -1 and 1 is infinite: clamp the argument inside the interval.",
        "angle = torch.acos(cos.clamp(-1 + 1e-7, 1 - 1e-7))", "auto angle = torch::acos(cos.clamp(-1 + 1e-7, 1 - 1e-7));",
        ""},
       {"cos.clamp", "cos.float().clamp", "cos.clamp", "cos.to(torch::kFloat).clamp",
        " It ran in half precision, where 1 - 1e-7 rounds to 1: clamp in float32, in the loss computed in FP32 "
        "(its own fix).", true}},
      {{"Div"},
       {"A division by 0 (a count, a norm or a sum of weights that is 0 in some batch) is Inf or NaN: clamp the "
        "denominator away from 0.",
        "out = num / den.clamp_min(1e-12)", "auto out = num / den.clamp_min(1e-12);", ""},
       {"a / b's gradient at b = 0 is infinite: clamp the denominator away from 0.", "out = num / den.clamp_min(1e-12)",
        "auto out = num / den.clamp_min(1e-12);", ""},
       {"den.clamp_min", "den.float().clamp_min", "den.clamp_min", "den.to(torch::kFloat).clamp_min", kTiny}},
      {{"Pow"},
       {},
       {"x ** p with p below 1 (x ** 0.5 is a square root) has an infinite gradient at x = 0: keep x above 0.",
        "y = (x + 1e-12) ** p", "auto y = (x + 1e-12).pow(p);", ""},
       {"(x + 1e-12)", "(x.float() + 1e-12)", "(x + 1e-12)", "(x.to(torch::kFloat) + 1e-12)", kTiny}},
      {{"Where"},
       {},
       {"torch.where() sends the gradient of the branch it does not select as 0 times that branch's own gradient: "
        "Inf there (sqrt, log or a division at the values it masks) makes NaN. Make both branches finite everywhere: "
        "clamp the argument before the operation, then select.",
        "y = torch.where(x > 0, x.clamp_min(1e-12).sqrt(), 0.0)",
        "auto y = torch::where(x > 0, x.clamp_min(1e-12).sqrt(), torch::zeros_like(x));", ""},
       {"x.clamp_min(1e-12)", "x.float().clamp_min(1e-12)", "x.clamp_min(1e-12)",
        "x.to(torch::kFloat).clamp_min(1e-12)", kTiny}},
      {{"Exp"},
       {"exp() overflows above 88.7 in float32 (11.1 in float16): subtract the maximum first (logsumexp), or clamp "
        "its argument.",
        "y = torch.logsumexp(x, dim=-1)  # not x.exp().sum(-1).log()", "auto y = torch::logsumexp(x, -1);", ""},
       {},
       {},
       true},
      {{"Cosh", "Sinh"},
       {"cosh() / sinh() overflow above 89.4 in float32 (11.8 in float16), so log(cosh(x)), a log-cosh loss written "
        "as it reads, is Inf for residuals that large in any precision: take its stable form, |x| + softplus(-2|x|) - "
        "log 2, finite for every x.",
        "loss = (d.abs() + F.softplus(-2 * d.abs()) - math.log(2)).mean()  # log(cosh(d)), d = pred - y",
        "auto loss = (d.abs() + torch::nn::functional::softplus(-2 * d.abs()) - std::log(2.0)).mean();  // log(cosh(d))",
        ""},
       {},
       {},
       true},
  };
  return table;
}

// Whether nll_loss, as the agent wrote it ("NllLoss(none)", "NllLoss(mean of 12)"), can be
// 0/0: only a mean, and only over a total target weight of 0. Without the reduction (an
// older run.db) or the weight (read after backward freed it), nothing disproves it.
bool nll_can_be_nan(const std::string& args) {
  if (args.empty()) return true;
  if (args.rfind("mean", 0) != 0) return false;
  const std::size_t of = args.find(" of ");
  return of == std::string::npos || std::strtod(args.c_str() + of + 4, nullptr) == 0.0;
}

// Whether `op` can make NaN/Inf from finite values as `k` says. A power says its exponent
// ("Pow(0.5)"): one of 1 or more is finite wherever its base is; without one, it may be
// anything.
bool matches(const Op& op, const Known& k) {
  // A division by a constant other than 0 (a temperature) is finite wherever its dividend is,
  // but for fp16's range (float16_enlarging).
  if (op.name == "Div" && op.constant != 0.0) return false;
  const std::size_t paren = op.name.find('(');
  const std::string base = op.name.substr(0, paren);
  if (std::find(k.names.begin(), k.names.end(), base) == k.names.end()) return false;
  if (paren == std::string::npos) return true;
  const std::string args = op.name.substr(paren + 1, op.name.size() - paren - 2);
  if (base == "NllLoss" || base == "NllLoss2D") return nll_can_be_nan(args);
  if (base != "Pow") return true;
  char* end = nullptr;
  const double p = std::strtod(args.c_str(), &end);
  return end == args.c_str() || p < 1.0;
}

// Operations that only move, view or copy values: in half precision they compute nothing
// (a ToCopy that made a half tensor is a cast down, which can overflow: see all_full_precision).
bool moves(const std::string& name) {
  static const std::set<std::string> names = {"View", "Reshape", "Permute", "Transpose", "T", "Unsqueeze", "Squeeze",
                                              "Expand", "Select", "Slice", "Index", "Clone", "ToCopy", "Cat", "Stack",
                                              "Split", "Unbind", "Contiguous", "AsStrided", "Alias", "UnsafeView"};
  return names.count(name) > 0;
}

}  // namespace

double Op::gain() const {
  if (constant == 0.0) return 1.0;
  return name == "Div" ? 1.0 / std::fabs(constant) : name == "Mul" ? std::fabs(constant) : 1.0;
}

const Op* float16_enlarging(const Code& code, double input_absmax) {
  const auto op = std::find_if(code.ops.rbegin(), code.ops.rend(),
                               [](const Op& o) { return o.dtype == "float16" && o.gain() >= kEnlarging; });
  if (op == code.ops.rend()) return nullptr;
  // x * 255 on outputs of at most 2.4 makes at most 612: the Inf came later (a Gram
  // matrix's sum over a feature map), however much it multiplies.
  const bool takes_output = std::all_of(code.ops.begin(), op.base() - 1, [](const Op& o) { return moves(o.name); });
  if (takes_output && input_absmax > 0.0 && input_absmax * op->gain() < 65504.0) return nullptr;
  return &*op;
}

std::string enlarging_text(const Op& op, double fp_max) {
  // Four digits, whole numbers up to a billion written out (10000, not 1e+04).
  const auto g = [](double v) {
    char b[32];
    std::snprintf(b, sizeof b, v >= 1e4 && v < 1e9 ? "%.0f" : "%.4g", v);
    return std::string(b);
  };
  const bool div = op.name == "Div";
  return "the " + std::string(div ? "division" : "multiplication") + " by " + g(op.constant) + " (" + op.name +
         ") multiplies " + (div ? "what it divides" : "its input") + " by " + g(op.gain()) + ", so every value above " +
         g(fp_max / op.gain()) + " passes fp16's " + std::to_string(std::lround(fp_max));
}

bool Code::any_half() const {
  return std::any_of(ops.begin(), ops.end(), [](const Op& op) { return half(op.dtype); });
}

bool Code::all_full_precision() const {
  // logits.view(-1, V).float(): the view of the model's half output is half, and computes nothing.
  return !ops.empty() && std::all_of(ops.begin(), ops.end(), [](const Op& op) {
           return op.dtype != "?" && (!half(op.dtype) || (moves(op.name) && op.name != "ToCopy"));
         });
}

bool Code::casts_half_up() const {
  const auto first_half = std::find_if(ops.begin(), ops.end(), [](const Op& op) { return op.dtype == "float16"; });
  return std::any_of(first_half, ops.end(), [](const Op& op) { return op.name == "ToCopy" && op.dtype == "float32"; });
}

namespace {

// Autograd's names for the operations CPU and CUDA autocast put in fp16 whatever their
// inputs' dtype (matmuls, convolutions, attention), where those made float16.
bool autocast_half_op(const std::string& name) {
  static const std::set<std::string> names = {"Mm", "Bmm", "Addmm", "Baddbmm", "Addbmm", "Addmv", "Mv", "Dot",
                                              "Convolution", "LinalgVecdot", "PreluKernel", "MkldnnRnnLayer",
                                              "CudnnRnn", "ConvTbc"};
  return names.count(name) > 0 || name.rfind("ScaledDotProduct", 0) == 0;
}

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (std::size_t i = 0; i < names.size() && i < 4; ++i)
    out += (i == 0 ? "" : i + 1 == std::min<std::size_t>(names.size(), 4) ? " and " : ", ") + names[i];
  return out;
}

// The distinct names of the operations of `ops` that made float16 and that `keep` keeps.
template <class Keep>
std::string float16_ops(const std::vector<Op>& ops, Keep keep) {
  std::vector<std::string> names;
  for (const auto& op : ops)
    if (op.dtype == "float16" && keep(op.name) && std::find(names.begin(), names.end(), op.name) == names.end())
      names.push_back(op.name);
  return joined(names);
}

}  // namespace

std::string Code::float16_compute() const {
  return float16_ops(ops, [](const std::string& name) { return !moves(name); });
}

std::string Code::autocast_float16() const { return float16_ops(ops, autocast_half_op); }

std::string Code::describe() const {
  std::set<std::string> dtypes;
  for (const auto& op : ops) dtypes.insert(op.dtype);
  std::string out;
  for (const auto& op : ops) {
    if (!out.empty()) out += ", ";
    out += op.name;
    if (dtypes.size() > 1) out += " (" + op.dtype + ")";
  }
  if (dtypes.size() == 1 && *dtypes.begin() != "?") out += " (all " + *dtypes.begin() + ")";
  return out;
}

std::vector<Op> parse(const std::string& detail) {
  std::vector<Op> ops;
  std::size_t start = 0;
  while (start <= detail.size()) {
    std::size_t end = detail.find(", ", start);
    if (end == std::string::npos) end = detail.size();
    const std::string item = detail.substr(start, end - start);
    if (!item.empty()) {
      const std::size_t colon = item.rfind(':');
      ops.push_back(colon == std::string::npos || colon == 0 ? Op{item, "?"}
                                                             : Op{item.substr(0, colon), item.substr(colon + 1)});
      if (ops.back().dtype.empty()) ops.back().dtype = "?";
      Op& op = ops.back();
      if ((op.name.rfind("Div(", 0) == 0 || op.name.rfind("Mul(", 0) == 0) && op.name.back() == ')') {
        op.constant = std::strtod(op.name.c_str() + 4, nullptr);
        op.name.resize(3);
      }
    }
    start = end + 2;
  }
  return ops;
}

Code at_steps(const Run& run, const std::vector<std::int64_t>& steps, const std::string& kind) {
  Code code;
  for (const auto& e : run.events) {
    if (e.kind != kind || !std::binary_search(steps.begin(), steps.end(), e.step)) continue;
    if (code.step >= 0 && e.step >= code.step) continue;
    code.step = e.step;
    code.ops = parse(e.detail);
  }
  return code;
}

namespace {

Code of_event(const Run& run, const std::string& kind) {
  Code code;
  if (const rundb::EventRow* e = run.first_event(kind)) {
    code.step = e->step;
    code.ops = parse(e->detail);
  }
  return code;
}

}  // namespace

Code origin(const Run& run) { return of_event(run, "loss-code-origin"); }

Code first(const Run& run) { return of_event(run, "loss-code-first"); }

double hand_scale(const Run& run) {
  if (run.has_scaler()) return 0.0;
  const Code code = first(run);
  if (code.empty()) return 0.0;
  const Op& last = code.ops.back();
  return (last.name == "Mul" || last.name == "Div") && last.gain() >= 2.0 ? last.gain() : 0.0;
}

Code after_module(const Run& run, const std::string& module, const std::string& kind) {
  Code code;
  if (module.empty()) return code;
  const auto [e, ops] = run.module_event(kind, module);
  if (!e) return code;
  code.step = e->step;
  code.ops = parse(ops);
  return code;
}

std::string parameters_after(const Run& run, const std::string& module) {
  return module.empty() ? std::string() : run.module_event("output-parameters", module).second;
}

Place place_after(const Run& run, const std::string& module) {
  if (module.empty()) return Place::kUnknown;
  const std::string place = run.module_event("output-code-place", module).second;
  if (place == "model") return Place::kModel;
  if (place == "loss") return Place::kLoss;
  if (place == "model, then loss") return Place::kModelThenLoss;
  return Place::kUnknown;
}

NonfiniteInput nonfinite_input_at(const Run& run, const std::vector<std::int64_t>& steps) {
  NonfiniteInput in;
  for (const auto& e : run.events) {
    if (!std::binary_search(steps.begin(), steps.end(), e.step)) continue;
    if (e.kind == "loss-code") ++in.looked;
    if (e.kind != "loss-input-nonfinite") continue;
    ++in.seen;
    if (in.step >= 0 && e.step >= in.step) continue;
    const std::size_t space = e.detail.find(' '), colon = e.detail.find(": ");
    in.step = e.step;
    in.op = e.detail.substr(0, std::min(space, colon));
    in.argument = space < colon && colon != std::string::npos ? e.detail.substr(space + 1, colon - space - 1) : "input";
    in.counts = colon == std::string::npos ? "" : e.detail.substr(colon + 2);
    in.dtype.clear();
    if (const std::size_t comma = in.counts.rfind(", "); comma != std::string::npos && in.counts.find(" values") < comma) {
      in.dtype = in.counts.substr(comma + 2);
      in.counts.erase(comma);
    }
    in.made_in.clear();
    for (const char* half : {"float16", "bfloat16"})
      if (in.dtype == std::string("float32 (") + half + " values)") {
        in.made_in = half;
        in.dtype = "float32";
      }
  }
  return in;
}

namespace {

// `s` for an operation that ran in `dtype`: the argument cast to float32 first where `k`'s
// constant would round away in it.
Suggestion in_precision(const Known& k, const Suggestion& s, const std::string& dtype) {
  const Known::InFloat32& f = k.in_float32;
  const std::size_t at = f.python_from.empty() ? std::string::npos : s.python.find(f.python_from);
  if (at == std::string::npos || !(dtype == "float16" || (f.bfloat16 && dtype == "bfloat16"))) return s;
  Suggestion out = s;
  out.summary += f.why;
  out.python.replace(at, f.python_from.size(), f.python_to);
  if (const std::size_t c = out.cpp.find(f.cpp_from); c != std::string::npos)
    out.cpp.replace(c, f.cpp_from.size(), f.cpp_to);
  return out;
}

// Whether a forward log()'s argument is the output of the operation before it that only
// makes positive values and overflows to +Inf (log(exp(x)), log(cosh(x))): the Inf is that
// operation's, and log()'s own 0 or negative argument is not possible.
bool log_of_overflow(const Op& op, const Op* before) {
  static const std::set<std::string> positive = {"Exp", "Cosh"};
  return before && op.name.rfind("Log", 0) == 0 && positive.count(before->name) > 0;
}

}  // namespace

std::vector<Fix> fixes(const Code& code, Phase phase) {
  std::vector<Fix> out;
  std::set<const Known*> given;
  for (std::size_t i = 0; i < code.ops.size(); ++i)
    for (const auto& k : known()) {
      const Op& op = code.ops[i];
      if (!matches(op, k) || given.count(&k)) continue;
      if (phase == Phase::kForward && log_of_overflow(op, i ? &code.ops[i - 1] : nullptr)) continue;
      const Suggestion& s = phase == Phase::kForward ? k.forward : k.backward;
      if (s.summary.empty()) continue;
      given.insert(&k);
      out.push_back({op.name, op.dtype, in_precision(k, s, op.dtype), k.range});
    }
  return out;
}

std::string look_also(const std::vector<Fix>& found, const std::string& look) {
  if (found.empty() || look.empty()) return look;
  std::string others;
  for (std::size_t i = 1; i < found.size(); ++i) others += (others.empty() ? "" : ", ") + found[i].op;
  std::string lowered = look;
  lowered[0] = char(std::tolower(static_cast<unsigned char>(lowered[0])));
  return "Else, " + (others.empty() ? std::string() : "as " + others + " can make NaN/Inf too, ") + lowered;
}

std::vector<Suggestion> forward_suggestions(const Code& code, const std::string& look, double output_absmax) {
  const std::vector<Fix> found = fixes(code, Phase::kForward);
  std::vector<Suggestion> out;
  const std::string rest = look_also(found, look);
  if (code.all_full_precision()) {
    // The loss already runs in FP32: computing it so cannot change what it makes.
    if (!found.empty()) out.push_back(found.front().suggestion);
    out.push_back({rest + " The loss code ran in float32 here, so computing it in FP32 will not help.", "", "", ""});
  } else if (const Op* enlarging = found.empty() ? float16_enlarging(code, output_absmax) : nullptr) {
    // A temperature's division in float16 overflows where float32 would not: no operation
    // that makes NaN/Inf in any precision, and the FP32 loss is the fix.
    out.push_back(suggest::fp32_loss(code.float16_compute() + " ran in float16, whose range ends at 65504, and " +
                                     enlarging_text(*enlarging, 65504.0) + "."));
    out.push_back({rest, "", "", ""});
  } else if (found.empty() && !code.autocast_float16().empty()) {
    // No operation that makes NaN/Inf from finite values, and none that multiplies by a
    // large constant: what autocast keeps in fp16 sums products (a Gram matrix over a
    // feature map, a perceptual loss's frozen network).
    out.push_back(suggest::fp32_loss(code.autocast_float16() +
                                     " ran in float16 whatever their inputs' dtype, and each value they make sums "
                                     "many products: such a sum passes 65504 where float32 holds it."));
    out.push_back({rest, "", "", ""});
  } else if (found.empty()) {
    out.push_back(suggest::fp32_loss(rest));
  } else if (found.front().dtype == "float16") {
    out.push_back(suggest::fp32_loss(code.float16_compute() +
                                     " ran in float16, whose range ends at 65504 and whose smallest value is 6e-8:"));
    out.push_back(found.front().suggestion);
    out.push_back({rest, "", "", ""});
  } else {
    out.push_back(found.front().suggestion);
    out.push_back({rest, "", "", ""});
    out.push_back(suggest::fp32_loss("Where the loss code runs in half precision:"));
  }
  return out;
}

}  // namespace ampdiag::analyzer::loss_code
