// The newest committed snapshot of each (job, rank), kept in staging memory for hot
// restore until the stager needs the memory back (oldest first) or the step is deleted.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "daemon/staging/progress_signal.h"
#include "daemon/staging/staged_snapshot.h"

namespace ckpt::daemon {

class HotCache {
 public:
  explicit HotCache(ProgressSignal& progress) : progress_(progress) {}

  // Keeps each snapshot unless a newer step of its (job, rank) is already held.
  void Insert(const std::vector<StagedSnapshotPtr>& committed);
  // The snapshot of (job, rank) at `step`, if it is still in memory, once every byte of it
  // has landed.
  StagedSnapshotPtr Find(const std::string& job, uint32_t rank, uint64_t step) const;
  // Drops the oldest snapshot; false when there is none. Its block returns to the pool
  // when the last reader (a restore in progress) lets go.
  bool EvictOne();
  // Drops every rank's copy of (job, step): the step was deleted.
  void Drop(const std::string& job, uint64_t step);
  // Steps of `job` held, ascending, deduplicated; every job when `job` is empty.
  std::map<std::string, std::vector<uint64_t>> Steps() const;
  void Clear();

 private:
  ProgressSignal& progress_;
  mutable std::mutex mu_;
  std::map<std::pair<std::string, uint32_t>, StagedSnapshotPtr> hot_;
};

}  // namespace ckpt::daemon
