#include "daemon/schedule/save_schedule.h"

#include <fmt/format.h>

#include <algorithm>

namespace ckpt::daemon {

absl::StatusOr<bool> SaveSchedule::Decide(const SaveQuestion& q, TimePoint now) {
  if (q.interval.count() <= 0) {
    return absl::InvalidArgumentError(
        fmt::format("the save interval must be positive, not {} ms", q.interval.count()));
  }
  std::lock_guard lock(mu_);
  absl::StatusOr<Run*> found = FindOrAdd(q, now);
  if (!found.ok()) return found.status();
  Run& run = **found;
  run.last_asked = now;
  if (run.any && q.step <= run.newest) {
    if (q.step < run.known_from) {
      return absl::FailedPreconditionError(fmt::format(
          "job {}: step {} is older than the save decisions remembered (from step {}); is "
          "this rank that far behind the others?",
          q.job, q.step, run.known_from));
    }
    return run.saves.count(q.step) > 0;
  }
  run.any = true;
  run.newest = q.step;
  if (now - run.since < q.interval) return false;
  run.since = now;
  run.saves.insert(q.step);
  if (run.saves.size() > options_.saves_per_run) {
    run.known_from = *run.saves.begin() + 1;
    run.saves.erase(run.saves.begin());
  }
  return true;
}

absl::StatusOr<SaveSchedule::Run*> SaveSchedule::FindOrAdd(const SaveQuestion& q, TimePoint now) {
  const int64_t interval = q.interval.count();
  if (auto it = runs_.find(Key{q.job, q.run, interval}); it != runs_.end()) return &it->second;
  // The same run asked with another interval moments ago: ranks configured differently,
  // which would save different steps. Long ago: the job restarted with a new interval.
  size_t of_job = 0;
  for (auto it = runs_.lower_bound(Key{q.job, 0, INT64_MIN});
       it != runs_.end() && std::get<0>(it->first) == q.job; ++it) {
    ++of_job;
    if (std::get<1>(it->first) == q.run && now - it->second.last_asked < options_.mismatch_window) {
      return absl::InvalidArgumentError(fmt::format(
          "job {}: this rank saves every {} ms, another rank of the job every {} ms; every rank "
          "must use the same interval_seconds",
          q.job, interval, std::get<2>(it->first)));
    }
  }
  if (of_job >= options_.runs_per_job) Forget(TimePoint::max(), q.job);
  if (runs_.size() >= options_.runs && !Forget(now, "")) {
    return absl::ResourceExhaustedError(fmt::format(
        "{} runs of jobs saving by time are in use; job {} cannot start one", runs_.size(), q.job));
  }
  return &runs_.emplace(Key{q.job, q.run, interval}, Run{now, now}).first->second;
}

// Forgets the least recently asked run (of `job`, or of any job when empty) that has been
// idle for options_.idle before `now` (any, when `now` is max); false when none may go.
bool SaveSchedule::Forget(TimePoint now, const std::string& job) {
  auto oldest = runs_.end();
  for (auto it = job.empty() ? runs_.begin() : runs_.lower_bound(Key{job, 0, INT64_MIN});
       it != runs_.end() && (job.empty() || std::get<0>(it->first) == job); ++it) {
    if (oldest == runs_.end() || it->second.last_asked < oldest->second.last_asked) oldest = it;
  }
  if (oldest == runs_.end()) return false;
  if (now != TimePoint::max() && now - oldest->second.last_asked < options_.idle) return false;
  runs_.erase(oldest);
  return true;
}

}  // namespace ckpt::daemon
