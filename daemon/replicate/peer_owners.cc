#include "daemon/replicate/peer_owners.h"

#include <fmt/format.h>

#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "common/status.h"
#include "daemon/replicate/run_each.h"

namespace ckpt::replicate {

PeerOwners::PeerOwners(PeerDirectory& peers, std::function<bool()> joined, Options options)
    : peers_(peers), joined_(std::move(joined)), options_(options) {}

absl::StatusOr<std::optional<daemon::KnownOwner>> PeerOwners::Find(const std::string& job) {
  // A node that just started hears who is alive with its first heartbeats.
  const auto joined_by = std::chrono::steady_clock::now() + options_.join_wait;
  while (!joined_()) {
    if (std::chrono::steady_clock::now() >= joined_by) {
      return absl::UnavailableError(fmt::format("this node has not joined its group within {} s, so it cannot "
                                                "ask its peers yet",
                                                std::chrono::duration_cast<std::chrono::seconds>(options_.join_wait).count()));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const std::vector<Holder> live = peers_.LiveMembers();
  std::vector<absl::StatusOr<std::optional<ReplicaClient::JobOwnerAnswer>>> answers(
      live.size(), absl::UnknownError("not asked"));
  RunEach(live.size(), live.size(), [&](size_t i) {
    answers[i] = peers_.Client(live[i].address).JobOwner(job, options_.call_timeout);
    return answers[i].status();
  });
  std::vector<std::string> problems;
  for (size_t i = 0; i < live.size(); ++i) {
    if (absl::IsUnimplemented(answers[i].status())) continue;  // a ckptd that keeps no owners: knows none
    if (!answers[i].ok()) {
      problems.push_back(fmt::format("node {}: {}", live[i].node, Message(answers[i].status())));
      continue;
    }
    if (const std::optional<ReplicaClient::JobOwnerAnswer>& owner = *answers[i]) {
      return std::optional<daemon::KnownOwner>(daemon::KnownOwner{
          owner->uid, owner->gid, fmt::format("node {}'s {} of the job", live[i].node, owner->source)});
    }
  }
  if (!problems.empty()) {
    return absl::UnavailableError(fmt::format("peers not asked: {}", JoinSome(problems, 4, "; ")));
  }
  return std::optional<daemon::KnownOwner>();
}

}  // namespace ckpt::replicate
