#include "daemon/control/call_limiter.h"

#include <fmt/format.h>

namespace ckpt::daemon {

absl::StatusOr<CallLimiter::Slot> CallLimiter::Enter(uid_t uid, std::string_view what) {
  std::lock_guard lock(mu_);
  size_t& mine = of_uid_[uid];
  if (mine >= per_uid_ || in_flight_ >= total_) {
    return absl::ResourceExhaustedError(fmt::format(
        "too many {} calls at once ({} of uid {}, {} in all; at most {} per user and {} in "
        "all): wait on the shared-memory ring (the client library does) or retry later",
        what, mine, uid, in_flight_, per_uid_, total_));
  }
  ++mine;
  ++in_flight_;
  return Slot(this, uid);
}

void CallLimiter::Leave(uid_t uid) {
  std::lock_guard lock(mu_);
  --in_flight_;
  if (--of_uid_[uid] == 0) of_uid_.erase(uid);
}

}  // namespace ckpt::daemon
