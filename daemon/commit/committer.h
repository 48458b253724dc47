// The commit stage: decides when a step is committed. The write queue tells it about
// each rank's shard (persist::WriteListener); it tells trainers (their tickets), the hot
// cache and retention (CommitHooks) once a step is decided. Two implementations of one
// interface: SingleNodeCommitter (every rank of the job on this node) and GroupCommitter
// (ranks on several nodes; the coordinator decides).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "format/manifest.h"
#include "daemon/persist/write_listener.h"
#include "daemon/staging/staged_snapshot.h"

namespace ckpt::daemon::commit {

struct StepInFlight {
  std::string job;
  uint64_t step = 0;
  uint32_t world_size = 0;
  std::vector<uint32_t> missing_ranks;  // not yet durable on this node or (group) anywhere
  double age_s = 0;
  std::string state;  // "writing", "prepared", "in doubt"
};

// What happens beside the tickets once a step is decided.
struct CommitHooks {
  // The step is committed; `local` are this node's snapshots of it (for the hot cache).
  std::function<void(const format::Manifest&, const std::vector<StagedSnapshotPtr>& local)>
      committed = [](const auto&, const auto&) {};
  // The step failed or was aborted (counted, shown in status).
  std::function<void(const std::string& job, uint64_t step, const std::string& message)> failed =
      [](const auto&, auto, const auto&) {};
  // Staging memory may have been released.
  std::function<void()> progress = [] {};
};

struct CommitOptions {
  // A step still missing ranks this long after its first rank arrived is aborted.
  std::chrono::milliseconds step_timeout{300'000};
};

class Committer : public persist::WriteListener {
 public:
  // Steps arrived but not decided, oldest first.
  virtual std::vector<StepInFlight> InFlight() const = 0;
  // Decides nothing more: undecided steps fail their tickets. Idempotent.
  virtual void Shutdown() = 0;
};

}  // namespace ckpt::daemon::commit
