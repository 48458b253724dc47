// Copies a session's registered buffers (and the snapshot's train-state blobs) into one
// staging block laid out exactly as the shard's data region, so that the writer can
// stream it to disk in one pass and hot restore can copy straight back. The copy runs in
// chunks, in order, and the snapshot is handed to the persist stage before the first one:
// the writer streams chunk k to storage while chunk k+1 is being copied.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <map>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "cuda/copy_engine.h"
#include "cuda/copy_priority.h"
#include "cuda/staging_pool.h"
#include "daemon/config.h"
#include "daemon/staging/frozen_tensors.h"
#include "daemon/staging/hot_cache.h"
#include "daemon/staging/registered_tensor.h"
#include "daemon/staging/progress_signal.h"
#include "daemon/staging/write_protector.h"
#include "shm/payload.h"

namespace ckpt::daemon {

// What the stager and restorer need to know about a session.
struct SessionView {
  std::string job;
  uid_t uid = 0;  // the trainer's: fair shares of staging memory are per user
  uint32_t rank = 0;
  uint32_t world_size = 0;
  const std::vector<RegisteredTensor>* tensors = nullptr;
  void* cuda_after = nullptr;  // the trainer's snapshot event (cudaEvent_t), if any
  WriteProtector* write_protect = nullptr;  // copy-on-write snapshots of tensors that have a
                                            // trainer_address; null: copy before releasing
  // The session's frozen tensors across snapshots (copied once into a frozen block, then
  // shared); null: every tensor is copied from the trainer at each snapshot.
  FrozenTensors* frozen = nullptr;
};

class Stager {
 public:
  // `device_engines[d]` copies GPU tensors of device d; empty where the daemon has no usable
  // GPU (sessions then refuse GPU tensors at registration).
  struct Options {
    WhenBusy when_busy = WhenBusy::kSkip;
    std::chrono::milliseconds busy_wait{0};
    // Bytes per copy call; the writer may start on a chunk once it has landed. Large enough
    // that the per-call synchronisation is noise next to the copy (~2.5 ms at 50 GB/s).
    uint64_t chunk_bytes = 128ull << 20;
    // Fair shares of the staging memory between jobs; null: none (one job, tests).
    StagingLedger* ledger = nullptr;
    // Copy-on-write snapshots copy and release the trainer's arenas in chunks of this many
    // bytes (rounded up to the huge page): small enough that a trainer thread writing to a
    // chunk not copied yet waits well under a millisecond, large enough to be few calls.
    uint64_t cow_chunk_bytes = 4ull << 20;
  };

  // When the pool is full the stager evicts hot copies from `hot` and waits on `progress`
  // (under --when-busy=wait) for writes to free memory.
  Stager(cuda::StagingPool& pool, cuda::CopyEngine& engine, HotCache& hot,
         ProgressSignal& progress, Options options, cuda::CopyPriority* priority = nullptr,
         std::vector<cuda::CopyEngine*> device_engines = {})
      : pool_(pool), engine_(engine), hot_(hot), progress_(progress), options_(options),
        priority_(priority), device_engines_(std::move(device_engines)) {}

  // Called once the snapshot's staging block is reserved and laid out, before any byte is
  // copied; the session hands it to the persist stage here.
  using OnLaidOut = std::function<void(const StagedSnapshotPtr&)>;
  // Called as soon as the trainer may change its tensors: once they are copied, or, for a
  // copy-on-write snapshot, once they are write-protected (the copy then goes on). Returns
  // false when the trainer had already abandoned the snapshot (shm kTicketAbandoned: it
  // stopped waiting and may have changed its tensors during the copy): the snapshot fails.
  using OnReleased = std::function<bool()>;

  // Returns once every byte has landed. ResourceExhausted when staging memory cannot be had
  // under the --when-busy policy (then `on_laid_out` was not called). A copy error after
  // `on_laid_out` also fails the snapshot's watermark, so its writer stops.
  absl::StatusOr<StagedSnapshotPtr> Stage(const SessionView& session, uint64_t step,
                                          shm::SnapshotPayload payload,
                                          const OnLaidOut& on_laid_out = {},
                                          const OnReleased& on_released = {});

 private:
  // Blocks of `sizes`, and one hold on the job's share for them all, under the --when-busy
  // policy.
  struct Reserved {
    std::vector<cuda::StagingBlockPtr> blocks;  // one per size, in order
    StagingLedger::HoldPtr hold;
  };
  // Without `make_room`: one try, evicting no hot copy and waiting for nothing.
  absl::StatusOr<Reserved> Reserve(const SessionView& session, const std::vector<size_t>& sizes,
                                   const std::string& context, bool make_room = true);
  // Copies the tensors, chunk by chunk, into `to` (per entry; null for frozen tensors shared
  // from an earlier snapshot, which are left out), advancing the snapshot's watermark after
  // each. Tensors with a trainer_address go copy-on-write (then `on_released` is called early).
  absl::Status CopyTensors(const SessionView& session, StagedSnapshot& snap, const std::vector<char*>& to,
                           const OnReleased& on_released, bool& released);
  // Each frozen entry's generation: the plan's when shared, or when a check found the
  // trainer's bytes unchanged; a new one otherwise (changes found are named in the snapshot).
  static void SetGenerations(FrozenTensors& state, const FrozenPlan& plan, const std::vector<char*>& to,
                             StagedSnapshot& snap);
  // The host tensors selected by `only` (by index), in one job, without moving the watermark.
  absl::Status CopyHostTensors(const SessionView& session, StagedSnapshot& snap, const std::vector<char*>& to,
                               const std::vector<bool>& only);

  cuda::StagingPool& pool_;
  cuda::CopyEngine& engine_;
  HotCache& hot_;
  ProgressSignal& progress_;
  const Options options_;
  cuda::CopyPriority* priority_;  // may be null; outlives the stager
  std::vector<cuda::CopyEngine*> device_engines_;  // by device ordinal
};

// A copy job split by where its tensors live: host regions, and regions per GPU.
struct SplitCopy {
  std::vector<cuda::CopyRegion> host;
  std::map<int, std::vector<cuda::CopyRegion>> device;  // by device ordinal
  void Add(const RegisteredTensor& t, cuda::CopyRegion region) {
    region.allocation = t.on_device ? t.allocation : nullptr;
    (t.on_device ? device[t.device] : host).push_back(region);
  }
};

// Runs each part on its engine: GPU parts on `device_engines[d]` after `device_after` (the
// trainer's snapshot event, or null), the host part on `host`.
absl::Status CopySplit(cuda::CopyEngine& host, const std::vector<cuda::CopyEngine*>& device_engines,
                       const SplitCopy& job, void* device_after = nullptr);

}  // namespace ckpt::daemon
