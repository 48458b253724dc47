// Every rank of a job restores the same step: restoring ranks meet at a barrier (on this
// node, or across nodes through the coordinator), each bringing the steps it can restore,
// and all take the latest step (in run order) that every rank has. One interface: a local implementation
// (single node) and one over the group's all-gather.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace ckpt::group {
class GroupClient;
class GatherTable;
}  // namespace ckpt::group

namespace ckpt::daemon {

// One outcome of restoring a step, and the ranks that had it: the first and how many.
struct SharedOutcome {
  std::string outcome;
  uint32_t rank = 0;
  uint32_t ranks = 0;
};

class StepAgreement {
 public:
  virtual ~StepAgreement() = default;
  // Blocks until all `world_size` ranks of `job` have arrived or `timeout`. `available` are
  // the committed steps this rank can restore, in run order (oldest first). Returns the
  // chosen step, or nullopt when no rank has any step (a fresh start).
  virtual absl::StatusOr<std::optional<uint64_t>> Agree(const std::string& job, uint32_t rank,
                                                        uint32_t world_size,
                                                        const std::vector<uint64_t>& available,
                                                        std::chrono::milliseconds timeout) = 0;
  // After every rank has tried the agreed `step`: each rank brings its outcome (empty when
  // it restored; see restorer.cc for the rest) and gets every distinct outcome, with the
  // first rank that had it, so that all ranks take the same next move (done, fall back to
  // an older step, or fail). Distinct, not by rank: at 80,000 ranks, every rank hearing
  // every rank's would cost the coordinator O(ranks²) bytes.
  virtual absl::StatusOr<std::vector<SharedOutcome>> ShareOutcomes(
      const std::string& job, uint32_t rank, uint32_t world_size, uint64_t step,
      std::string outcome, std::chrono::milliseconds timeout) = 0;
  // Ends every Agree that waits, and every later one, with `why` (shutdown: a restore
  // that waits for ranks that never come must not hold the daemon up).
  virtual void Cancel(const std::string& why) = 0;
};

using StepAgreementPtr = std::unique_ptr<StepAgreement>;

StepAgreementPtr MakeLocalStepAgreement();
StepAgreementPtr MakeGroupStepAgreement(group::GroupClient& client);

// The choice itself, from the ranks' lists (each in run order), each distinct list once
// with the first rank that brought it, rank 0's first: the latest step in all of them, by
// rank 0's order. nullopt when every list is empty; FailedPrecondition naming ranks when
// they share none.
absl::StatusOr<std::optional<uint64_t>> ChooseCommonStep(
    const std::string& job, const std::vector<std::pair<uint32_t, std::vector<uint64_t>>>& available);

// Lists travel as text: "12,20,30" (at most the kMaxAdvertised latest).
inline constexpr size_t kMaxAdvertised = 256;
std::string EncodeSteps(const std::vector<uint64_t>& steps);
absl::StatusOr<std::vector<uint64_t>> DecodeSteps(const std::string& text);

}  // namespace ckpt::daemon
