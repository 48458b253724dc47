// Bounds the calls that may block a server thread for long (Wait, Restore), per uid and in
// all, so that one user's trainers cannot hold every thread of the Unix socket's server
// while other users' calls queue behind them. A call over the bound is refused at once
// (RESOURCE_EXHAUSTED, naming the bound), never queued.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <map>
#include <mutex>
#include <string_view>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"

namespace ckpt::daemon {

class CallLimiter {
 public:
  CallLimiter(size_t per_uid, size_t total) : per_uid_(per_uid), total_(total) {}

  // Held for the length of one call; releases its place when it goes.
  class Slot {
   public:
    Slot(Slot&& other) noexcept : limiter_(std::exchange(other.limiter_, nullptr)), uid_(other.uid_) {}
    Slot& operator=(Slot&&) = delete;
    ~Slot() {
      if (limiter_ != nullptr) limiter_->Leave(uid_);
    }

   private:
    friend class CallLimiter;
    Slot(CallLimiter* limiter, uid_t uid) : limiter_(limiter), uid_(uid) {}
    CallLimiter* limiter_;
    uid_t uid_;
  };

  absl::StatusOr<Slot> Enter(uid_t uid, std::string_view what);

 private:
  void Leave(uid_t uid);

  const size_t per_uid_;
  const size_t total_;
  std::mutex mu_;
  std::map<uid_t, size_t> of_uid_ ABSL_GUARDED_BY(mu_);
  size_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace ckpt::daemon
