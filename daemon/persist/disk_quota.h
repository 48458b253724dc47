// Per-user and per-job bounds on the bytes of checkpoints a root holds (--user-quota-bytes,
// --job-quota-bytes), so that one user's jobs cannot fill a root that others' jobs need.
// Checked before each shard is written: a write that would take its job, or the jobs its
// owner has on the root, over a bound is refused with a message naming the bound, and its
// step fails like one that met a full disk (nothing committed is touched; the job's older
// steps stay). Retention stays per job (--keep-last): one user's steps never push out
// another's.
//
// What the root holds is what its files say: each job's directory is measured (file
// sizes, every step and unfinished step in it) at most every kRescan, and the bytes
// written meanwhile are added; a refusal is made only on a measurement at most
// kRecheck old, so steps deleted meanwhile (retention, `ckptctl delete`, an operator) are
// never held against a user. Shards being written count in full until they end.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "storage/filesystem.h"

namespace ckpt::persist {

class DiskQuota {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr Clock::duration kRescan = std::chrono::seconds(30);
  static constexpr Clock::duration kRecheck = std::chrono::seconds(1);

  struct Limits {
    uint64_t per_user = 0;  // bytes of all the jobs one uid owns on the root; 0: no bound
    uint64_t per_job = 0;   // bytes of one job; 0: no bound
  };
  // The uid that owns a job on record (nullopt: none yet; its bytes count for the job only).
  using OwnerOf = std::function<std::optional<uint32_t>(const std::string& job)>;

  DiskQuota(Filesystem& fs, std::string root, Limits limits, OwnerOf owner_of,
            std::function<Clock::time_point()> now = Clock::now);

  bool enabled() const { return limits_.per_user != 0 || limits_.per_job != 0; }

  // Before `bytes` of `job` are written (rank `rank` of step `step`, for the message): OK,
  // and the bytes count until Finished; or ResourceExhausted naming the bound it would pass.
  absl::Status Reserve(const std::string& job, uint64_t step, uint32_t rank, uint64_t bytes);
  // A write Reserve admitted ended: `written` bytes are on the root now (0: it failed).
  void Finished(const std::string& job, uint64_t reserved, uint64_t written);

  // What the root holds for `job` and for the jobs of its owner, as last measured plus
  // what was written and is being written since.
  struct Usage {
    uint64_t job = 0;
    uint64_t user = 0;
    std::optional<uint32_t> owner;
  };
  Usage UsageOf(const std::string& job);

 private:
  struct Job {
    uint64_t on_root = 0;    // measured, plus written since
    uint64_t reserved = 0;   // being written
    std::optional<uint32_t> owner;
  };
  // Measures every job on the root when the last measurement is older than `max_age`.
  void Measure(Clock::duration max_age);
  // Bytes of the files under `dir` and its subdirectories (a job: steps, then shards).
  uint64_t BytesUnder(const std::string& dir, int depth);
  Usage UsageLocked(const std::string& job) const;
  // Why writing `bytes` more for `job` would pass a bound; empty when it would not.
  std::string OverLocked(const std::string& job, uint64_t step, uint32_t rank, uint64_t bytes) const;

  Filesystem& fs_;
  const std::string root_;
  const Limits limits_;
  const OwnerOf owner_of_;
  const std::function<Clock::time_point()> now_;
  std::mutex measure_mu_;  // one measurement at a time, outside mu_
  mutable std::mutex mu_;
  std::map<std::string, Job> jobs_;
  std::optional<Clock::time_point> measured_;
};

}  // namespace ckpt::persist
