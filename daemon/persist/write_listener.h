// What the write queue tells the commit stage about each rank's shard, and asks of it.
// The commit stage (daemon/commit/) implements it; the write queue never decides whether a
// step commits.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "daemon/persist/shard_writer.h"
#include "daemon/staging/staged_snapshot.h"

namespace ckpt::persist {

class WriteListener {
 public:
  virtual ~WriteListener() = default;
  // The snapshot was queued for writing (cheap, no I/O). An error refuses this snapshot
  // alone (a rank sent twice, a world size that disagrees, a step already decided); the
  // caller fails its ticket with the message.
  virtual absl::Status Arrived(const daemon::StagedSnapshotPtr& snapshot) = 0;
  // On an I/O thread, before writing: the directory to write the shard into, created once
  // per step. An error fails the step.
  virtual absl::StatusOr<std::string> StepDirectory(const daemon::StagedSnapshotPtr& snapshot) = 0;
  // The shard is written and fsynced in that directory.
  virtual void Durable(const daemon::StagedSnapshotPtr& snapshot, WrittenShard shard) = 0;
  // Writing failed; the step cannot commit.
  virtual void Failed(const daemon::StagedSnapshotPtr& snapshot, const std::string& error) = 0;
  // A rank's snapshot of (job, step) was refused before it was staged (no staging memory
  // under --when-busy=skip, or its payload was unusable): the step can never complete, so
  // it ends now, on this node and through the group, and its other ranks' memory is freed
  // rather than held until the step timeout.
  // Not when `rank` had already arrived in the step's attempt (a repeat, refused): that
  // attempt does not need it again.
  virtual void Refused(const std::string& job, uint64_t step, uint32_t rank, const std::string& why) = 0;
};

}  // namespace ckpt::persist
