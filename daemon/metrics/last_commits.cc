#include "daemon/metrics/last_commits.h"

#include <algorithm>

namespace ckpt::metrics {

void LastCommits::Record(const std::string& job, uint64_t step, std::chrono::system_clock::time_point at) {
  std::lock_guard lock(mu_);
  by_job_[job] = {job, step, at};
  if (by_job_.size() <= kMaxJobs) return;
  auto oldest = std::min_element(by_job_.begin(), by_job_.end(),
                                 [](const auto& a, const auto& b) { return a.second.at < b.second.at; });
  by_job_.erase(oldest);
}

std::vector<LastCommits::Commit> LastCommits::Newest(size_t n, size_t* total) const {
  std::vector<Commit> all;
  {
    std::lock_guard lock(mu_);
    for (const auto& [job, c] : by_job_) all.push_back(c);
  }
  if (total != nullptr) *total = all.size();
  std::sort(all.begin(), all.end(), [](const Commit& a, const Commit& b) { return a.at > b.at; });
  if (all.size() > n) all.resize(n);
  return all;
}

}  // namespace ckpt::metrics
