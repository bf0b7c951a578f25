// make_sample_record; see samples.h.
#include "ampdiag/rundb/samples.h"

#include <algorithm>
#include <cmath>

namespace ampdiag::rundb {

namespace {

// Round to nearest (the writer packs every gradient row: no lround call per field).
std::uint16_t quantise16(double frac) { return std::uint16_t(std::clamp(frac, 0.0, 1.0) * 65535.0 + 0.5); }
std::uint8_t quantise8(double frac) { return std::uint8_t(std::clamp(frac, 0.0, 1.0) * 255.0 + 0.5); }

}  // namespace

SampleRecord make_sample_record(const GradStatRow& row) {
  const StatValues& st = row.stats;
  const double per_value = 1.0 / double(std::max<std::int64_t>(1, st.numel));
  SampleRecord r;
  r.layer_id = std::uint32_t(row.layer_id);
  r.absmax = float(st.absmax);
  r.l2 = float(st.l2);
  r.zero_q = quantise16(double(st.zeros) * per_value);
  r.sub_q = quantise8(double(st.fp16_subnormal) * per_value);
  r.nonfinite = (st.nan | st.inf) != 0 ? 1 : 0;
  r.amin_nz = float(st.amin_nz);
  return r;
}

}  // namespace ampdiag::rundb
