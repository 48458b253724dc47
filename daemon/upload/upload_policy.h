// Which committed steps go to the remote tier. A pure function of the step and the steps
// before it, so every node of a group picks the same steps without asking each other.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>

namespace ckpt::daemon::upload {

struct UploadPolicy {
  uint64_t every_steps = 1;              // steps whose number is a multiple of N
  std::chrono::milliseconds interval{0};  // and of those, the first of each window; 0: all
  bool operator==(const UploadPolicy&) const = default;
};

// "every step", "every 10 steps, the first of each 60000 ms": for messages.
std::string Describe(const UploadPolicy& policy);

// Whether committed `step`, saved at `unix_time` (the manifest's), is uploaded.
// `previous_unix_time` is that of the job's previous step that passed `every_steps`
// (nullopt: none seen since ckptd started, and then the step is uploaded). Windows are
// aligned to the epoch, so nodes agree whichever step each saw first.
bool ShouldUpload(const UploadPolicy& policy, uint64_t step, double unix_time,
                  std::optional<double> previous_unix_time);

// The step passes `every_steps` (and is then what `previous_unix_time` follows).
inline bool OnStepGrid(const UploadPolicy& policy, uint64_t step) {
  return policy.every_steps <= 1 || step % policy.every_steps == 0;
}

// Each job's policy: what its trainers asked for when they registered (the trainer
// service sets it), the node's --upload-every-steps / --upload-interval otherwise.
class UploadPolicies {
 public:
  explicit UploadPolicies(UploadPolicy node_default) : default_(node_default) {}
  void Set(const std::string& job, UploadPolicy policy) {
    std::lock_guard lock(mu_);
    jobs_[job] = policy;
  }
  const UploadPolicy& node_default() const { return default_; }
  UploadPolicy For(const std::string& job) const {
    std::lock_guard lock(mu_);
    auto it = jobs_.find(job);
    return it == jobs_.end() ? default_ : it->second;
  }

 private:
  const UploadPolicy default_;
  mutable std::mutex mu_;
  std::map<std::string, UploadPolicy> jobs_;  // guarded by mu_
};

}  // namespace ckpt::daemon::upload
