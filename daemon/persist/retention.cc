#include "daemon/persist/retention.h"

#include <algorithm>

namespace ckpt::persist {

std::vector<uint64_t> StepsToDelete(const std::vector<uint64_t>& committed,
                                    const RetentionPolicy& policy,
                                    const std::vector<uint64_t>& pinned,
                                    const std::vector<uint64_t>& ephemeral) {
  auto contains = [](const std::vector<uint64_t>& v, uint64_t step) {
    return std::find(v.begin(), v.end(), step) != v.end();
  };
  std::vector<uint64_t> doomed;
  if (committed.empty()) return doomed;
  size_t first_kept = policy.keep_last == 0 || committed.size() <= policy.keep_last
                          ? 0
                          : committed.size() - policy.keep_last;
  for (size_t i = 0; i + 1 < committed.size(); ++i) {  // the latest always stays
    uint64_t step = committed[i];
    if (contains(pinned, step)) continue;
    bool expired = contains(ephemeral, step) ||
                   (i < first_kept && !(policy.keep_every != 0 && step % policy.keep_every == 0));
    if (expired) doomed.push_back(step);
  }
  return doomed;
}

}  // namespace ckpt::persist
