// What a trainer may ask of its ckptd besides its own session: the committed checkpoints of
// a job, in every tier, as `ckptctl list` shows them (the admin service's List).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace ckpt {

struct CheckpointListing {
  std::string job;
  uint64_t step = 0;
  uint32_t world_size = 0;
  uint32_t tensors = 0;
  uint64_t bytes = 0;
  double unix_time = 0;
  std::vector<std::string> tiers;  // "memory", "local", "remote"
  std::vector<std::string> flags;  // "ephemeral", "weights-only"; none: a full checkpoint
  std::string error;               // its manifest cannot be read: why
  std::vector<std::string> files;  // stored with the step (format/user_files.h), by name
};

struct CheckpointList {
  std::vector<CheckpointListing> checkpoints;  // by job, then step
  std::vector<std::string> errors;             // tiers that could not be listed, and why
};

// The committed checkpoints of `job` (every job when empty) that the ckptd at `socket` holds.
absl::StatusOr<CheckpointList> ListCheckpoints(const std::string& socket, const std::string& job);

}  // namespace ckpt
