// Who holds this node's fragments, and how to reach them: the group's members as this node
// last heard them (addresses, failure domains, alive or lost), cut into coding groups
// (coding_groups.h), with one gRPC channel per peer address kept open. What the replicator
// sends through and the restore fetches from.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <grpcpp/channel.h>

#include "absl/status/statusor.h"
#include "daemon/replicate/coding_groups.h"
#include "daemon/replicate/replica_client.h"

namespace ckpt::replicate {

// A member of the group as this node knows it.
struct PeerNode {
  uint32_t node = 0;
  std::string address;  // its group server, where its Replicas service is
  std::string domain;   // --failure-domain
  bool alive = false;
};

// A node that holds fragments: its index among the holders is the fragment it holds.
struct Holder {
  uint32_t node = 0;
  std::string address;
  bool alive = false;
};

class PeerDirectory {
 public:
  struct Options {
    uint32_t self = 0;
    uint32_t num_nodes = 0;
    int k = 0, m = 0;
    std::string token;                     // the group's
    std::chrono::milliseconds timeout{0};  // of each call to a peer
    size_t chunk_bytes = kFragmentChunkBytes;
  };
  using Members = std::function<std::vector<PeerNode>()>;
  using ChannelMaker = std::function<std::shared_ptr<grpc::Channel>(const std::string& address)>;

  PeerDirectory(Options options, Members members, ChannelMaker channels);

  // The k + m - 1 nodes that hold `owner`'s fragments, fragment 0 first (FragmentHolders),
  // from the members of `owner`'s coding group. Every node of the job counts, joined or
  // not, so that the groups do not change as members come and go: a node that has not
  // joined is a domain of its own, not alive, without an address.
  absl::StatusOr<std::vector<Holder>> Holders(uint32_t owner) const;
  // Every live member but this node, with its address.
  std::vector<Holder> LiveMembers() const;
  // Why some coding group shares a failure domain; empty when none does.
  std::string PlacementWarning() const;
  // A client of the peer at `address` (its channel made once, then shared).
  ReplicaClient Client(const std::string& address);

  const Options& options() const { return options_; }

 private:
  absl::StatusOr<CodingGroups> Groups() const;

  const Options options_;
  const Members members_;
  const ChannelMaker channels_;
  std::mutex mu_;
  std::map<std::string, std::shared_ptr<grpc::Channel>> open_;  // by address; guarded by mu_
};

}  // namespace ckpt::replicate
