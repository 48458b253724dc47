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
  auto key = std::make_pair(q.job, q.run);
  auto it = runs_.find(key);
  if (it == runs_.end()) {
    if (runs_.size() >= options_.runs) {
      auto oldest = std::min_element(runs_.begin(), runs_.end(), [](const auto& a, const auto& b) {
        return a.second.last_asked < b.second.last_asked;
      });
      runs_.erase(oldest);
    }
    it = runs_.emplace(key, Run{q.interval, now, {}, 0}).first;
  }
  Run& run = it->second;
  run.last_asked = ++asked_;
  if (run.interval != q.interval) {
    return absl::InvalidArgumentError(fmt::format(
        "job {}: this rank saves every {} ms, another rank of the job every {} ms; every rank "
        "must use the same interval_seconds",
        q.job, q.interval.count(), run.interval.count()));
  }
  if (auto known = run.decided.find(q.step); known != run.decided.end()) return known->second;
  if (run.decided.size() >= options_.steps_per_run) {
    if (q.step < run.decided.begin()->first) {
      return absl::FailedPreconditionError(fmt::format(
          "job {}: step {} is older than the {} steps whose save decisions are remembered "
          "(from step {}); is this rank that far behind the others?",
          q.job, q.step, options_.steps_per_run, run.decided.begin()->first));
    }
    run.decided.erase(run.decided.begin());
  }
  bool save = now - run.since >= run.interval;
  if (save) run.since = now;
  run.decided.emplace(q.step, save);
  return save;
}

}  // namespace ckpt::daemon
