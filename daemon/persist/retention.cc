#include "daemon/persist/retention.h"

#include <algorithm>

namespace ckpt::persist {

std::vector<uint64_t> StepsToDelete(const std::vector<uint64_t>& committed,
                                    const RetentionPolicy& policy,
                                    const std::vector<uint64_t>& pinned) {
  std::vector<uint64_t> doomed;
  if (policy.keep_last == 0 || committed.size() <= policy.keep_last) return doomed;
  size_t first_kept = committed.size() - policy.keep_last;
  for (size_t i = 0; i < first_kept; ++i) {
    uint64_t step = committed[i];
    if (policy.keep_every != 0 && step % policy.keep_every == 0) continue;
    if (std::find(pinned.begin(), pinned.end(), step) != pinned.end()) continue;
    doomed.push_back(step);
  }
  return doomed;
}

}  // namespace ckpt::persist
