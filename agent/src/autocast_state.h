// Autocast's state on a device, behind one file: ATen/autocast_mode.h brings every ATen
// operator's header with it (~15 s of compile in each file that includes it).
#pragma once

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

namespace ampdiag::agent {

bool autocast_enabled(c10::DeviceType device);
void set_autocast_enabled(c10::DeviceType device, bool enabled);
// What autocast computes in on `device` when it is on (float16 or bfloat16).
c10::ScalarType autocast_dtype(c10::DeviceType device);

}  // namespace ampdiag::agent
