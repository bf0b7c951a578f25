// autocast_state.h: at::autocast's functions, unchanged.
#include "autocast_state.h"

#include <ATen/autocast_mode.h>

namespace ampdiag::agent {

bool autocast_enabled(c10::DeviceType device) { return at::autocast::is_autocast_enabled(device); }

void set_autocast_enabled(c10::DeviceType device, bool enabled) {
  at::autocast::set_autocast_enabled(device, enabled);
}

c10::ScalarType autocast_dtype(c10::DeviceType device) { return at::autocast::get_autocast_dtype(device); }

}  // namespace ampdiag::agent
