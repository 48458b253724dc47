// How much slower a test binary built with --config=tsan (CKPTD_TSAN) runs: every process
// runs several times slower, and each byte it touches costs several more in shadow memory.
// Time bounds (WaitUntil's among them) and the daemons' timeouts stretch by this factor,
// and the largest states shrink by it (two tests at once of 1.5 GiB each took a machine's
// 23 GiB under TSan).
#pragma once

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>

namespace ckpt::testing {

#ifdef CKPTD_TSAN
inline constexpr int kSanitizerSlowdown = 4;
#else
inline constexpr int kSanitizerSlowdown = 1;
#endif

// How much a test's upper bounds on waits stretch: the build's slowdown, times how far the
// machine's load (the 1-minute average when the test binary first asks) exceeds its cores,
// at most 3: a CI machine running another build beside the tests gets bounds to match, and a
// quiet one the build's own. Only bounds stretch; the daemons' own timeouts, which tests
// assert behaviour against, keep kSanitizerSlowdown alone.
inline double BoundScale() {
  static const double scale = [] {
    double load = 0;
    if (std::FILE* f = std::fopen("/proc/loadavg", "r")) {
      if (std::fscanf(f, "%lf", &load) != 1) load = 0;
      std::fclose(f);
    }
    const long cpus = ::sysconf(_SC_NPROCESSORS_ONLN);
    const double busy = cpus > 0 ? load / static_cast<double>(cpus) : 1.0;
    return kSanitizerSlowdown * std::clamp(busy, 1.0, 3.0);
  }();
  return scale;
}

// `bound` stretched by BoundScale().
inline std::chrono::milliseconds Stretched(std::chrono::milliseconds bound) {
  return std::chrono::milliseconds(static_cast<std::chrono::milliseconds::rep>(bound.count() * BoundScale()));
}

}  // namespace ckpt::testing
