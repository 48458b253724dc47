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

// The snapshot metadata key that makes a checkpoint ephemeral: kept only until a newer
// step of its job commits (a checkpoint for a quick restart, not for the record).
inline constexpr char kEphemeralKey[] = "ckptd.ephemeral";

// `committed` in run order, oldest first (CheckpointStore::ListStepsInRunOrder): keep_last
// keeps the K latest; an ephemeral step (in `ephemeral`) goes as soon as it is not the
// latest, whatever keep_last and keep_every say. Never returns the latest, nor any step in
// `pinned` (steps in use, such as one being restored).
std::vector<uint64_t> StepsToDelete(const std::vector<uint64_t>& committed,
                                    const RetentionPolicy& policy,
                                    const std::vector<uint64_t>& pinned = {},
                                    const std::vector<uint64_t>& ephemeral = {});

}  // namespace ckpt::persist
