// Applies retention after commits, on a thread of its own at idle CPU and I/O priority
// (deleting gigabytes must never compete with the next snapshot's copy). Holds per-job
// --keep-last overrides and pins: a step being read (restore, verify) is never deleted.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "format/checkpoint_store.h"
#include "daemon/persist/retention.h"

namespace ckpt::persist {

class RetentionKeeper {
 public:
  // `on_deleted` runs after each deletion (the hot cache drops that step); `on_error` gets
  // a message for the operator.
  RetentionKeeper(format::CheckpointStore& store, RetentionPolicy policy,
                  std::function<void(const std::string&, uint64_t)> on_deleted,
                  std::function<void(const std::string&)> on_error);
  ~RetentionKeeper();  // finishes what is scheduled
  RetentionKeeper(const RetentionKeeper&) = delete;
  RetentionKeeper& operator=(const RetentionKeeper&) = delete;

  // A step of `job` was committed: retention is due.
  void Schedule(const std::string& job);
  // Removes the retired steps of `job` that no committed step references any more, and
  // nothing else (a start: a crash may have left one whose last referrer went).
  void ScheduleSweep(const std::string& job);
  // Overrides --keep-last for `job`; 0 restores the daemon's setting.
  void SetKeepLast(const std::string& job, uint32_t keep_last);

  // Deletes a committed step on an operator's word, unless it is pinned (being restored):
  // FailedPrecondition then. Its in-memory copy goes too (the on_deleted callback). A step
  // that kept steps reference (format version 5) is retired instead: out of the listing,
  // its files kept while they are referenced; the answer then says so (else it is empty).
  absl::StatusOr<std::string> DeleteStep(const std::string& job, uint64_t step);

  // Keeps `step` of `job` from being deleted or retired while it lives, and a held step of
  // that number from being swept.
  class Pin {
   public:
    Pin(RetentionKeeper& owner, std::string job, uint64_t step);
    // The same, once no removal of that step is under way: what the pin holder then finds on
    // the store stays there (an upload's origins: found there, or carried).
    static std::unique_ptr<Pin> AfterRemoval(RetentionKeeper& owner, std::string job, uint64_t step);
    ~Pin();
    Pin(const Pin&) = delete;
    Pin& operator=(const Pin&) = delete;

   private:
    Pin(RetentionKeeper& owner, std::pair<std::string, uint64_t> pinned);  // pins_ holds it already
    RetentionKeeper& owner_;
    std::pair<std::string, uint64_t> key_;
  };

  // Pins each of `steps` of `job` and checks that it is still on the store, committed or
  // held (retired): what a step about to be published references (a group's coordinator on
  // a shared root, docs/design/incremental.md section 6). The pins live as long as the
  // result; FailedPrecondition naming the first step gone.
  absl::StatusOr<std::shared_ptr<void>> HoldSteps(const std::string& job, const std::vector<format::StepRun>& steps);

  void Stop();

 private:
  void Loop();
  void Apply(const std::string& job);
  // The steps whose files some kept steps reference (docs/format.md, "Retention of
  // referenced steps"): nothing stored, computed each time from the manifests' origin_steps,
  // so no count can drift or need repair after a crash. Incomplete when a kept step's
  // manifest could not be read: then any step may be referenced, and every one is held.
  struct References {
    std::set<format::StepRun> steps;
    bool complete = true;
    bool Hold(const format::StepRun& step) const { return !complete || steps.count(step) != 0; }
  };
  // What the committed steps of `job` (`runs`: (run, step), as ListRunsAndSteps gives them)
  // other than `leaving` reference.
  References Referenced(const std::string& job, const std::vector<std::pair<uint64_t, uint64_t>>& runs,
                        const std::set<uint64_t>& leaving);
  // Deletes `step`, or retires it when `references` hold it; what happened, for the log.
  absl::StatusOr<std::string> Remove(const std::string& job, const format::StepRun& step,
                                     const References& references);
  // Removes the retired steps of `job` that `references` no longer hold.
  void Sweep(const std::string& job, const References& references);
  // The steps of `job` (but the latest) saved ephemeral, from their manifests; each
  // manifest is read once (the answer is kept: a committed step does not change).
  std::vector<uint64_t> EphemeralSteps(const std::string& job, const std::vector<uint64_t>& steps);

  format::CheckpointStore& store_;
  const RetentionPolicy policy_;
  std::function<void(const std::string&, uint64_t)> on_deleted_;
  std::function<void(const std::string&)> on_error_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::deque<std::string> due_;
  std::deque<std::string> sweeps_due_;  // ScheduleSweep's
  std::map<std::string, uint32_t> keep_last_;
  std::multiset<std::pair<std::string, uint64_t>> pins_;
  // Steps being deleted, retired or swept now (their pins checked first): Pin::AfterRemoval
  // waits for them.
  std::set<std::pair<std::string, uint64_t>> removing_;
  // Marks `step` as being removed; false when it is pinned (then it is not).
  bool BeginRemoval(const std::string& job, uint64_t step);
  void EndRemoval(const std::string& job, uint64_t step);
  // job -> step -> saved ephemeral; used by the keeper's thread only
  std::map<std::string, std::map<uint64_t, bool>> ephemeral_;
  std::thread thread_;
};

}  // namespace ckpt::persist
