// Polls `condition` every `interval` until it holds or `timeout` passes (stretched under
// TSan and on a loaded machine: sanitizer_slowdown.h); returns whether it held. For tests that wait on another
// thread or process.
#pragma once

#include <chrono>
#include <thread>

#include "tests/fakes/sanitizer_slowdown.h"

namespace ckpt::testing {

template <typename Condition>
bool WaitUntil(Condition condition, std::chrono::milliseconds timeout,
               std::chrono::milliseconds interval = std::chrono::milliseconds(5)) {
  auto deadline = std::chrono::steady_clock::now() + Stretched(timeout);
  while (!condition()) {
    if (std::chrono::steady_clock::now() >= deadline) return condition();
    std::this_thread::sleep_for(interval);
  }
  return true;
}

}  // namespace ckpt::testing
