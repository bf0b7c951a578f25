// What the session-core tests share: a session that records every step at once, and its
// layers registered before the file opens.
#pragma once

#include <cstdint>
#include <string>

#include "session.h"

namespace ampdiag::test {

// Every step recorded, no context steps, no wait at close, one CPU thread.
inline agent::SessionOptions recording_options(std::int64_t max_waiting = 4) {
  agent::SessionOptions o;
  o.recorder.every = 1;
  o.recorder.context_steps = 0;
  o.recorder.max_waiting = max_waiting;
  o.recorder.close_wait_ms = 0;
  o.cpu.threads = 1;
  return o;
}

// A float32 layer of 8 elements.
inline agent::LayerInfo float_layer(const std::string& name, const std::string& module_path) {
  agent::LayerInfo info;
  info.name = name;
  info.module_path = module_path;
  info.dtype = "float32";
  info.numel = 8;
  return info;
}

// Registers `n` float32 layers of 8 elements (l0.weight, ...; keys 1000, ...) and opens the file.
inline void open_with_layers(agent::Session& s, const std::string& path, int n) {
  for (int i = 0; i < n; ++i)
    s.add_layer(std::uintptr_t(1000 + i), float_layer("l" + std::to_string(i) + ".weight", "l" + std::to_string(i)));
  s.layers_done();
  s.open(path, {}, "test-run");
}

}  // namespace ampdiag::test
