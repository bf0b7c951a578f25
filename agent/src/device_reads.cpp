#include "device_reads.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace ampdiag::agent {

void DeviceReads::send(std::int64_t step, std::vector<std::int64_t> layers, const at::Tensor& values) {
  if (values.device().is_cpu()) {
    landed_(step, layers, values.contiguous());
    return;
  }
  at::Tensor host = at::empty(values.sizes(), values.options().device(at::kCPU).pinned_memory(true));
  host.copy_(values, /*non_blocking=*/true);
  const auto device = values.device();
  c10::Event event(device.type());
  event.record(c10::impl::getDeviceGuardImpl(device.type())->getStream(device));
  landing_.push_back({step, std::move(layers), std::move(host), std::move(event)});
}

void DeviceReads::poll(bool wait) {
  std::vector<Landing> landing = std::move(landing_);
  landing_.clear();
  for (std::size_t i = 0; i < landing.size(); ++i) {
    Landing& entry = landing[i];
    try {
      if (wait) {
        entry.event.synchronize();
      } else if (!entry.event.query()) {
        landing_.push_back(std::move(entry));
        continue;
      }
      landed_(entry.step, entry.layers, entry.host);
    } catch (...) {
      // The entry whose hand-on threw is not handed on again; the ones after it wait, in
      // order and intact, for the next poll.
      for (std::size_t j = i + 1; j < landing.size(); ++j) landing_.push_back(std::move(landing[j]));
      throw;
    }
  }
}

}  // namespace ampdiag::agent
