// When a job saves by time (`interval_seconds`), every rank must pick the same steps, or a
// step is saved by some ranks only and never completes. Each rank's own clock cannot give
// that: ranks reach a step at different moments. So one table decides for the whole job,
// on one clock (the coordinator's in a group, the daemon's on one node): the first rank to
// ask about a step decides it, and every later question about that step gets the same
// answer. A step is a save when `interval` has passed since the last step decided a save
// (or since the run's first question).
//
// Ranks ask about the steps of a run in increasing order (every step, or the same subset
// on every rank), so a run needs only the newest step decided and its latest saves: a step
// at or below the newest decided one is a save exactly when it is among them.
//
// Pure logic: the caller passes the time, so tests need no clock.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <tuple>

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
    size_t saves_per_run = 64;   // saves remembered per run; ranks are never this far apart
    size_t runs = 65536;         // in all (a run costs about saves_per_run x 40 bytes)
    size_t runs_per_job = 8;     // a job's least recently asked run goes first
    // A run idle this long may be forgotten to make room; a table full of busier runs
    // refuses new ones instead of breaking a running job's decisions.
    std::chrono::milliseconds idle{std::chrono::hours(1)};
    // Questions about one run with two intervals this close together come from ranks
    // configured differently (an error); further apart, from a job restarted with a new
    // interval (a clock of its own).
    std::chrono::milliseconds mismatch_window{std::chrono::seconds(5)};
  };

  SaveSchedule() : SaveSchedule(Options{}) {}
  explicit SaveSchedule(Options options) : options_(options) {}

  // True when the job saves at `q.step`. InvalidArgument when the interval is not positive
  // or another rank of the run asked with another interval moments ago; FailedPrecondition
  // for a step older than every save still remembered; ResourceExhausted when the table is
  // full of runs asked within `idle`.
  absl::StatusOr<bool> Decide(const SaveQuestion& q, TimePoint now);

 private:
  struct Run {
    TimePoint since;             // the last save decided, or the run's first question
    TimePoint last_asked;
    bool any = false;            // a step was decided
    uint64_t newest = 0;         // the newest step decided
    uint64_t known_from = 0;     // steps below this are older than what is remembered
    std::set<uint64_t> saves;    // the latest saves decided, at most saves_per_run
  };
  using Key = std::tuple<std::string, uint64_t, int64_t>;  // job, run, interval in ms

  absl::StatusOr<Run*> FindOrAdd(const SaveQuestion& q, TimePoint now);
  bool Forget(TimePoint now, const std::string& job);

  const Options options_;
  std::mutex mu_;
  std::map<Key, Run> runs_;
};

}  // namespace ckpt::daemon
