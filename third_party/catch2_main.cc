// The one Catch2 main for every unit and integration test binary.
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>

#include "absl/synchronization/mutex.h"

namespace {

// As ckptd's own main (daemon/main.cc): Debian builds Abseil with its mutex deadlock
// detector on, and every lock of gRPC's absl::Mutex then updates one global lock graph. In
// the tests that start group servers in-process that graph is also what TSan reports as a
// race (Abseil is not instrumented, its spinlock invisible to TSan).
[[maybe_unused]] const bool kNoDeadlockDetection = [] {
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  return true;
}();

}  // namespace
