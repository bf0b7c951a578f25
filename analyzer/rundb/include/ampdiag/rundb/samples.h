// The writer's per-step summaries of grad_stats (docs/FORMAT.md, "Summaries"): what the
// analyzer keeps of each gradient row, packed so that a reader gets a whole run from a
// few bytes a row instead of scanning every row. One definition for the writer that packs
// them and for both of the analyzer's ways of reading a run, so the two agree bit for bit.
#pragma once

#include <cstdint>
#include <type_traits>

#include "ampdiag/rundb/rows.h"

namespace ampdiag::rundb {

// One layer's gradient at one step; grad_samples stores them back to back, little-endian.
struct SampleRecord {
  std::uint32_t layer_id;
  float absmax;            // before unscale; 0 if nothing finite
  float l2;                // before unscale; 0 if nothing finite
  std::uint16_t zero_q;    // zeros / numel, in 1/65535
  std::uint8_t sub_q;      // fp16 subnormals / numel, in 1/255
  std::uint8_t nonfinite;  // 1 if the gradient held NaN or Inf
  // Smallest non-zero finite |x|, before unscale: one of the gradient's own values, and
  // gradients are at most fp32, so float holds it exactly.
  float amin_nz;
};
static_assert(sizeof(SampleRecord) == 20 && std::is_trivially_copyable_v<SampleRecord>,
              "grad_samples' record layout is part of the file format");
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "grad_samples is written in the host's byte order");

SampleRecord make_sample_record(const GradStatRow& row);

}  // namespace ampdiag::rundb
