#include "daemon/restore/step_agreement.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <charconv>
#include <functional>
#include <memory>
#include <set>

#include "common/status.h"
#include "daemon/group/gather_table.h"
#include "daemon/group/group_client.h"

namespace ckpt::daemon {
namespace {

std::string Key(const std::string& job) { return "restore/" + job; }
std::string OutcomeKey(const std::string& job, uint64_t step) {
  return fmt::format("restored/{}/{}", job, step);
}

absl::StatusOr<std::vector<SharedOutcome>> Outcomes(const std::string& job, uint64_t step,
                                                    absl::StatusOr<group::GatherTable::Distinct> gathered) {
  if (!gathered.ok()) {
    return absl::FailedPreconditionError(fmt::format(
        "job {}: waiting for every rank's outcome of restoring step {}: {}", job, step,
        Message(gathered.status())));
  }
  std::vector<SharedOutcome> outcomes;
  for (size_t i = 0; i < gathered->payloads.size(); ++i) {
    outcomes.push_back({std::move(gathered->payloads[i]), gathered->senders[i], gathered->counts[i]});
  }
  return outcomes;
}

absl::StatusOr<std::optional<uint64_t>> Decide(const std::string& job,
                                               absl::StatusOr<group::GatherTable::Distinct> gathered) {
  if (!gathered.ok()) {
    // Not DeadlineExceeded or Unavailable: clients read those as "ckptd unreachable" and
    // may start from scratch, while the other ranks of the job resume. Unavailable here is
    // the group's coordinator, away until the deadline (or ckptd stopping): the ranks did
    // ask, so the hint is only the timeout.
    return absl::FailedPreconditionError(fmt::format(
        "restore barrier of job {}: {} ({}--restore-timeout)", job, Message(gathered.status()),
        absl::IsUnavailable(gathered.status()) ? "" : "every rank of the job must ask to restore; "));
  }
  std::vector<std::pair<uint32_t, std::vector<uint64_t>>> lists;
  for (size_t i = 0; i < gathered->payloads.size(); ++i) {
    CKPT_ASSIGN_OR_RETURN(std::vector<uint64_t> steps, DecodeSteps(gathered->payloads[i]));
    lists.emplace_back(gathered->senders[i], std::move(steps));
  }
  return ChooseCommonStep(job, lists);
}

// The agreement over a distinct gather: this node's own table, or the group's.
class GatheringStepAgreement : public StepAgreement {
 public:
  using Gather = std::function<absl::StatusOr<group::GatherTable::Distinct>(
      const std::string& key, uint32_t participant, uint32_t participants, std::string payload,
      std::chrono::milliseconds timeout)>;
  using CancelFn = std::function<void(const std::string& why)>;
  GatheringStepAgreement(Gather gather, CancelFn cancel) : gather_(std::move(gather)), cancel_(std::move(cancel)) {}

  absl::StatusOr<std::optional<uint64_t>> Agree(const std::string& job, uint32_t rank,
                                                uint32_t world_size,
                                                const std::vector<uint64_t>& available,
                                                std::chrono::milliseconds timeout) override {
    return Decide(job, gather_(Key(job), rank, world_size, EncodeSteps(available), timeout));
  }
  absl::StatusOr<std::vector<SharedOutcome>> ShareOutcomes(const std::string& job, uint32_t rank,
                                                           uint32_t world_size, uint64_t step,
                                                           std::string outcome,
                                                           std::chrono::milliseconds timeout) override {
    return Outcomes(job, step, gather_(OutcomeKey(job, step), rank, world_size, std::move(outcome), timeout));
  }
  void Cancel(const std::string& why) override { cancel_(why); }

 private:
  const Gather gather_;
  const CancelFn cancel_;
};

}  // namespace

StepAgreementPtr MakeLocalStepAgreement() {
  auto table = std::make_shared<group::GatherTable>();
  return std::make_unique<GatheringStepAgreement>(
      [table](const std::string& key, uint32_t participant, uint32_t participants, std::string payload,
              std::chrono::milliseconds timeout) {
        return table->ArriveDistinctAndWait(key, participant, participants, std::move(payload), timeout);
      },
      [table](const std::string& why) { table->Close(why); });
}

StepAgreementPtr MakeGroupStepAgreement(group::GroupClient& client) {
  return std::make_unique<GatheringStepAgreement>(
      [&client](const std::string& key, uint32_t participant, uint32_t participants, std::string payload,
                std::chrono::milliseconds timeout) {
        return client.GatherDistinct(key, participant, participants, std::move(payload), timeout);
      },
      [&client](const std::string& why) { client.CancelGathers(why); });
}

absl::StatusOr<std::optional<uint64_t>> ChooseCommonStep(
    const std::string& job, const std::vector<std::pair<uint32_t, std::vector<uint64_t>>>& available) {
  bool any = false;
  std::optional<std::set<uint64_t>> common;
  for (const auto& [rank, list] : available) {
    any = any || !list.empty();
    std::set<uint64_t> mine(list.begin(), list.end());
    if (!common) {
      common = std::move(mine);
      continue;
    }
    std::set<uint64_t> both;
    std::set_intersection(common->begin(), common->end(), mine.begin(), mine.end(),
                          std::inserter(both, both.end()));
    common = std::move(both);
  }
  if (!any) return std::optional<uint64_t>();
  if (common && !common->empty()) {
    // The latest step they all have, in rank 0's run order (every node reads the same run
    // from the same manifest, so the lists agree; one rank's view decides all the same).
    const std::vector<uint64_t>& first = available.front().second;
    for (auto it = first.rbegin(); it != first.rend(); ++it) {
      if (common->count(*it)) return std::optional<uint64_t>(*it);
    }
  }
  std::vector<std::string> per_rank;
  for (size_t i = 0; i < available.size() && per_rank.size() < 8; ++i) {
    const auto& [rank, list] = available[i];
    per_rank.push_back(list.empty() ? fmt::format("rank {}: none", rank)
                                    : fmt::format("rank {}: newest {}", rank, list.back()));
  }
  return absl::FailedPreconditionError(fmt::format(
      "job {}: no committed step is present for every rank ({}{})", job, fmt::join(per_rank, "; "),
      available.size() > 8 ? "; ..." : ""));
}

std::string EncodeSteps(const std::vector<uint64_t>& steps) {
  size_t first = steps.size() > kMaxAdvertised ? steps.size() - kMaxAdvertised : 0;
  return fmt::format("{}", fmt::join(steps.begin() + first, steps.end(), ","));
}

absl::StatusOr<std::vector<uint64_t>> DecodeSteps(const std::string& text) {
  std::vector<uint64_t> steps;
  const char* p = text.data();
  const char* end = p + text.size();
  while (p < end) {
    uint64_t v = 0;
    auto [next, ec] = std::from_chars(p, end, v);
    if (ec != std::errc() || (next < end && *next != ',')) {
      return absl::InvalidArgumentError(fmt::format("bad step list \"{}\"", text.substr(0, 64)));
    }
    steps.push_back(v);
    p = next < end ? next + 1 : next;
  }
  return steps;
}

}  // namespace ckpt::daemon
