// Full verification of a committed checkpoint: every shard's size and header, and every
// tensor and train-state entry against the manifest's dtype, shape, offsets and checksum.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/persist/checkpoint_store.h"

namespace ckpt::persist {

struct VerifyReport {
  bool ok() const { return problems.empty(); }
  std::vector<std::string> problems;  // each names the file and, where known, the tensor
  uint64_t bytes_checked = 0;
  std::vector<uint32_t> skipped_ranks;  // held by other nodes (node-local disks)
};

// Errors only when the manifest itself cannot be read; damage is reported in the report.
// With `node`, shards the manifest places on another node are skipped (and listed): with
// node-local disks each node holds only its own.
absl::StatusOr<VerifyReport> VerifyCheckpoint(CheckpointStore& store, const std::string& job,
                                              uint64_t step,
                                              std::optional<uint32_t> node = std::nullopt);

}  // namespace ckpt::persist
