// Full verification of a committed checkpoint (`ckptctl verify`): every file of the step
// directory, every shard's size and header, and every tensor and train-state entry against
// the manifest's dtype, shape, offsets, checksum and chunk checksums. Each rank's pieces are
// read through the read planner, as a restore in the saved placement reads them.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "format/checkpoint_store.h"

namespace ckpt::format {

struct VerifyReport {
  bool ok() const { return problems.empty(); }
  std::vector<std::string> problems;  // each names the file and, where known, the tensor
  uint64_t bytes_checked = 0;
  // Version 5: of bytes_checked, those read from the files of the steps it references, and
  // those files (as the store names them: a held step's are in its held directory).
  uint64_t bytes_referenced = 0;
  std::vector<std::string> referenced_files;
  // Held by other nodes (node-local disks): placed elsewhere by `nodes` with
  // VerifyOptions::node, or not listed by a node-scoped manifest. Ascending.
  std::vector<uint32_t> skipped_ranks;
  bool cancelled = false;               // `progress` asked to stop: the report is partial
};

struct VerifyOptions {
  // Shards the manifest places on another node are skipped (and listed): with node-local
  // disks each node holds only its own.
  std::optional<uint32_t> node;
  // Called after each window read, with the bytes checked and the bytes the verify will
  // check in all (a verify of a large step takes minutes). Returning false stops it: whoever
  // asked has gone, and the step should not stay pinned and read for nobody.
  std::function<bool(uint64_t checked, uint64_t total)> progress;
};

// Errors only when the manifest itself cannot be read; damage is reported in the report:
// a flipped bit (whole-entry or chunk checksum), a truncated, missing or extra file, a
// header that disagrees with the manifest, entries the manifest does not list. Memory: one
// window of format::ShardReader::kReadWindowBytes, whatever the size of an entry.
absl::StatusOr<VerifyReport> VerifyCheckpoint(format::CheckpointStore& store, const std::string& job,
                                              uint64_t step, const VerifyOptions& options = {});

}  // namespace ckpt::format
