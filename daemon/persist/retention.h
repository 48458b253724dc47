// Which committed checkpoints to delete. Pure function: the caller runs the deletions off
// the save path, so retention never blocks a save.
#pragma once

#include <cstdint>
#include <vector>

namespace ckpt::persist {

struct RetentionPolicy {
  uint32_t keep_last = 0;   // keep the newest K; 0 keeps everything
  uint64_t keep_every = 0;  // also keep steps divisible by N; 0 disables
};

// `committed` in run order, oldest first (CheckpointStore::ListStepsInRunOrder): keep_last
// keeps the K latest. Never returns the latest, nor any step in `pinned` (steps in use, such as one being
// restored).
std::vector<uint64_t> StepsToDelete(const std::vector<uint64_t>& committed,
                                    const RetentionPolicy& policy,
                                    const std::vector<uint64_t>& pinned = {});

}  // namespace ckpt::persist
