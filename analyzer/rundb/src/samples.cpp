// make_sample_record; see samples.h.
#include "ampdiag/rundb/samples.h"

#include <algorithm>
#include <cmath>

namespace ampdiag::rundb {

namespace {

std::uint16_t quantise16(double frac) { return std::uint16_t(std::lround(std::clamp(frac, 0.0, 1.0) * 65535.0)); }
std::uint8_t quantise8(double frac) { return std::uint8_t(std::lround(std::clamp(frac, 0.0, 1.0) * 255.0)); }

}  // namespace

SampleRecord make_sample_record(const GradStatRow& row) {
  const StatValues& st = row.stats;
  const double numel = double(std::max<std::int64_t>(1, st.numel));
  SampleRecord r;
  r.layer_id = std::uint32_t(row.layer_id);
  r.absmax = float(st.absmax);
  r.l2 = float(st.l2);
  r.zero_q = quantise16(double(st.zeros) / numel);
  r.sub_q = quantise8(double(st.fp16_subnormal) / numel);
  r.nonfinite = (st.nan | st.inf) != 0 ? 1 : 0;
  r.amin_nz = st.amin_nz;
  return r;
}

}  // namespace ampdiag::rundb
