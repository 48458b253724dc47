// Per-user and per-job bounds on the bytes of checkpoints a root holds (--user-quota-bytes,
// --job-quota-bytes), so that one user's jobs cannot fill a root that others' jobs need.
// Checked before each shard is written: a write that would take its job, or the jobs its
// owner has on the root, over a bound is refused with a message naming the bound, and its
// step fails like one that met a full disk (nothing committed is touched; the job's older
// steps stay). Retention stays per job (--keep-last): one user's steps never push out
// another's.
//
// What the root holds is what its files say. A job is measured (the sizes of the files in
// its directory and its step directories) when a write finds its figure older than
// kRescan, or marked changed: ckptd removed some of it (retention, `ckptctl delete`, an
// aborted step: Changed()). Bytes written meanwhile are added as each write ends, and a
// shard being written counts in full until it ends. A thread of its own walks the whole
// root every kRescan (jobs other daemons write on a shared root, files an operator
// removed): the I/O threads never walk more than the one job they write and the owner's
// jobs marked changed, so no user can make another's writes wait on a walk of the root.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "storage/filesystem.h"

namespace ckpt::persist {

class DiskQuota {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr Clock::duration kRescan = std::chrono::seconds(30);

  struct Limits {
    uint64_t per_user = 0;  // bytes of all the jobs one uid owns on the root; 0: no bound
    uint64_t per_job = 0;   // bytes of one job; 0: no bound
  };
  // The uid that owns a job on record (nullopt: none yet; its bytes count for the job only).
  using OwnerOf = std::function<std::optional<uint32_t>(const std::string& job)>;

  // `walk_root`: whether a thread of its own walks the whole root every kRescan (ckptd:
  // yes; tests drive Measure themselves).
  DiskQuota(Filesystem& fs, std::string root, Limits limits, OwnerOf owner_of, bool walk_root = true,
            std::function<Clock::time_point()> now = Clock::now);
  ~DiskQuota();
  DiskQuota(const DiskQuota&) = delete;
  DiskQuota& operator=(const DiskQuota&) = delete;

  bool enabled() const { return limits_.per_user != 0 || limits_.per_job != 0; }

  // Before `bytes` of `job` are written (rank `rank` of step `step`, for the message): OK,
  // and the bytes count until Finished; or ResourceExhausted naming the bound it would pass.
  absl::Status Reserve(const std::string& job, uint64_t step, uint32_t rank, uint64_t bytes);
  // A write Reserve admitted ended: `written` bytes are on the root now (0: it failed).
  void Finished(const std::string& job, uint64_t reserved, uint64_t written);
  // ckptd removed some of `job`'s files: it is measured again before its figure is used.
  void Changed(const std::string& job);
  // Walks the whole root now (the walking thread's work).
  void MeasureRoot();

  // What the root holds for `job` and for the jobs of its owner, as last measured plus
  // what was written and is being written since.
  struct Usage {
    uint64_t job = 0;
    uint64_t user = 0;
    std::optional<uint32_t> owner;
  };
  Usage UsageOf(const std::string& job);
  // Every owner's bytes on the root as last measured plus what was written and is being
  // written since (no walk: what a scrape reads), by uid; jobs with no owner on record are
  // left out.
  std::map<uint32_t, uint64_t> UsageByUser() const;
  const Limits& limits() const { return limits_; }

 private:
  struct Job {
    uint64_t on_root = 0;    // measured, plus written since
    uint64_t reserved = 0;   // being written
    std::optional<uint32_t> owner;
    std::optional<Clock::time_point> measured;  // never: to be measured before use
    bool changed = false;    // ckptd removed some of it since it was measured
    // Bytes written while a walk of the job ran (the walk may have seen them or not: they
    // count once more rather than not at all).
    uint64_t written_during_walk = 0;
    int walks = 0;           // walks of the job running
  };
  // Bytes of the files under `dir` and its subdirectories, `depth` levels down.
  uint64_t BytesUnder(const std::string& dir, int depth);
  // Measures `job` (outside mu_) and records what it found.
  void MeasureJob(const std::string& job);
  // Measures `job` when its figure is missing, stale or changed, and every job of its owner
  // marked changed.
  void Refresh(const std::string& job);
  Usage UsageLocked(const std::string& job) const;
  // Why writing `bytes` more for `job` would pass a bound; empty when it would not.
  std::string OverLocked(const std::string& job, uint64_t step, uint32_t rank, uint64_t bytes) const;
  void WalkLoop();

  Filesystem& fs_;
  const std::string root_;
  const Limits limits_;
  const OwnerOf owner_of_;
  const std::function<Clock::time_point()> now_;
  mutable std::mutex mu_;
  std::map<std::string, Job> jobs_;
  std::condition_variable stop_cv_;
  bool stopping_ = false;
  std::thread walker_;  // last: started once everything above exists
};

}  // namespace ckpt::persist
