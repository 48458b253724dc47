#include "daemon/staging/staging_ledger.h"

#include <fmt/format.h>

#include <algorithm>

namespace ckpt::daemon {
namespace {

void Subtract(size_t& from, size_t bytes) { from -= std::min(from, bytes); }

}  // namespace

absl::StatusOr<StagingLedger::HoldPtr> StagingLedger::Admit(uid_t uid, const std::string& job,
                                                            size_t bytes) {
  ActiveUsers active = active_();
  active[uid].insert(job);  // the caller is active, whatever the snapshot of sessions says
  const size_t users = active.size();
  const size_t jobs_of_user = active[uid].size();
  const size_t user_share = capacity_ / users;
  const size_t job_share = user_share / jobs_of_user;
  std::lock_guard lock(mu_);
  size_t& user = of_user_[uid];
  size_t& mine = of_job_[job];
  if (users > 1 && user > 0 && user + bytes > user_share) {
    return absl::ResourceExhaustedError(fmt::format(
        "uid {} already has {} bytes of snapshots in flight (job {}: {}); a user's fair share "
        "of {} is {} bytes ({} users share {} {})",
        uid, user, job, mine, memory_, user_share, users, flag_, capacity_));
  }
  if (jobs_of_user > 1 && mine > 0 && mine + bytes > job_share) {
    return absl::ResourceExhaustedError(fmt::format(
        "job {} already has {} bytes of snapshots in flight; its fair share of {} is {} bytes "
        "({} jobs of uid {} share {} bytes of {} {})",
        job, mine, memory_, job_share, jobs_of_user, uid, user_share, flag_, capacity_));
  }
  user += bytes;
  mine += bytes;
  return std::make_unique<Hold>(*this, uid, job, bytes);
}

size_t StagingLedger::in_flight(const std::string& job) const {
  std::lock_guard lock(mu_);
  auto it = of_job_.find(job);
  return it == of_job_.end() ? 0 : it->second;
}

size_t StagingLedger::in_flight_of_user(uid_t uid) const {
  std::lock_guard lock(mu_);
  auto it = of_user_.find(uid);
  return it == of_user_.end() ? 0 : it->second;
}

void StagingLedger::Release(uid_t uid, const std::string& job, size_t bytes) {
  std::lock_guard lock(mu_);
  if (auto it = of_job_.find(job); it != of_job_.end()) {
    Subtract(it->second, bytes);
    if (it->second == 0) of_job_.erase(it);
  }
  if (auto it = of_user_.find(uid); it != of_user_.end()) {
    Subtract(it->second, bytes);
    if (it->second == 0) of_user_.erase(it);
  }
}

std::map<std::string, size_t> StagingLedger::InFlightByJob() const {
  std::lock_guard lock(mu_);
  return of_job_;
}

std::map<uid_t, size_t> StagingLedger::InFlightByUser() const {
  std::lock_guard lock(mu_);
  return of_user_;
}

}  // namespace ckpt::daemon
