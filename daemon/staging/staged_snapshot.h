// A snapshot that has been copied into staging memory: everything the persist stage needs
// to write and commit it, and what hot restore reads back.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "cuda/staging_pool.h"
#include "daemon/staging/frozen_sums.h"
#include "daemon/staging/staging_ledger.h"
#include "daemon/staging/staged_shard.h"
#include "format/manifest.h"
#include "shm/layout.h"

namespace ckpt::daemon {

// Where ticket updates go: the session that took the snapshot. Held weakly, so a trainer
// that died after "staged" still has its checkpoint committed.
class TicketSink {
 public:
  virtual ~TicketSink() = default;
  virtual void SetTicketState(uint64_t ticket, shm::TicketStateValue state,
                              std::string_view error = {}) = 0;
};

// Where a registered tensor sits in its global tensor (format::TensorShard): a box at
// `offset`, or flat element ranges. Empty: the tensor is whole.
struct TensorPlacement {
  std::vector<int64_t> global_shape;
  std::vector<int64_t> offset;
  std::vector<format::ElementRange> flat;
};

// A session's frozen tensors' bytes as one snapshot copied them from the trainer, shared by
// the snapshots after it that find them unchanged (each holds it while in flight or hot): so
// a frozen base costs its memory once, not once per snapshot in flight and in the hot copy.
struct FrozenBlock {
  cuda::StagingBlockPtr block;
  // Counts it in the job's share of staging memory for as long as it lives: snapshots in
  // flight that share it cannot free it, whatever is evicted. Null without a ledger.
  StagingLedger::HoldPtr hold;
};

struct StagedSnapshot {
  std::string job;
  uint64_t step = 0;
  uint32_t rank = 0;
  uint32_t world_size = 0;
  cuda::StagingBlockPtr block;
  // A shard rebuilt from peers' fragments (restore/rebuilt_snapshot.h) owns its bytes here
  // instead of in a staging block.
  std::shared_ptr<const void> rebuilt;
  StagingWatermark landed;  // how much of `block` the stager has filled
  StagedShard shard;        // entries: tensors, then train-state blobs; landed -> `landed`
  // Frozen tensors (daemon/staging/frozen_tensors.h), per tensor entry; empty when none is
  // frozen. A frozen entry's bytes lie in a frozen block, not in `block`: one this snapshot
  // copied them into from the trainer (its first snapshot with them, or a check), or one an
  // earlier snapshot did, shared (neither copied nor waited for: in place when laid out).
  struct FrozenEntry {
    bool frozen = false;
    bool shared = false;      // in an earlier snapshot's frozen block
    int block = -1;           // index in `frozen_blocks`; -1: not frozen
    uint64_t generation = 0;  // entries of one generation hold the same bytes (frozen_sums);
                              // a shared entry's is set when laid out, a copied one's once
                              // every byte has landed
  };
  std::vector<FrozenEntry> frozen;
  std::vector<std::shared_ptr<const FrozenBlock>> frozen_blocks;  // those its entries lie in
  std::shared_ptr<FrozenSums> frozen_sums;  // the session's; null when `frozen` is empty
  uint64_t shared_bytes = 0;                // bytes of shared frozen entries (not copied)
  std::vector<std::string> frozen_changed;  // frozen tensors a check found changed in place
  size_t tensor_count = 0;     // shard.entries[0, tensor_count) are tensors
  std::vector<TensorPlacement> placements;  // per tensor entry
  std::vector<bool> sparse;  // per tensor entry, registered sparse (TensorSpec.sparse); empty: none
  // The job's ranks with a session on this node when it was taken: they share the node's
  // budget of sparse chunks (persist/increment_chunks.h).
  uint32_t local_ranks = 1;
  std::vector<std::string> train_state_names;  // per blob entry, without the key prefix
  double copy_seconds = 0;  // time the copy engine took
  std::weak_ptr<TicketSink> sink;
  // When the session that took it registered: a snapshot from a session registered after
  // its step was aborted is a new attempt at that step, not a late rank of the old one.
  std::chrono::steady_clock::time_point session_started{};
  // The same instant on the wall clock (ns since the epoch): orders a job's runs in the
  // manifest, so "latest" survives daemon restarts (format::Manifest::run).
  uint64_t session_started_unix_ns = 0;
  uint64_t ticket = 0;
  // Counts the block against the job's fair share while the snapshot is in flight; dropped
  // when the snapshot becomes a hot copy (HotCache::Insert) or ends.
  StagingLedger::HoldPtr in_flight;
};

using StagedSnapshotPtr = std::shared_ptr<StagedSnapshot>;

}  // namespace ckpt::daemon
