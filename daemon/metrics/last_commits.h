// Each job's last committed step and when it committed, for the per-job gauges (a stalled
// job shows as an age that grows). Bounded: past kMaxJobs the job that committed longest
// ago is forgotten, so a trainer that makes up job names cannot grow it.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace ckpt::metrics {

class LastCommits {
 public:
  static constexpr size_t kMaxJobs = 1024;
  struct Commit {
    std::string job;
    uint64_t step = 0;
    std::chrono::system_clock::time_point at;
  };

  void Record(const std::string& job, uint64_t step, std::chrono::system_clock::time_point at);
  // The `n` most recent, newest first; `total` is how many jobs are remembered.
  std::vector<Commit> Newest(size_t n, size_t* total = nullptr) const;

 private:
  mutable std::mutex mu_;
  std::map<std::string, Commit> by_job_;
};

}  // namespace ckpt::metrics
