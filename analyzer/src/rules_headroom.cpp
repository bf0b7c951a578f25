// low-headroom and underflow: the two ends of the fp16 range, per layer.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <set>

#include "ampdiag/rundb/module_paths.h"
#include "gradient_cancellation.h"
#include "loss_code.h"
#include "overflow_events.h"
#include "rules.h"
#include "suggestions.h"
#include "true_gradients.h"

namespace ampdiag::analyzer::rules {

bool embedding_like(const rundb::LayerRow& layer) { return layer.module_type.find("Embedding") != std::string::npos; }

namespace {

// Layer ids that share their tensor with another parameter.
std::set<std::int64_t> shared_layers(const Run& run) {
  std::set<std::int64_t> ids;
  for (const auto& [name, layer] : shared_names(run)) ids.insert(layer);
  return ids;
}

// Micro-batches (losses) summed into each step's gradients.
std::map<std::int64_t, std::int64_t> summed_losses(const Run& run) {
  std::map<std::int64_t, std::int64_t> sums;
  for (const auto& s : run.steps) sums[s.row.step] = std::max<std::int64_t>(1, s.row.losses);
  return sums;
}

// Whether `layer`'s gradient is an fp16 tensor's, which fp16's top bounds, and so bounds
// the loss scale: not where the run computed it in FP32 (`fp32`).
bool bounds_the_scale(const Run& run, const LayerSummary& layer, const std::set<std::int64_t>& shared,
                      const std::map<std::int64_t, std::int64_t>& sums, const Fp32Gradients& fp32) {
  if (fp32.holds(layer.info)) return false;
  // Autocast runs an embedding in FP32: a float32 table's gradient is an FP32 sum over the
  // tokens (GPT-2's wte and wpe, finite at 16 times 65504), never one fp16 tensor. Tied to
  // a head (lm_head), the head's part is fp16 and bounded: only a finite sum beyond the top
  // shows that the embedding's part dominates.
  const bool fp32_embedding = float32_embedding(layer.info);
  const bool tied = shared.count(layer.info.id) > 0;
  if (fp32_embedding && !tied) return false;
  float largest = 0.0f;
  for (const auto& g : layer.samples) {
    if (g.nonfinite) continue;
    largest = std::max(largest, g.absmax);
    // Untied, a finite value beyond the top times the micro-batches summed into it was no
    // fp16 tensor's: a LayerNorm's weight, whose gradient autocast's FP32 layer_norm sums
    // over every token (1.8 times 65504 in a small LM).
    const auto n = sums.find(g.step);
    if (!tied && double(g.absmax) > run.fp_max * double(n == sums.end() ? 1 : n->second)) return false;
  }
  // A finite gradient far above the largest fp value never was one fp16 tensor: it is made
  // in FP32 (CLIP's logit_scale, whose product with the features promotes to float32), and
  // fp16's top bounds neither it nor the scale. Micro-batches or tied uses each within
  // range sum to at most that many times it: 1024 of them leave room.
  return double(largest) <= (fp32_embedding ? run.fp_max : run.fp_max * 1024.0);
}

}  // namespace

void low_headroom(const Run& run, const Thresholds& t, std::vector<Finding>& out) {
  // A dynamic scaler grows until the largest gradient nears the top, so some layer always
  // runs close to it once the scale has room. It matters when that layer holds the scale
  // below where the run started, and then only if another layer underflows at that scale:
  // otherwise the scale it allows loses nothing, and pinning it would gain nothing.
  // (Not an underflow finding that no scale changes: information, no fix.)
  const auto underflowing = std::find_if(out.begin(), out.end(), [](const Finding& f) {
    return f.rule == "underflow" && f.severity != Severity::kInfo;
  });
  const std::string underflow_layer = underflowing == out.end() ? "" : underflowing->layer;
  const bool collapsed = run.has_scaler() && scale_collapsed(run, t);
  const std::map<std::int64_t, double> scale_at = scales_before(run);
  const auto sums = summed_losses(run);
  const double init = run.steps.front().row.scale_before;
  // log2 of every sample of a 50 M-row run costs more than reading it: only abs-maxes
  // near the threshold need it to decide exactly, and the least headroom is the largest's.
  const double threshold = run.fp_max / std::exp2(t.headroom_bits);
  const auto low_headroom = [&](float absmax) {
    if (absmax > threshold * (1 + 1e-9)) return true;
    if (absmax < threshold * (1 - 1e-9)) return false;
    return headroom_bits(absmax, run.fp_max) < t.headroom_bits;
  };
  const std::set<std::int64_t> shared = shared_layers(run);
  const Fp32Gradients fp32 = fp32_gradients(run);
  for (const auto& layer : run.layers) {
    if (!bounds_the_scale(run, layer, shared, sums, fp32)) continue;
    std::int64_t finite = 0, low = 0, low_scale = 0, first = -1;
    float largest = 0.0f;
    for (const auto& s : layer.samples) {
      if (s.nonfinite || !(s.absmax > 0.0f)) continue;
      ++finite;
      largest = std::max(largest, s.absmax);
      if (low_headroom(s.absmax)) {
        ++low;
        const auto it = scale_at.find(s.step);
        if (it != scale_at.end() && it->second < init) ++low_scale;
        if (first < 0) first = s.step;
      }
    }
    if (finite == 0 || double(low) / double(finite) < t.headroom_fraction || 2 * low_scale < low) continue;
    const double least = headroom_bits(largest, run.fp_max);
    Finding f;
    f.rule = "low-headroom";
    f.severity = Severity::kWarning;
    f.layer = layer.info.name;
    f.module = suggest::module_for_layer(run, layer.info);
    f.score = 40.0 + 10.0 * double(low) / double(finite);
    char least_text[32];
    std::snprintf(least_text, sizeof least_text, "%.2f", least);
    f.title = layer.info.name + " runs within " + std::to_string(int(t.headroom_bits)) + " bit(s) of the largest fp value";
    f.evidence = "scaled abs-max within " + std::to_string(int(t.headroom_bits)) + " bit(s) of " +
                 std::to_string(std::lround(run.fp_max)) + " in " + std::to_string(low) + " of " + std::to_string(finite) +
                 " sampled steps (least headroom " + least_text + " bits" +
                 // Negative: finite above the top, which no single fp16 tensor can be.
                 (least < 0.0 ? ": above " + std::to_string(std::lround(run.fp_max)) +
                                    ", as only a sum of gradients each within it can be (the step's micro-batches, or a "
                                    "tied parameter's uses)"
                              : std::string()) +
                 "), mostly while the loss scale was below its initial " + std::to_string(std::lround(init));
    f.steps.push_back(first);
    if (underflow_layer.empty()) {
      f.severity = Severity::kInfo;
      f.score = 10.0;
      // Below the floor, scale-collapse holds the scale itself to be the harm (DESIGN.md):
      // "costs nothing" would contradict it in the same report.
      f.evidence += collapsed ? "; no layer underflows at that scale yet, though it is below the floor of " +
                                    fmt(t.scale_floor) + " (see scale-collapse)"
                              : std::string("; no layer underflows at that scale, so the limit costs nothing");
    } else {
      f.evidence += "; at that scale " + underflow_layer + " underflows (see underflow)";
      f.suggestions.push_back(suggest::fp32_at(run, f.module, layer.info));
    }
    out.push_back(f);
  }
}

namespace {

// The largest loss scale at which none of a layer's recorded finite gradients would have
// passed fp16's top, and that layer; infinite where there is none. Gradients far larger in
// the run's first half than in its second are a start that has passed (MobileViT's first
// attention output: 6.7 unscaled at step 4, 4e-5 from step 15 on, leaving the scale at 4096
// for torch's 2000 steps a doubling): the room is then the second half's, `early` the first's.
struct ScaleRoom {
  double scale = INFINITY;
  const LayerSummary* layer = nullptr;
  double early = INFINITY;    // the room the first half left, where it bounds no more
  std::int64_t settled = -1;  // the first step of the second half, where `early` is set
};

// A start at least this many times tighter than what followed has passed.
constexpr double kTransientRoom = 16.0;

// Each layer's whose gradient fp16 bounds (bounds_the_scale).
std::vector<ScaleRoom> scale_rooms(const Run& run, const std::map<std::int64_t, double>& scale_at,
                                   const Fp32Gradients& fp32) {
  const std::set<std::int64_t> shared = shared_layers(run);
  const auto sums = summed_losses(run);
  std::vector<ScaleRoom> rooms;
  for (const auto& layer : run.layers) {
    if (!bounds_the_scale(run, layer, shared, sums, fp32)) continue;
    std::vector<std::pair<std::int64_t, double>> per_step;  // samples are in step order
    for (const auto& g : layer.samples) {
      const auto at = scale_at.find(g.step);
      if (g.nonfinite || !(g.absmax > 0.0f) || at == scale_at.end() || !(at->second > 0.0)) continue;
      per_step.emplace_back(g.step, at->second * run.fp_max / double(g.absmax));
    }
    const std::size_t half = per_step.size() / 2;
    const auto least = [&](std::size_t from, std::size_t to) {
      double room = INFINITY;
      for (std::size_t i = from; i < to; ++i) room = std::min(room, per_step[i].second);
      return room;
    };
    const double early = least(0, half), late = least(half, per_step.size());
    ScaleRoom room{std::min(early, late), &layer};
    if (per_step.size() >= 8 && late >= kTransientRoom * early) {
      room.scale = late;
      room.early = early;
      room.settled = per_step[half].first;
    }
    rooms.push_back(room);
  }
  return rooms;
}

// Whose gradients `room` is read from: "X's recorded gradients", or those since a start that
// has passed.
std::string room_gradients(const ScaleRoom& room) {
  return room.layer->info.name +
         (room.settled < 0 ? "'s recorded gradients" : "'s gradients from step " + std::to_string(room.settled) + " on");
}

// The least of `rooms` but `except`'s: how far the other layers let the scale grow.
ScaleRoom room_beside(const std::vector<ScaleRoom>& rooms, const LayerSummary& except) {
  ScaleRoom least;
  for (const auto& room : rooms)
    if (room.layer != &except && room.scale < least.scale) least = room;
  return least;
}

// Of `rooms` but `except`'s, the one whose start was tightest: where a start that has passed
// holds the scale down, what to wait out rather than raise the scale over.
ScaleRoom start_beside(const std::vector<ScaleRoom>& rooms, const LayerSummary& except) {
  ScaleRoom tightest;
  for (const auto& room : rooms)
    if (room.layer != &except && room.early < tightest.early) tightest = room;
  return tightest;
}

// A power of two as Python writes it: "2**19".
std::string power_of_two(double scale) { return "2**" + std::to_string(int(std::floor(std::log2(scale)))); }

// What an underflow the scale lifts says of its gradient.
constexpr char kAtCurrentScale[] = "zero or below fp16's normal range at the current scale";

// Underflow findings alike, `found`: one per layer up to two; from three on (a deep plain
// network whose first layers' gradients vanish, 17 findings alike), one for them all, led by
// the layer most below, its title the leader's name, "and N more layers", and `said`.
void add_alike(const std::string& said, std::vector<Finding> found, std::vector<Finding>& out) {
  if (found.size() < 3) {
    for (auto& f : found) out.push_back(std::move(f));
    return;
  }
  std::stable_sort(found.begin(), found.end(), [](const Finding& a, const Finding& b) { return a.score > b.score; });
  Finding f = found.front();
  std::string others;
  constexpr std::size_t kNamed = 8;
  for (std::size_t i = 1; i < found.size() && i <= kNamed; ++i) others += (i > 1 ? ", " : "") + found[i].layer;
  if (found.size() > kNamed + 1) others += " and " + plural(std::int64_t(found.size() - kNamed - 1), "more layer");
  for (const auto& other : found) f.steps.front() = std::min(f.steps.front(), other.steps.front());
  f.title = f.layer + " and " + plural(std::int64_t(found.size() - 1), "more layer") + ": " + said;
  f.evidence += "; the same holds for " + others;
  out.push_back(std::move(f));
}

}  // namespace

void underflow(const Run& run, const Thresholds& t, std::vector<Finding>& out) {
  // bf16 has fp32's exponent range: its zeros are not the loss scale's to fix.
  if (!run.fp16()) return;
  const std::map<std::int64_t, double> scale_at = scales_before(run);
  std::vector<ScaleRoom> rooms;  // read once a layer underflows at all
  bool rooms_read = false;
  std::map<std::string, std::vector<Finding>> unliftable;  // by the layer that would overflow
  // Information alike: a style-transfer network's eight convolution biases before their
  // InstanceNorms say one thing, once.
  std::vector<Finding> structural_zeros, cancelled;
  const Fp32Gradients fp32 = fp32_gradients(run);
  for (const auto& layer : run.layers) {
    if (layer.info.numel < 16) continue;  // a handful of values says nothing about a distribution
    // A gradient computed in FP32 (a pinned module's, A_log's): no fp16 flushes it.
    if (fp32.holds(layer.info)) continue;
    const bool embedding = embedding_like(layer.info);
    std::int64_t finite = 0;
    double sum = 0.0, zeros = 0.0, subnormal = 0.0;
    std::int64_t first = -1;
    std::vector<std::pair<double, double>> shares;  // (zeros, subnormals) of each finite sample
    for (const auto& s : layer.samples) {
      // An all-zero gradient is a layer this step did not use (zero_grad(set_to_none=False),
      // a branch not taken), not values that fell below fp16's range.
      if (s.nonfinite || s.zero_q == 65535) continue;
      ++finite;
      const double z = embedding ? 0.0 : double(s.zero_q) / 65535.0, sub = double(s.sub_q) / 255.0;
      zeros += z;
      subnormal += sub;
      sum += z + sub;
      shares.emplace_back(z, sub);
      if (first < 0 && z + sub > t.underflow_fraction) first = s.step;
    }
    if (finite == 0) continue;
    // The later half of them: a gradient that starts at zero (a branch behind a norm whose weight
    // starts at 0, timm's zero_init_last) passes through the subnormals while it grows, and
    // what stays after is its own (TResNet's squeeze-excitation fc1: 47% subnormal at step 1,
    // 3% from step 10, half its values zero throughout behind dead units).
    double late_zero = 0.0, late_sub = 0.0;
    const std::size_t half = shares.size() / 2;
    for (std::size_t i = half; i < shares.size(); ++i) late_zero += shares[i].first, late_sub += shares[i].second;
    const double late_count = double(shares.size() - half);
    late_zero /= late_count;
    late_sub /= late_count;
    const double mean = sum / double(finite), mean_zero = zeros / double(finite), mean_sub = subnormal / double(finite);
    // Underflow leaves a trace at the bottom of the range: values flushing to zero pass
    // through fp16's subnormals. Zeros without any are structural (dead units, masks).
    if (mean <= t.underflow_fraction || mean_sub < 0.01) continue;
    Finding f;
    f.rule = "underflow";
    f.severity = Severity::kWarning;
    f.layer = layer.info.name;
    f.module = suggest::module_for_layer(run, layer.info);
    // A low scale flushes a continuum: values pass through fp16's ten subnormal binades on
    // their way to zero, and a gradient with a share in the normal range as well spans them
    // all. Exact zeros many times the subnormals beside such a share are a population of
    // their own, which no scale makes or lifts: a softmax saturated to exactly 0 and 1
    // (DeBERTa's attention with query and key weights 300 times too large: 75% zeros, 9%
    // subnormal, 16% normal, the same at twice the scale), dead units, masked positions.
    const double mean_normal = 1.0 - mean_zero - mean_sub;
    // Behind a small layer scale the zeros are the scaled-down branch's, which fp16 flushes:
    // CaiT's query biases, two thirds zero beside the value bias's normal third.
    const std::string scales = small_layer_scales(run, layer);
    // A continuum that left this many zeros below the band would leave few values above it:
    // more normal values than subnormal ones beside them make the zeros a population too (a
    // 3x3 depthwise kernel over a 1x1 map, eight of its nine taps on padding: 89% zero, 5%
    // subnormal, 6% normal).
    const auto structural = [](double zero, double sub) {
      const double normal = 1.0 - zero - sub;
      return zero >= 5.0 * sub && (normal >= 0.1 || normal >= std::max(sub, 0.02));
    };
    const bool late_structural = shares.size() >= 8 && structural(late_zero, late_sub);
    const bool whole = structural(mean_zero, mean_sub);
    if (!embedding && (whole || late_structural) && scales.empty()) {
      f.severity = Severity::kInfo;
      f.score = 5.0;
      f.title = layer.info.name + "'s gradient is mostly exact zeros that the loss scale does not make";
      f.evidence = (whole ? "on average " + pct(mean_zero) + " of its values were exactly zero, " + pct(mean_sub) +
                                " fp16-subnormal and " + pct(mean_normal) + " in fp16's normal range over " +
                                plural(finite, "sampled step")
                          : "over its later " + plural(std::int64_t(late_count), "sampled step") + " " +
                                pct(late_zero) + " of its values were exactly zero, " + pct(late_sub) +
                                " fp16-subnormal and " + pct(1.0 - late_zero - late_sub) + " in fp16's normal range "
                                "(" + pct(mean_sub) + " subnormal over all " + std::to_string(finite) +
                                ": the subnormals were in its earlier steps)") +
                   ": values a low scale flushes pass through the subnormal band "
                   "first, so zeros this many beside normal values are mostly zero in any precision (a softmax "
                   "saturated to 0 and 1, dead units, masked positions, a kernel's taps on padding); no scale lifts them";
      f.steps.push_back(first);
      structural_zeros.push_back(std::move(f));
      continue;
    }
    const Cancellation c = cancellation_of(run, layer, t.underflow_fraction);
    if (c.cancels()) {
      f.severity = Severity::kInfo;
      f.score = 5.0;
      f.title = layer.info.name + "'s gradient cancels to rounding, far below " + c.sibling->info.name +
                "'s: not flushed by the scale";
      f.evidence = "on average " + pct(mean) + " of its values were zero or fp16-subnormal over " +
                   plural(finite, "sampled step") + ", while per element its gradient was " + fmt(c.ratio) + " of " +
                   c.sibling->info.name + "'s at the same steps";
      if (c.twin == nullptr && c.ratio >= 1.0 / 512.0)
        f.evidence += " (whose module's input is " + std::string(c.input < 1.0 ? "small, " : "") + "about " +
                      fmt(c.input) + " per element, estimated from its outputs and weights: a true gradient would be "
                      "about " + fmt(1.0 / c.input) + " times the weight's)";
      if (c.norm_after != nullptr)
        f.evidence += ", and " + layer.info.module_path + "'s output goes straight into " + c.norm_after->info.path +
                      " (" + c.norm_after->info.module_type + "), which takes away each channel's mean: a bias there "
                      "adds the same value to all it averages, so its gradient is a sum that is zero in exact "
                      "arithmetic, left with rounding; no scale helps";
      else
        f.evidence += std::string(c.sibling_underflows ? ", whose own gradient underflows too, yet far above this one's"
                                                       : ", which the same scale keeps in range") +
                      ": a sum that is zero in exact arithmetic (an attention key's bias, which shifts every score of "
                      "a query alike under softmax; a bias just before a normalisation), left with rounding; no scale "
                      "helps";
      if (c.twin != nullptr)
        f.evidence += "; " + c.twin->info.name + ", the same parameter in another block of the same structure, sits "
                      "at " + fmt(c.twin_ratio) + " of its weight's: the same sum, with more rounding left in this block";
      f.steps.push_back(first);
      cancelled.push_back(std::move(f));
      continue;
    }
    f.score = 30.0 + 10.0 * mean;
    f.title = layer.info.name + ": most of its gradient is " + kAtCurrentScale;
    f.evidence = "on average " + pct(mean) + " of its values were zero (" + pct(mean_zero) + ") or fp16-subnormal (" +
                 pct(mean_sub) + ") over " + plural(finite, "sampled step");
    if (!scales.empty())
      f.evidence += "; its block scales its branch by " + scales +
                    (scales.size() > 12 && scales.compare(scales.size() - 12, 12, "started at 0") == 0
                         ? ": the branch's gradients start at zero and stay far smaller until it grows"
                         : ": the branch's gradients are about that much smaller until they grow");
    f.steps.push_back(first);
    if (!run.has_scaler()) {
      // A loss scaled by hand: the agent read the gradients at the optimizer's step, after
      // code that may have divided them again (static.py's apex-style loop: the same 52% at a
      // scale of 1, 1024 or 65536), so the shares say nothing of what flushed at that scale.
      if (const double by_hand = loss_code::hand_scale(run); by_hand > 0.0) {
        f.severity = Severity::kInfo;
        f.score = 5.0;
        f.title = layer.info.name + ": most of its gradient is below fp16's normal range where the agent read it, "
                  "after the loss scale set by hand";
        f.evidence += "; the loss code multiplies the loss by " + fmt(by_hand) + " before backward() (a loss scale "
                      "set by hand), and without a GradScaler the agent reads the gradients at the optimizer's step, "
                      "after any code that divides them again: what it read says nothing of what flushed at " +
                      fmt(by_hand);
      }
      f.suggestions.push_back(suggest::add_scaler(run));
    } else {
      // How far the scale can grow is what the other gradients leave below fp16's top. Where
      // that cannot lift most of this one into the normal range, no scaler setting helps: by
      // Chebyshev's inequality at most (RMS * scale / 2^-14)^2 of its values reach 2^-14.
      std::vector<double> rms;  // per element, unscaled
      double lowest_scale = INFINITY;  // of its finite samples
      for (const auto& s : layer.samples) {
        const auto at = scale_at.find(s.step);
        if (s.nonfinite || at == scale_at.end() || !(at->second > 0.0)) continue;
        lowest_scale = std::min(lowest_scale, at->second);
        if (s.zero_q == 65535) continue;
        rms.push_back(double(s.l2) / std::sqrt(double(layer.info.numel)) / at->second);
      }
      const double typical = rms.empty() ? 0.0 : median_of(rms);
      const double scale = run.steps.back().row.scale_after;
      if (!rooms_read) {
        rooms = scale_rooms(run, scale_at, fp32);
        rooms_read = true;
      }
      const ScaleRoom room = room_beside(rooms, layer);
      const double smallest_normal = std::ldexp(1.0, -14);
      const double reach = typical * room.scale / smallest_normal;
      const bool no_room = room.layer && room.scale < 2.0 * scale;
      // A value fp16 flushed to zero was below 2^-25 at the scale it ran at: lifted by at most
      // 2^10, it stays below 2^-14, so where such zeros alone pass the threshold no allowed
      // scale clears it (CaiT's attention weights behind a LayerScale of 1e-5: two thirds
      // exactly zero at 32768, while the head's gradients leave room for 65536 only).
      const bool zeros_stay = room.layer && !no_room && mean_zero > t.underflow_fraction &&
                              room.scale <= std::ldexp(lowest_scale, 10);
      // Steps it already ran at the largest scale the room allows, and still underflowed: a
      // run that started there has tried the fix (CaiT's attention projections, 82 % zero or
      // subnormal, at 65536 for their first 13 steps).
      const double room_scale = room.layer ? std::exp2(std::floor(std::log2(room.scale))) : INFINITY;
      double tried_share = 0.0;
      std::int64_t tried = 0;
      for (const auto& s : layer.samples) {
        const auto at = scale_at.find(s.step);
        if (s.nonfinite || s.zero_q == 65535 || at == scale_at.end() || at->second < room_scale) continue;
        tried_share += double(s.zero_q) / 65535.0 + double(s.sub_q) / 255.0;
        ++tried;
      }
      const bool tried_there = room.layer && !no_room && !zeros_stay && tried >= 3 &&
                               tried_share / double(tried) > t.underflow_fraction;
      if (room.layer && (no_room || zeros_stay || tried_there || reach * reach <= 1.0 - t.underflow_fraction)) {
        const std::string top = std::to_string(std::lround(run.fp_max));
        f.title = layer.info.name + ": most of its gradient is below fp16's normal range, and no loss scale lifts it "
                  "without " + room.layer->info.name + " overflowing";
        f.evidence += no_room ? "; the scale cannot double: " + room.layer->info.name + "'s gradients already came within a factor of " +
                                    three_digits(room.scale / scale) + " of " + top + " at the scale they ran at"
                      : zeros_stay ? "; " + pct(mean_zero) + " of its values were exactly zero, below 2^-25 at the "
                                     "scales they ran at (from " + fmt(lowest_scale) + "), and at " +
                                     power_of_two(room.scale) + ", the largest scale at which " +
                                     room_gradients(room) + " stay within " + top +
                                     ", they stay below fp16's normal range"
                      : tried_there ? "; it ran " + plural(tried, "sampled step") + " at " + power_of_two(room_scale) +
                                          " or above, the largest scale at which " + room_gradients(room) +
                                          " stay within " + top + ", with " +
                                          pct(tried_share / double(tried)) + " of its values still zero or "
                                          "fp16-subnormal there"
                              : "; at " + power_of_two(room.scale) + ", the largest scale at which " +
                                    room_gradients(room) + " stay within " + top +
                                    ", its typical RMS (" + fmt(typical) + " unscaled) leaves at most " +
                                    pct(reach * reach) + " of its values in fp16's normal range";
        // The gradients that hold the scale down made large by a normalisation of a flat input
        // after their module: pinned, that module makes and sums them in float32, and the scale
        // grows (DETR's first decoder self-attention: from 256 to 8192).
        const std::string before = suggest::probed_module(run, room.layer->info.module_path);
        if (const FlatNorm flat = flat_normalisation_after(run, before); flat.norm != nullptr) {
          const std::string holder = block_before(run, before, *flat.norm);
          f.suggestions.push_back(suggest::pin_fp32(run, holder));
          f.suggestions.back().summary =
              "Run " + holder + " in FP32: " + flat.norm->info.path + ", which takes its output, normalised an input "
              "with next to no spread (" + flat.made + "), and a normalisation's backward divides by that spread, so "
              "the gradients " + holder + " receives are hundreds of times the rest; pinned, it makes and sums " +
              room.layer->info.name + "'s in float32, and the scale can grow to lift these.";
        }
        Suggestion bf16 = suggest::use_bf16(run);
        bf16.summary = std::string(f.suggestions.empty() ? "Train" : "Or train") + " in bfloat16 (fp32's range, no "
                       "loss scaler needed) if the hardware supports it: no loss scale keeps these gradients and " +
                       room.layer->info.name + "'s in fp16's range at once.";
        f.suggestions.push_back(bf16);
        unliftable[room.layer->info.name].push_back(std::move(f));
        continue;
      } else {
        // analyze() replaces this when an overflow holds the scale down (the findings must agree).
        const double wanted = std::max(scale * 256.0, 65536.0);
        const double limit = room.layer ? std::exp2(std::floor(std::log2(room.scale))) : INFINITY;
        const std::string top = std::to_string(std::lround(run.fp_max));
        const ScaleRoom start = start_beside(rooms, layer);
        if (start.layer && start.early < std::min(wanted, limit)) {
          // The start's large gradients brought the scale down, and torch doubles it only once
          // every growth_interval: a higher init_scale would overflow that start again.
          const std::int64_t interval =
              std::max<std::int64_t>(1, std::atoll(run.meta_or("scaler_growth_interval", "2000").c_str()));
          f.evidence += "; the run's first steps, whose gradients were far larger, left the scale at " + fmt(scale) + ": " +
                        start.layer->info.name + "'s before step " + std::to_string(start.settled) +
                        " would pass " + top + " above " + power_of_two(start.early) + ", those from then on only above " +
                        power_of_two(start.scale) + ", and the scaler doubles the scale once every " +
                        plural(interval, "step") + " without a skip";
          const std::int64_t sooner = interval > 200 ? 200 : std::max<std::int64_t>(1, interval / 2);
          f.suggestions.push_back(suggest::scaler_settings(
              run, scale, sooner,
              "Let the scale grow back sooner: a growth_interval of " + std::to_string(sooner) + " doubles it every " +
              plural(sooner, "step") + " instead of every " + std::to_string(interval) + ", up to " +
              power_of_two(limit) + " (above it, " + room_gradients(room) + " would pass " + top +
              "), which lifts these gradients into fp16's range; a higher init_scale would only overflow the start "
              "again."));
        } else {
          f.suggestions.push_back(suggest::scaler_settings(
              run, std::min(wanted, limit), 500,
              limit < wanted ? "Let the scale grow: a higher init_scale (up to " + power_of_two(limit) + ": above it, " +
                                   room_gradients(room) + " would pass " + top +
                                   ") and a shorter growth_interval keep small gradients in range."
                             : "Let the scale grow: a higher init_scale and a shorter growth_interval keep small "
                               "gradients in range."));
        }
      }
    }
    f.suggestions.push_back(suggest::use_bf16(run));
    out.push_back(f);
  }
  for (auto& [limit, found] : unliftable)
    add_alike("most of their gradients are below fp16's normal range, and no loss scale lifts them without " + limit +
                  " overflowing",
              std::move(found), out);
  add_alike("their gradients are mostly exact zeros that the loss scale does not make", std::move(structural_zeros),
            out);
  add_alike("their gradients cancel to rounding, far below the other gradients of their modules: not flushed by the "
            "scale",
            std::move(cancelled), out);
}

void group_underflows(std::vector<Finding>& found) {
  // MobileViT's 34 convolutions and norms under a scale the run's start left low, one fix.
  std::map<std::string, std::vector<Finding>> alike;  // by their first fix
  std::vector<Finding> rest;
  std::map<std::string, std::size_t> place;  // where each group's first member stood in `rest`
  for (auto& f : found) {
    const bool lifted = f.rule == "underflow" && f.severity != Severity::kInfo && !f.suggestions.empty() &&
                        ends_with(f.title, kAtCurrentScale);
    if (!lifted) {
      rest.push_back(std::move(f));
      continue;
    }
    const std::string key = f.suggestions.front().summary + '\n' + f.suggestions.front().python;
    if (!place.count(key)) place[key] = rest.size();
    alike[key].push_back(std::move(f));
  }
  // Back in place, from the last group's place so that the earlier ones stay put.
  std::vector<std::pair<std::size_t, std::string>> order;
  for (const auto& [key, at] : place) order.emplace_back(at, key);
  std::sort(order.rbegin(), order.rend());
  for (const auto& [at, key] : order) {
    std::vector<Finding> grouped;
    add_alike(std::string("most of their gradients are ") + kAtCurrentScale, std::move(alike[key]), grouped);
    rest.insert(rest.begin() + std::ptrdiff_t(at), std::make_move_iterator(grouped.begin()),
                std::make_move_iterator(grouped.end()));
  }
  found = std::move(rest);
}

}  // namespace ampdiag::analyzer::rules
