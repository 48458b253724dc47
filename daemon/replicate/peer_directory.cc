#include "daemon/replicate/peer_directory.h"

#include <fmt/format.h>

#include <algorithm>
#include <utility>

#include "daemon/replicate/shard_fragments.h"

namespace ckpt::replicate {

PeerDirectory::PeerDirectory(Options options, Members members, ChannelMaker channels)
    : options_(std::move(options)), members_(std::move(members)), channels_(std::move(channels)) {}

absl::StatusOr<CodingGroups> PeerDirectory::Groups() const {
  std::vector<NodePlace> places(options_.num_nodes);
  for (uint32_t n = 0; n < options_.num_nodes; ++n) places[n].node = n;
  for (const PeerNode& p : members_()) {
    if (p.node < places.size()) places[p.node].domain = p.domain;
  }
  return FormCodingGroups(std::move(places), options_.k, options_.m);
}

absl::StatusOr<std::vector<Holder>> PeerDirectory::Holders(uint32_t owner) const {
  absl::StatusOr<CodingGroups> groups = Groups();
  if (!groups.ok()) return groups.status();
  std::map<uint32_t, PeerNode> known;
  for (PeerNode& p : members_()) known[p.node] = std::move(p);
  for (const CodingGroup& group : groups->groups) {
    if (std::find(group.nodes.begin(), group.nodes.end(), owner) == group.nodes.end()) continue;
    absl::StatusOr<std::vector<uint32_t>> nodes = FragmentHolders(group, owner, options_.k, options_.m);
    if (!nodes.ok()) return nodes.status();
    std::vector<Holder> holders;
    for (uint32_t n : *nodes) {
      auto it = known.find(n);
      holders.push_back(it == known.end() ? Holder{n, "", false}
                                          : Holder{n, it->second.address, it->second.alive && !it->second.address.empty()});
    }
    return holders;
  }
  return absl::InvalidArgumentError(fmt::format("node {} is in no coding group of the {} nodes", owner,
                                                options_.num_nodes));
}

std::vector<Holder> PeerDirectory::LiveMembers() const {
  std::vector<Holder> live;
  for (const PeerNode& p : members_()) {
    if (p.alive && !p.address.empty() && p.node != options_.self) live.push_back({p.node, p.address, true});
  }
  return live;
}

std::string PeerDirectory::PlacementWarning() const {
  absl::StatusOr<CodingGroups> groups = Groups();
  return groups.ok() ? groups->warning : std::string(groups.status().message());
}

ReplicaClient PeerDirectory::Client(const std::string& address) {
  std::shared_ptr<grpc::Channel> channel;
  {
    std::lock_guard lock(mu_);
    std::shared_ptr<grpc::Channel>& open = open_[address];
    if (!open) open = channels_(address);
    channel = open;
  }
  return ReplicaClient(std::move(channel), options_.token, options_.timeout, options_.chunk_bytes);
}

}  // namespace ckpt::replicate
