// Adding exponent histograms up (a row's u32 counts, the writer's u64 sums, partial sums).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace ampdiag::analyzer {

// sum += add, bin by bin; an empty `add` leaves `sum` as it is (empty stays empty).
template <typename Count>
void add_counts(std::vector<std::uint64_t>& sum, const std::vector<Count>& add) {
  if (add.empty()) return;
  sum.resize(std::max(sum.size(), add.size()), 0);
  for (std::size_t b = 0; b < add.size(); ++b) sum[b] += add[b];
}

}  // namespace ampdiag::analyzer
