// What the trainers' arenas may cost the daemon. Each mapped arena costs the daemon a
// mapping (the kernel allows a process about 65,000) and page tables in proportion to its
// size; a trainer could hand over one memfd many times, or register in many sessions, to
// make the daemon pay for memory it owns once. So mapped arenas are counted per uid and in
// all, across sessions, and a registration beyond the budget is refused, naming it.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"

namespace ckpt::daemon {

class ArenaBudget {
 public:
  struct Options {
    size_t arenas_per_uid = 8192;
    size_t arenas = 32768;
    uint64_t bytes_per_uid = 0;  // 0: no bound (tests); ckptd: 4 x --staging-bytes
  };
  explicit ArenaBudget(Options options) : options_(options) {}

  // One more arena of `bytes` for `uid`, or ResourceExhausted naming the bound.
  absl::Status Take(uid_t uid, uint64_t bytes);
  // Gives back what Take() counted (a session's arenas, when it ends).
  void Give(uid_t uid, size_t arenas, uint64_t bytes);

 private:
  struct Use {
    size_t arenas = 0;
    uint64_t bytes = 0;
  };
  const Options options_;
  std::mutex mu_;
  std::map<uid_t, Use> of_uid_ ABSL_GUARDED_BY(mu_);
  size_t arenas_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace ckpt::daemon
