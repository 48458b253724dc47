// Which step of each job the group's publisher (node 0's uploader) is uploading to the
// remote tier. Node 0 sets it and the coordinator hands it out with every heartbeat; the
// other nodes keep what they heard, and upload their part of that step and no other: when
// checkpoints commit faster than they upload, nodes that each picked their own newest step
// could pick different ones every time, and no step would ever be complete in the bucket.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>

namespace ckpt::group {

class UploadTargets {
 public:
  void Set(const std::string& job, uint64_t step) {
    std::lock_guard lock(mu_);
    steps_[job] = step;
  }
  void Replace(std::map<std::string, uint64_t> steps) {
    std::lock_guard lock(mu_);
    steps_ = std::move(steps);
  }
  std::optional<uint64_t> Get(const std::string& job) const {
    std::lock_guard lock(mu_);
    auto it = steps_.find(job);
    if (it == steps_.end()) return std::nullopt;
    return it->second;
  }
  std::map<std::string, uint64_t> All() const {
    std::lock_guard lock(mu_);
    return steps_;
  }

 private:
  mutable std::mutex mu_;
  std::map<std::string, uint64_t> steps_;
};

}  // namespace ckpt::group
