// Carries out a read plan (read_plan.h) for one step: the bytes of each wanted piece, from
// the node's memory where the saved rank's snapshot is still there, from its shard file
// otherwise (pread of the chunks covering the plan's runs, never whole files), every byte
// read from disk checked against the manifest's checksums before it is used.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "common/filesystem.h"
#include "daemon/persist/manifest.h"
#include "daemon/persist/shard_reader.h"
#include "daemon/restore/read_plan.h"
#include "daemon/staging/staged_snapshot.h"
#include "shm/payload.h"

namespace ckpt::restore {

class PlanReader {
 public:
  // The snapshot of a saved rank of this step held in memory, or null.
  using HotLookup = std::function<daemon::StagedSnapshotPtr(uint32_t rank)>;

  PlanReader(Filesystem& fs, std::string step_dir, const persist::Manifest& manifest,
             HotLookup hot)
      : fs_(fs), step_dir_(std::move(step_dir)), manifest_(manifest), hot_(std::move(hot)) {}

  // Fills dst[0, tensor.bytes) with the wanted piece. DataLoss when what was read does not
  // match its checksums or the file disagrees with the manifest; NotFound when a shard it
  // needs is neither in memory nor on this node's disk.
  absl::Status Read(const TensorReadPlan& tensor, char* dst);

  // Rank `rank`'s train state, checked the same way.
  absl::StatusOr<std::vector<shm::NamedBlob>> TrainState(uint32_t rank);

  uint64_t bytes_from_memory() const { return from_memory_; }
  uint64_t bytes_from_disk() const { return from_disk_; }  // what was pread, chunks whole

 private:
  // A saved rank's snapshot in memory, its tensor entries by name.
  struct HotShard {
    daemon::StagedSnapshotPtr snapshot;  // null: not in memory
    std::unordered_map<std::string_view, const persist::TensorEntry*> tensors;
  };
  // Looked up, and indexed, once per rank.
  const HotShard& Hot(uint32_t rank);
  absl::StatusOr<const persist::ShardReader*> Reader(uint32_t rank);

  Filesystem& fs_;
  const std::string step_dir_;
  const persist::Manifest& manifest_;
  HotLookup hot_;
  std::map<uint32_t, HotShard> hot_shards_;
  std::map<uint32_t, persist::ShardReaderPtr> readers_;      // opened once per file
  uint64_t from_memory_ = 0;
  uint64_t from_disk_ = 0;
};

}  // namespace ckpt::restore
