// How much slower a test binary built with --config=tsan (CKPTD_TSAN) runs: every process
// runs several times slower, and each byte it touches costs several more in shadow memory.
// Time bounds (WaitUntil's among them) and the daemons' timeouts stretch by this factor,
// and the largest states shrink by it (two tests at once of 1.5 GiB each took a machine's
// 23 GiB under TSan).
#pragma once

namespace ckpt::testing {

#ifdef CKPTD_TSAN
inline constexpr int kSanitizerSlowdown = 4;
#else
inline constexpr int kSanitizerSlowdown = 1;
#endif

}  // namespace ckpt::testing
