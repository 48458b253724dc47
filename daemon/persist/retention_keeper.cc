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

absl::StatusOr<std::string> RetentionKeeper::DeleteStep(const std::string& job, uint64_t step) {
  {
    std::lock_guard lock(mu_);
    if (pins_.count({job, step})) {
      return absl::FailedPreconditionError(fmt::format(
          "step {} of job {} is in use (being restored, verified or uploaded to the remote tier); "
          "delete it once that is done", step, job));
    }
  }
  CKPT_ASSIGN_OR_RETURN(auto runs, store_.ListRunsAndSteps(job));
  auto it = std::find_if(runs.begin(), runs.end(), [&](const auto& run_step) { return run_step.second == step; });
  if (it == runs.end()) {
    return absl::NotFoundError(fmt::format("job {} has no committed checkpoint at step {}", job, step));
  }
  const References references = Referenced(job, runs, {step});
  CKPT_ASSIGN_OR_RETURN(std::string done, Remove(job, {step, it->first}, references));
  Sweep(job, references);
  return done;
}

RetentionKeeper::References RetentionKeeper::Referenced(const std::string& job,
                                                        const std::vector<std::pair<uint64_t, uint64_t>>& runs,
                                                        const std::set<uint64_t>& leaving) {
  References references;
  for (const auto& [run, step] : runs) {
    if (leaving.count(step)) continue;
    absl::StatusOr<std::vector<format::StepRun>> origins = store_.OriginSteps(job, step);
    if (!origins.ok()) {
      references.complete = false;
      continue;
    }
    references.steps.insert(origins->begin(), origins->end());
  }
  return references;
}

absl::StatusOr<std::string> RetentionKeeper::Remove(const std::string& job, const format::StepRun& step,
                                                    const References& references) {
  if (!references.Hold(step)) {
    CKPT_RETURN_IF_ERROR(store_.Delete(job, step.step));
    on_deleted_(job, step.step);
    return std::string();
  }
  CKPT_RETURN_IF_ERROR(store_.Retire(job, step.step, step.run));
  on_deleted_(job, step.step);
  return fmt::format("its files stay while later steps reference them (held as {})",
                     format::HeldStepDirName(step.step, step.run));
}

void RetentionKeeper::Sweep(const std::string& job, const References& references) {
  if (!references.complete) return;  // a kept step's manifest could not be read
  absl::StatusOr<std::vector<format::StepRun>> held = store_.ListHeld(job);
  if (!held.ok()) return;
  auto& log = log::Get(log::Component::kPersist);
  for (const format::StepRun& h : *held) {
    if (references.Hold(h)) continue;
    if (absl::Status s = store_.RemoveHeld(job, h); s.ok()) {
      log.info("[{} s{}] removed: no kept step references it any more (was {})", job, h.step,
               format::HeldStepDirName(h.step, h.run));
    } else {
      log.warn("[{} s{}] could not remove the retired step: {}", job, h.step, Message(s));
      on_error_(fmt::format("[{} s{}] retention: {}", job, h.step, Message(s)));
    }
  }
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
  auto runs = store_.ListRunsAndSteps(job);  // in run order
  if (!runs.ok()) return;
  std::vector<uint64_t> steps;
  std::map<uint64_t, uint64_t> run_of;
  for (const auto& [run, step] : *runs) {
    steps.push_back(step);
    run_of[step] = run;
  }
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
  std::vector<uint64_t> ephemeral = EphemeralSteps(job, steps);
  const std::vector<uint64_t> doomed = StepsToDelete(steps, policy, pinned, ephemeral);
  // What the steps that stay reference stays, retired rather than deleted when doomed.
  const References references = Referenced(job, *runs, {doomed.begin(), doomed.end()});
  for (uint64_t step : doomed) {
    absl::StatusOr<std::string> done = Remove(job, {step, run_of.at(step)}, references);
    if (done.ok()) {
      ephemeral_[job].erase(step);
      log.info("[{} s{}] {} by retention{}{}", job, step, done->empty() ? "deleted" : "retired",
               std::find(ephemeral.begin(), ephemeral.end(), step) != ephemeral.end()
                   ? " (ephemeral, a newer step committed)"
                   : "",
               done->empty() ? "" : ": " + *done);
    } else if (absl::IsUnimplemented(done.status())) {
      log.info("[{} s{}] kept: later steps reference it and {}", job, step, Message(done.status()));
    } else {
      log.warn("[{} s{}] retention could not delete: {}", job, step, Message(done.status()));
      on_error_(fmt::format("[{} s{}] retention: {}", job, step, Message(done.status())));
    }
  }
  Sweep(job, references);
}

}  // namespace ckpt::persist
