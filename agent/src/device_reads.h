// Values computed on a device, read on the host without the training thread waiting, as
// the Python agent's _device_reads.py: each is copied to pinned memory on its device's
// current stream and handed on once an event says the copy has landed (looked at later,
// waited for at close()). Host values are handed on at once. The weights' norms and the
// half-precision parameters' stalled updates read their device values this way.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>

#include <cstdint>
#include <functional>
#include <vector>

namespace ampdiag::agent {

class DeviceReads {
 public:
  // `landed(step, layers, host)`: the values sent with `step` and `layers`, on the host.
  using Landed = std::function<void(std::int64_t step, const std::vector<std::int64_t>& layers, const at::Tensor& host)>;
  explicit DeviceReads(Landed landed) : landed_(std::move(landed)) {}

  void send(std::int64_t step, std::vector<std::int64_t> layers, const at::Tensor& values);
  // Hands on what has landed; with `wait`, everything, waiting for its copies.
  void poll(bool wait);

 private:
  struct Landing {
    std::int64_t step;
    std::vector<std::int64_t> layers;
    at::Tensor host;
    c10::Event event;
  };
  Landed landed_;
  std::vector<Landing> landing_;  // in the order sent
};

}  // namespace ampdiag::agent
