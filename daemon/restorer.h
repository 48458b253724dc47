// Restores a session's registered buffers from the latest (or a given) committed
// checkpoint of its job: from the daemon's memory when that snapshot is still there (hot),
// else from the rank's shard on disk, every tensor checked against its manifest checksum.
// "Latest" is agreed by all ranks of the job (restore/step_agreement.h), so every rank
// gets the same step; a step that some rank finds damaged is given up by all of them for
// the newest older one. A rank may restore with another world size or placement than the
// step was saved with: the read planner (restore/read_plan.h) finds which bytes of which
// saved shards make up each registered piece. A selection (restore/tensor_selection.h)
// restores some tensors and leaves the others alone.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "cuda/copy_engine.h"
#include "cuda/copy_priority.h"
#include "format/checkpoint_store.h"
#include "daemon/persist/retention_keeper.h"
#include "daemon/restore/peer_source.h"
#include "daemon/restore/step_agreement.h"
#include "format/tensor_selection.h"
#include "daemon/staging/hot_cache.h"
#include "daemon/staging/stager.h"
#include "shm/payload.h"
#include "storage/open_store.h"

namespace ckpt::daemon {

struct RestoreResult {
  enum class Source { kMemory, kDisk, kRemote, kPeer };
  bool found = false;  // false: the job has no committed checkpoint yet
  uint64_t step = 0;
  Source source = Source::kDisk;
  uint64_t bytes = 0;
  // Read from a file or the remote tier to restore `bytes` (whole chunks, every saved
  // piece a resharded tensor overlaps); 0 from memory.
  uint64_t bytes_read = 0;
  std::map<std::string, std::string> metadata;
  std::vector<shm::NamedBlob> train_state;
  uint64_t tensors = 0;  // restored
  uint64_t skipped = 0;  // of this rank's tensors in the checkpoint, not restored
  // With allow_missing only (at most kMaxListed names each): selected tensors registered but
  // not in the checkpoint, and selected tensors in the checkpoint but not registered.
  std::vector<std::string> not_in_checkpoint;
  std::vector<std::string> not_registered;
  // Newer steps given up because a rank found them damaged, each naming the step and why.
  std::vector<std::string> warnings;
  uint32_t saved_world_size = 0;  // the restored step's world size
};

struct RestoreSpec {
  std::optional<uint64_t> step;  // nullopt: the latest step every rank has (collective)
  format::TensorSelection selection;     // default: every tensor
  // Selected tensors on one side only are skipped and listed instead of failing the restore.
  bool allow_missing = false;
  // Floating-point tensors saved in another dtype than registered are cast (common/dtype_convert.h)
  // instead of refused: a weights-only checkpoint saved in BF16, loaded into FP32.
  bool cast = false;
};

inline constexpr size_t kMaxListed = 1000;
// Tensors a restore from the remote tier fetches at once (each in up to 8 ranged GETs).
inline constexpr int kRemoteTensorsAtOnce = 4;
// Tensors a restore reads at once from a local disk or memory: a model of hundreds of
// tensors of a few MB each read one O_DIRECT pread (then its checksum) at a time left the
// disk idle between them (0.42 GB/s for GPT-2 medium against 2 GB/s the disk writes).
inline constexpr int kLocalTensorsAtOnce = 4;
// Smaller tensors are read on the restoring thread: a thread of its own costs more than they.
inline constexpr uint64_t kLocalReadAsideBytes = uint64_t{1} << 20;
// How many damaged steps in a row a restore of the latest step gives up before failing.
inline constexpr int kMaxFallbacks = 4;

class Restorer {
 public:
  // GPU tensors are restored through `device_engine` (from memory directly; from disk via a
  // bounce block of `pool`).
  // Ranks wait up to `agree_timeout` for each other when restoring the latest step.
  // `remote` (may be null): the remote tier, whose steps every rank of every node can
  // read; a step is read from it only where memory and this node's disk cannot serve it.
  // `peers` (may be null, --replication): this node's ranks rebuilt from the fragments its
  // coding group holds, where this node lost its own copy (before the remote tier).
  Restorer(format::CheckpointStore& store, format::CheckpointStore* remote, HotCache& hot,
           persist::RetentionKeeper& retention, StepAgreement& agreement,
           std::chrono::milliseconds agree_timeout, cuda::CopyEngine& engine,
           cuda::CopyPriority* priority = nullptr,
           std::vector<cuda::CopyEngine*> device_engines = {}, cuda::StagingPool* pool = nullptr,
           PeerSource* peers = nullptr)
      : store_(store), remote_(remote), hot_(hot), retention_(retention), agreement_(agreement),
        agree_timeout_(agree_timeout), engine_(engine), priority_(priority),
        device_engines_(std::move(device_engines)), pool_(pool), peers_(peers) {}

  absl::StatusOr<RestoreResult> Restore(const SessionView& session, const RestoreSpec& spec);
  // The job's committed steps on this node's disk, in the job's order (by run, then step).
  absl::StatusOr<std::vector<uint64_t>> CommittedSteps(const std::string& job) {
    return store_.ListStepsInRunOrder(job);
  }
  // The jobs with a directory in this node's store, and a job's committed steps there by
  // number (a listing, no manifest read).
  absl::StatusOr<std::vector<std::string>> Jobs() { return store_.ListJobs(); }
  absl::StatusOr<std::vector<uint64_t>> Steps(const std::string& job) { return store_.ListSteps(job); }
  // Whether this node's store is an object store (direct mode): listings cost requests.
  bool StoreIsRemote() const { return storage::IsS3Url(store_.root()); }

 private:
  absl::StatusOr<RestoreResult> RestoreLatest(const SessionView& session, const RestoreSpec& spec,
                                              std::vector<uint64_t> steps);
  absl::StatusOr<RestoreResult> RestoreStep(const SessionView& session, const RestoreSpec& spec,
                                            uint64_t step);
  // A snapshot's tensor entries by name: their indices in its shard.
  using EntryIndex = std::unordered_map<std::string_view, size_t>;
  absl::Status FromMemory(const SessionView& session, const RestoreSpec& spec, const StagedSnapshot& snap,
                          const EntryIndex& entries, RestoreResult& result);
  // Through the read planner: any placement, from memory or disk, checked before use.
  absl::Status FromPlan(const SessionView& session, const RestoreSpec& spec,
                        const format::Manifest& manifest, RestoreResult& result);

  // Committed steps this rank can restore here, in the job's order: hot, its shard file on
  // this node's disk, or in the remote tier.
  absl::StatusOr<std::vector<uint64_t>> Available(const SessionView& session);
  // The rank's shard of `step` rebuilt from peers, when it serves the session as saved (the
  // saved world and placement): the snapshot and this node's manifest of the step.
  absl::StatusOr<std::pair<StagedSnapshotPtr, format::Manifest>> FromPeers(const SessionView& session,
                                                                           const RestoreSpec& spec, uint64_t step);
  // Whether this node can serve every shard `ranks` of the step from memory or its disk.
  bool LocalHasAll(const std::string& job, uint64_t step, const std::set<uint32_t>& ranks,
                   const format::Manifest& manifest);

  format::CheckpointStore& store_;
  format::CheckpointStore* remote_;  // may be null
  HotCache& hot_;
  persist::RetentionKeeper& retention_;
  StepAgreement& agreement_;
  const std::chrono::milliseconds agree_timeout_;
  cuda::CopyEngine& engine_;
  cuda::CopyPriority* priority_;  // may be null; outlives the restorer
  std::vector<cuda::CopyEngine*> device_engines_;  // by device ordinal
  cuda::StagingPool* pool_;          // may be null
  PeerSource* peers_;                // may be null
};

// Which registered tensors a restore fills: those selected that the checkpoint holds for
// this rank (`stored`). Selected tensors on one side only are an error listing them, unless
// spec.allow_missing (then they are listed in `result`); so is a selection that matches
// none of the checkpoint's tensors. Stored tensors not registered are not counted when
// !report_unregistered (another world size: other ranks may take them). Sets
// result.tensors and result.skipped.
absl::StatusOr<std::vector<const RegisteredTensor*>> MatchTensors(
    const std::vector<RegisteredTensor>& registered, const std::vector<std::string>& stored,
    const RestoreSpec& spec, uint64_t step, RestoreResult& result, bool report_unregistered = true);

}  // namespace ckpt::daemon
