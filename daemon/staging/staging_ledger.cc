#include "daemon/staging/staging_ledger.h"

#include <fmt/format.h>

#include <algorithm>

namespace ckpt::daemon {

absl::StatusOr<StagingLedger::HoldPtr> StagingLedger::Admit(const std::string& job, size_t bytes) {
  size_t jobs = std::max<size_t>(1, active_jobs_());
  size_t share = capacity_ / jobs;
  std::lock_guard lock(mu_);
  size_t& mine = in_flight_[job];
  if (jobs > 1 && mine > 0 && mine + bytes > share) {
    return absl::ResourceExhaustedError(fmt::format(
        "job {} already has {} bytes of snapshots in flight; its fair share of the staging "
        "memory is {} bytes ({} jobs share --staging-bytes {})",
        job, mine, share, jobs, capacity_));
  }
  mine += bytes;
  return std::make_unique<Hold>(*this, job, bytes);
}

size_t StagingLedger::in_flight(const std::string& job) const {
  std::lock_guard lock(mu_);
  auto it = in_flight_.find(job);
  return it == in_flight_.end() ? 0 : it->second;
}

void StagingLedger::Release(const std::string& job, size_t bytes) {
  std::lock_guard lock(mu_);
  auto it = in_flight_.find(job);
  if (it == in_flight_.end()) return;
  it->second -= std::min(it->second, bytes);
  if (it->second == 0) in_flight_.erase(it);
}

}  // namespace ckpt::daemon
