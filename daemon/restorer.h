// Restores a session's registered buffers from the latest (or a given) committed
// checkpoint of its job: from the daemon's memory when that snapshot is still there (hot),
// else from the rank's shard on disk, every tensor checked against its manifest checksum.
// Same topology only: the checkpoint's world size must match the session's.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "cuda/copy_engine.h"
#include "cuda/copy_priority.h"
#include "daemon/checkpointer.h"
#include "daemon/persist/checkpoint_store.h"
#include "daemon/staging/stager.h"
#include "shm/payload.h"

namespace ckpt::daemon {

struct RestoreResult {
  enum class Source { kMemory, kDisk };
  bool found = false;  // false: the job has no committed checkpoint yet
  uint64_t step = 0;
  Source source = Source::kDisk;
  uint64_t bytes = 0;
  std::map<std::string, std::string> metadata;
  std::vector<shm::NamedBlob> train_state;
};

class Restorer {
 public:
  // GPU tensors are restored through `device_engine` (from memory directly; from disk via a
  // bounce block of `pool`).
  Restorer(persist::CheckpointStore& store, Checkpointer& checkpointer, cuda::CopyEngine& engine,
           cuda::CopyPriority* priority = nullptr,
           std::vector<cuda::CopyEngine*> device_engines = {}, cuda::StagingPool* pool = nullptr)
      : store_(store), checkpointer_(checkpointer), engine_(engine), priority_(priority),
        device_engines_(std::move(device_engines)), pool_(pool) {}

  absl::StatusOr<RestoreResult> Restore(const SessionView& session, std::optional<uint64_t> step);

 private:
  absl::Status FromMemory(const SessionView& session, const StagedSnapshot& snap,
                          RestoreResult& result);
  absl::Status FromDisk(const SessionView& session, const persist::Manifest& manifest,
                        RestoreResult& result);

  persist::CheckpointStore& store_;
  Checkpointer& checkpointer_;
  cuda::CopyEngine& engine_;
  cuda::CopyPriority* priority_;  // may be null; outlives the restorer
  std::vector<cuda::CopyEngine*> device_engines_;  // by device ordinal
  cuda::StagingPool* pool_;          // may be null
};

// Checks that the registered tensors and the checkpoint's tensors for this rank have the
// same names; the message lists what is missing on either side.
absl::Status CheckSameNames(const std::vector<RegisteredTensor>& registered,
                            const std::vector<std::string>& stored, uint64_t step);

}  // namespace ckpt::daemon
