// The Aggregator on synthetic activity records shaped as CUPTI delivers them: kernels
// and copies by correlation id, external correlations in the same or a later buffer.
#include <catch2/catch.hpp>

#include <algorithm>

#include "ampdiag/profiler/attribution.h"

using namespace ampdiag::profiler;
using ampdiag::rundb::GpuKind;
using ampdiag::rundb::GpuPhase;
using ampdiag::rundb::GpuTimeRow;

namespace {

KernelActivity kernel(const char* name, std::uint32_t correlation, std::uint64_t ns) {
  return {name, 1000, 1000 + ns, 0, 7, correlation};
}

const GpuTimeRow* row(const std::vector<GpuTimeRow>& rows, std::int64_t module, GpuPhase phase, GpuKind kind) {
  auto it = std::find_if(rows.begin(), rows.end(),
                         [&](const GpuTimeRow& r) { return r.module_id == module && r.phase == phase && r.kind == kind; });
  return it == rows.end() ? nullptr : &*it;
}

}  // namespace

TEST_CASE("kernels are summed per module, phase and precision of the range their launch carried",
          "[profiler][attribution]") {
  RangeTable ranges;
  const auto fwd = ranges.open({3, 5, GpuPhase::kForward, GpuKind::kFloat16});
  const auto bwd = ranges.open({3, 5, GpuPhase::kBackward, GpuKind::kFloat16});
  Aggregator agg(ranges);
  ActivityBatch b;
  b.kernels = {kernel("ampere_fp16_s16816gemm_fp16_128x128", 10, 400), kernel("ampere_sgemm_128x64_tn", 11, 900),
               kernel("ampere_fp16_s16816gemm_fp16_64x64", 12, 300)};
  b.externals = {{10, fwd}, {11, fwd}, {12, bwd}};
  agg.add(std::move(b));
  const auto rows = agg.take_rows();
  REQUIRE(rows.size() == 3);
  const GpuTimeRow* half = row(rows, 5, GpuPhase::kForward, GpuKind::kFloat16);
  REQUIRE(half);
  CHECK((half->step == 3 && half->count == 1 && half->ns == 400));
  REQUIRE(row(rows, 5, GpuPhase::kForward, GpuKind::kFloat32));
  CHECK(row(rows, 5, GpuPhase::kForward, GpuKind::kFloat32)->ns == 900);
  CHECK(row(rows, 5, GpuPhase::kBackward, GpuKind::kFloat16)->ns == 300);
  CHECK(agg.take_rows().empty());  // sums are handed out once
}

TEST_CASE("a kernel waits for an external correlation that arrives in a later buffer", "[profiler][attribution]") {
  RangeTable ranges;
  const auto id = ranges.open({8, 2, GpuPhase::kForward, GpuKind::kFloat16});
  Aggregator agg(ranges);
  ActivityBatch first;
  first.kernels = {kernel("volta_h884gemm_64x64_ldg8_nn", 40, 250)};
  agg.add(std::move(first));
  CHECK(agg.take_rows().empty());
  ActivityBatch second;
  second.externals = {{40, id}};
  agg.add(std::move(second));
  const auto rows = agg.take_rows();
  REQUIRE(rows.size() == 1);
  CHECK((rows[0].step == 8 && rows[0].module_id == 2 && rows[0].ns == 250));
}

TEST_CASE("ampdiag's own kernels count as its own inside any range", "[profiler][attribution]") {
  RangeTable ranges;
  const auto unscale = ranges.open({1, -1, GpuPhase::kUnscale, GpuKind::kOtherKernel});
  Aggregator agg(ranges);
  ActivityBatch b;
  b.kernels = {kernel("void ampdiag::kernels::(anonymous namespace)::stats_kernel<true>(...)", 5, 80)};
  b.copies = {{2000, 2010, 32, 0, 7, 6}};
  b.externals = {{5, unscale}, {6, unscale}};
  agg.add(std::move(b));
  const auto rows = agg.take_rows();
  REQUIRE(rows.size() == 2);
  CHECK(row(rows, -1, GpuPhase::kAmpdiag, GpuKind::kOtherKernel)->ns == 80);
  CHECK(row(rows, -1, GpuPhase::kUnscale, GpuKind::kMemcpy)->ns == 10);
}

TEST_CASE("a launch outside every range goes to the step of the launch before it, without a module",
          "[profiler][attribution]") {
  RangeTable ranges;
  const auto id = ranges.open({4, 1, GpuPhase::kForward, GpuKind::kFloat32});
  Aggregator agg(ranges);
  ActivityBatch b;
  b.kernels = {kernel("ampere_sgemm_128x64_tn", 20, 100), kernel("void at::native::FillFunctor<float>", 21, 30)};
  b.externals = {{20, id}};
  agg.add(std::move(b));
  agg.finish();
  const auto rows = agg.take_rows();
  const GpuTimeRow* orphan = row(rows, -1, GpuPhase::kOther, GpuKind::kFloat32);
  REQUIRE(orphan);
  CHECK((orphan->step == 4 && orphan->ns == 30));
  CHECK(agg.unattributed() == 0);
}

TEST_CASE("a launch with no range and no earlier launch is counted as unattributed", "[profiler][attribution]") {
  RangeTable ranges;
  Aggregator agg(ranges);
  ActivityBatch b;
  b.kernels = {kernel("ampere_sgemm_128x64_tn", 3, 100)};
  agg.add(std::move(b));
  agg.finish();
  CHECK(agg.take_rows().empty());
  CHECK(agg.unattributed() == 1);
}

TEST_CASE("records of several buffers add up in one row", "[profiler][attribution]") {
  RangeTable ranges;
  const auto id = ranges.open({2, 0, GpuPhase::kForward, GpuKind::kFloat16});
  Aggregator agg(ranges);
  for (std::uint32_t c = 1; c <= 3; ++c) {
    ActivityBatch b;
    b.kernels = {kernel("hgemm", c, 100)};
    b.externals = {{c, id}};
    agg.add(std::move(b));
  }
  const auto rows = agg.take_rows();
  REQUIRE(rows.size() == 1);
  CHECK((rows[0].count == 3 && rows[0].ns == 300));
}

TEST_CASE("ranges of steps long past are forgotten", "[profiler][attribution]") {
  RangeTable ranges;
  const auto old = ranges.open({0, 0, GpuPhase::kForward, GpuKind::kFloat16});
  ranges.open({RangeTable::kKeepSteps + 1, 0, GpuPhase::kForward, GpuKind::kFloat16});
  Range r;
  CHECK_FALSE(ranges.find(old, r));
  CHECK(ranges.size() == 1);
}
