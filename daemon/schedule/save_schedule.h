// When a job saves by time (`interval_seconds`), every rank must pick the same steps, or a
// step is saved by some ranks only and never completes. Each rank's own clock cannot give
// that: ranks reach a step at different moments. So one table decides for the whole job,
// on one clock (the coordinator's in a group, the daemon's on one node): the first rank to
// ask about a step decides it, and every later question about that step gets the same
// answer. A step is a save when `interval` has passed since the last step decided a save
// (or since the run's first question).
//
// Pure logic: the caller passes the time, so tests need no clock.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>

#include "absl/status/statusor.h"

namespace ckpt::daemon {

struct SaveQuestion {
  std::string job;
  // The step this run of the job resumed from (0 on a fresh start). A restarted job repeats
  // steps; its decisions start afresh instead of replaying the previous run's.
  uint64_t run = 0;
  uint64_t step = 0;
  std::chrono::milliseconds interval{0};
};

class SaveSchedule {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;

  struct Options {
    size_t steps_per_run = 4096;  // decisions remembered per run; ranks are never this far apart
    size_t runs = 4096;           // (job, run) pairs remembered, least recently asked forgotten
  };

  SaveSchedule() : SaveSchedule(Options{}) {}
  explicit SaveSchedule(Options options) : options_(options) {}

  // True when the job saves at `q.step`. InvalidArgument when the interval is not positive or
  // differs from the one the run's first question gave (ranks configured differently);
  // FailedPrecondition for a step older than every decision still remembered.
  absl::StatusOr<bool> Decide(const SaveQuestion& q, TimePoint now);

 private:
  struct Run {
    std::chrono::milliseconds interval{0};
    TimePoint since;                   // the last save decided, or the run's first question
    std::map<uint64_t, bool> decided;  // by step, at most steps_per_run
    uint64_t last_asked = 0;           // a counter, for forgetting the least recently asked
  };

  const Options options_;
  std::mutex mu_;
  std::map<std::pair<std::string, uint64_t>, Run> runs_;
  uint64_t asked_ = 0;
};

}  // namespace ckpt::daemon
