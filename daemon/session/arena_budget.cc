#include "daemon/session/arena_budget.h"

#include <fmt/format.h>

#include <algorithm>

namespace ckpt::daemon {

absl::Status ArenaBudget::Take(uid_t uid, uint64_t bytes) {
  std::lock_guard lock(mu_);
  Use& mine = of_uid_[uid];
  if (mine.arenas >= options_.arenas_per_uid || arenas_ >= options_.arenas) {
    return absl::ResourceExhaustedError(fmt::format(
        "too many arenas mapped ({} of uid {}, {} in all; at most {} per user and {} in all)",
        mine.arenas, uid, arenas_, options_.arenas_per_uid, options_.arenas));
  }
  if (options_.bytes_per_uid != 0 && mine.bytes + bytes > options_.bytes_per_uid) {
    return absl::ResourceExhaustedError(fmt::format(
        "uid {} already has {} bytes of arenas registered; {} more would pass the bound of {} "
        "bytes per user (4 x --staging-bytes)",
        uid, mine.bytes, bytes, options_.bytes_per_uid));
  }
  ++mine.arenas;
  mine.bytes += bytes;
  ++arenas_;
  return absl::OkStatus();
}

void ArenaBudget::Give(uid_t uid, size_t arenas, uint64_t bytes) {
  std::lock_guard lock(mu_);
  auto it = of_uid_.find(uid);
  if (it == of_uid_.end()) return;
  it->second.arenas -= std::min(it->second.arenas, arenas);
  it->second.bytes -= std::min(it->second.bytes, bytes);
  arenas_ -= std::min(arenas_, arenas);
  if (it->second.arenas == 0) of_uid_.erase(it);
}

}  // namespace ckpt::daemon
