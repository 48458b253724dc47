#include "daemon/persist/retention_keeper.h"

#include <algorithm>

#include <fmt/format.h>

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <vector>

#include "common/log.h"
#include "common/status.h"

namespace ckpt::persist {
namespace {

void LowerPriority() {
  ::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), 19);
  constexpr int kIoprioClassIdle = 3, kIoprioClassShift = 13;
  ::syscall(SYS_ioprio_set, 1 /* IOPRIO_WHO_PROCESS */, ::gettid(),
            kIoprioClassIdle << kIoprioClassShift);
}

}  // namespace

absl::Status RetentionKeeper::DeleteStep(const std::string& job, uint64_t step) {
  {
    std::lock_guard lock(mu_);
    if (pins_.count({job, step})) {
      return absl::FailedPreconditionError(fmt::format(
          "step {} of job {} is in use (being restored, verified or uploaded to the remote tier); "
          "delete it once that is done", step, job));
    }
  }
  CKPT_RETURN_IF_ERROR(store_.Delete(job, step));
  on_deleted_(job, step);
  return absl::OkStatus();
}

RetentionKeeper::Pin::Pin(RetentionKeeper& owner, std::string job, uint64_t step)
    : owner_(owner), key_(std::move(job), step) {
  std::lock_guard lock(owner_.mu_);
  owner_.pins_.insert(key_);
}

RetentionKeeper::Pin::~Pin() {
  std::lock_guard lock(owner_.mu_);
  owner_.pins_.erase(owner_.pins_.find(key_));
}

RetentionKeeper::RetentionKeeper(format::CheckpointStore& store, RetentionPolicy policy,
                                 std::function<void(const std::string&, uint64_t)> on_deleted,
                                 std::function<void(const std::string&)> on_error)
    : store_(store), policy_(policy), on_deleted_(std::move(on_deleted)),
      on_error_(std::move(on_error)) {
  thread_ = std::thread([this] { Loop(); });
}

RetentionKeeper::~RetentionKeeper() { Stop(); }

void RetentionKeeper::Stop() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
    cv_.notify_all();
  }
  if (thread_.joinable()) thread_.join();
}

void RetentionKeeper::Schedule(const std::string& job) {
  std::lock_guard lock(mu_);
  if (stopping_) return;
  due_.push_back(job);
  cv_.notify_one();
}

void RetentionKeeper::SetKeepLast(const std::string& job, uint32_t keep_last) {
  std::lock_guard lock(mu_);
  if (keep_last == 0) {
    keep_last_.erase(job);
  } else {
    keep_last_[job] = keep_last;
  }
}

void RetentionKeeper::Loop() {
  LowerPriority();
  while (true) {
    std::string job;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [this] { return stopping_ || !due_.empty(); });
      if (due_.empty()) return;  // stopping, nothing left
      job = std::move(due_.front());
      due_.pop_front();
    }
    Apply(job);
  }
}

std::vector<uint64_t> RetentionKeeper::EphemeralSteps(const std::string& job,
                                                      const std::vector<uint64_t>& steps) {
  std::vector<uint64_t> ephemeral;
  std::map<uint64_t, bool>& known = ephemeral_[job];
  for (size_t i = 0; i + 1 < steps.size(); ++i) {  // the latest is kept whatever it is
    auto it = known.find(steps[i]);
    if (it == known.end()) {
      absl::StatusOr<format::Manifest> manifest =
          store_.LoadManifest(job, steps[i], format::CheckpointStore::Depth::kIndexOnly);  // metadata only
      if (!manifest.ok()) continue;  // unreadable: not ours to judge here, ask again later
      auto flag = manifest->metadata.find(kEphemeralKey);
      it = known.emplace(steps[i], flag != manifest->metadata.end() && flag->second == "1").first;
    }
    if (it->second) ephemeral.push_back(steps[i]);
  }
  return ephemeral;
}

void RetentionKeeper::Apply(const std::string& job) {
  auto steps = store_.ListStepsInRunOrder(job);
  if (!steps.ok()) return;
  std::vector<uint64_t> pinned;
  RetentionPolicy policy = policy_;
  {
    std::lock_guard lock(mu_);
    if (auto it = keep_last_.find(job); it != keep_last_.end()) policy.keep_last = it->second;
    for (const auto& [pjob, pstep] : pins_) {
      if (pjob == job) pinned.push_back(pstep);
    }
  }
  auto& log = log::Get(log::Component::kPersist);
  std::vector<uint64_t> ephemeral = EphemeralSteps(job, *steps);
  for (uint64_t step : StepsToDelete(*steps, policy, pinned, ephemeral)) {
    absl::Status s = store_.Delete(job, step);
    if (s.ok()) {
      ephemeral_[job].erase(step);
      log.info("[{} s{}] deleted by retention{}", job, step,
               std::find(ephemeral.begin(), ephemeral.end(), step) != ephemeral.end()
                   ? " (ephemeral, a newer step committed)"
                   : "");
      on_deleted_(job, step);
    } else {
      log.warn("[{} s{}] retention could not delete: {}", job, step, Message(s));
      on_error_(fmt::format("[{} s{}] retention: {}", job, step, Message(s)));
    }
  }
}

}  // namespace ckpt::persist
