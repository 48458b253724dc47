// The group's peers as a source of jobs' owners (daemon/session/owner_source.h): a node whose
// root does not know a job (a replacement with an empty disk) asks every live peer at once
// whose it is; a peer answers from its own owner record of the job, else from the owner uid
// of the job's fragments it holds. The first owner named decides; peers that all answer
// "none" mean a new job; peers that cannot all be asked, and name nobody, are an error.
// Bounded: a node that has not joined its group waits `join_wait` for it, each call
// `call_timeout`.
#pragma once

#include <chrono>
#include <functional>
#include <string>

#include "daemon/replicate/peer_directory.h"
#include "daemon/session/owner_source.h"

namespace ckpt::replicate {

class PeerOwners final : public daemon::OwnerSource {
 public:
  struct Options {
    // Most of a registration's wait (JobOwners::Options::ask_wait): daemons of a group that
    // start together join within it.
    std::chrono::milliseconds join_wait{std::chrono::seconds(4)};
    std::chrono::milliseconds call_timeout{std::chrono::seconds(3)};
  };
  // `joined`: whether this node has joined its group (its view of the live members is
  // current). `peers` outlives this.
  PeerOwners(PeerDirectory& peers, std::function<bool()> joined, Options options);

  std::string Describe() const override { return "the group's peers"; }
  absl::StatusOr<std::optional<daemon::KnownOwner>> Find(const std::string& job) override;

 private:
  PeerDirectory& peers_;
  const std::function<bool()> joined_;
  const Options options_;
};

}  // namespace ckpt::replicate
