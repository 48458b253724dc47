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

bool RetentionKeeper::BeginRemoval(const std::string& job, uint64_t step) {
  std::lock_guard lock(mu_);
  if (pins_.count({job, step})) return false;
  removing_.insert({job, step});
  return true;
}

void RetentionKeeper::EndRemoval(const std::string& job, uint64_t step) {
  std::lock_guard lock(mu_);
  removing_.erase({job, step});
  cv_.notify_all();
}

absl::StatusOr<std::string> RetentionKeeper::Remove(const std::string& job, const format::StepRun& step,
                                                    const References& references) {
  // Pinned since the pass began (an upload now needs it): kept.
  if (!BeginRemoval(job, step.step)) {
    return absl::FailedPreconditionError(fmt::format("step {} of job {} is in use", step.step, job));
  }
  struct End {
    RetentionKeeper* keeper;
    const std::string& job;
    uint64_t step;
    ~End() { keeper->EndRemoval(job, step); }
  } end{this, job, step.step};
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
  std::set<uint64_t> pinned;  // a pinned step number holds a held step of it too (an upload's origins)
  {
    std::lock_guard lock(mu_);
    for (const auto& [pjob, pstep] : pins_) {
      if (pjob == job) pinned.insert(pstep);
    }
  }
  auto& log = log::Get(log::Component::kPersist);
  for (const format::StepRun& h : *held) {
    if (references.Hold(h) || pinned.count(h.step) || !BeginRemoval(job, h.step)) continue;
    absl::Status s = store_.RemoveHeld(job, h);
    EndRemoval(job, h.step);
    if (s.ok()) {
      log.info("[{} s{}] removed: no kept step references it any more (was {})", job, h.step,
               format::HeldStepDirName(h.step, h.run));
    } else if (absl::IsFailedPrecondition(s)) {
      log.debug("[{} s{}] held step kept: {}", job, h.step, Message(s));
    } else {
      log.warn("[{} s{}] could not remove the retired step: {}", job, h.step, Message(s));
      on_error_(fmt::format("[{} s{}] retention: {}", job, h.step, Message(s)));
    }
  }
}

absl::StatusOr<std::shared_ptr<void>> RetentionKeeper::HoldSteps(const std::string& job,
                                                                 const std::vector<format::StepRun>& steps) {
  auto pins = std::make_shared<std::vector<std::unique_ptr<Pin>>>();
  for (const format::StepRun& s : steps) pins->push_back(std::make_unique<Pin>(*this, job, s.step));
  // Pinned first, then looked for: from here on retention neither deletes, retires nor
  // sweeps them.
  CKPT_ASSIGN_OR_RETURN(auto runs, store_.ListRunsAndSteps(job));
  std::set<format::StepRun> there;
  for (const auto& [run, step] : runs) there.insert({step, run});
  absl::StatusOr<std::vector<format::StepRun>> held = store_.ListHeld(job);
  if (held.ok()) {
    there.insert(held->begin(), held->end());
  } else if (!absl::IsUnimplemented(held.status())) {
    return held.status();
  }
  for (const format::StepRun& s : steps) {
    if (!there.count(s)) {
      return absl::FailedPreconditionError(fmt::format(
          "step {} of job {} (run {}), whose files it references, is no longer on the store (retention or a delete "
          "removed it while the step was written); the next save of its ranks is full",
          s.step, job, s.run));
    }
  }
  return std::shared_ptr<void>(pins, pins.get());
}

RetentionKeeper::Pin::Pin(RetentionKeeper& owner, std::string job, uint64_t step)
    : owner_(owner), key_(std::move(job), step) {
  std::lock_guard lock(owner_.mu_);
  owner_.pins_.insert(key_);
}

std::unique_ptr<RetentionKeeper::Pin> RetentionKeeper::Pin::AfterRemoval(RetentionKeeper& owner, std::string job,
                                                                         uint64_t step) {
  std::unique_lock lock(owner.mu_);
  owner.cv_.wait(lock, [&] { return owner.removing_.count({job, step}) == 0; });
  // Pinned under the same lock: no removal of it begins from here.
  owner.pins_.insert({job, step});
  return std::unique_ptr<Pin>(new Pin(owner, {std::move(job), step}));
}

RetentionKeeper::Pin::Pin(RetentionKeeper& owner, std::pair<std::string, uint64_t> pinned)
    : owner_(owner), key_(std::move(pinned)) {}

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

void RetentionKeeper::ScheduleSweep(const std::string& job) {
  std::lock_guard lock(mu_);
  if (stopping_) return;
  sweeps_due_.push_back(job);
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
    bool sweep_only = false;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [this] { return stopping_ || !due_.empty() || !sweeps_due_.empty(); });
      if (due_.empty() && sweeps_due_.empty()) return;  // stopping, nothing left
      sweep_only = due_.empty();
      std::deque<std::string>& from = sweep_only ? sweeps_due_ : due_;
      job = std::move(from.front());
      from.pop_front();
    }
    if (!sweep_only) {
      Apply(job);
      continue;
    }
    if (auto runs = store_.ListRunsAndSteps(job); runs.ok()) Sweep(job, Referenced(job, *runs, {}));
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
  // Newest first (doomed is in run order): a step references only steps committed before it,
  // so a pass that ckptd dies in never leaves a listed step whose origin it deleted; every
  // step still listed then is older than every one removed.
  for (auto it = doomed.rbegin(); it != doomed.rend(); ++it) {
    const uint64_t step = *it;
    absl::StatusOr<std::string> done = Remove(job, {step, run_of.at(step)}, references);
    if (done.ok()) {
      ephemeral_[job].erase(step);
      log.info("[{} s{}] {} by retention{}{}", job, step, done->empty() ? "deleted" : "retired",
               std::find(ephemeral.begin(), ephemeral.end(), step) != ephemeral.end()
                   ? " (ephemeral, a newer step committed)"
                   : "",
               done->empty() ? "" : ": " + *done);
    } else if (absl::IsFailedPrecondition(done.status())) {
      log.info("[{} s{}] kept: pinned since this pass began", job, step);
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
