// The restore's side of peer replicas: which steps of this node's ranks its coding group
// can give back, the manifest it sealed them with, and each rank's shard rebuilt from any
// k fragments fetched from the live holders (a fragment that fails its checksum, or a
// holder that does not answer, is passed over for the next).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "daemon/replicate/peer_directory.h"
#include "daemon/restore/peer_source.h"

namespace ckpt::replicate {

class PeerShards final : public daemon::PeerSource {
 public:
  // `threads`: for decoding.
  PeerShards(PeerDirectory& peers, int k, int threads = 2) : peers_(peers), k_(k), threads_(threads) {}

  std::vector<std::pair<uint64_t, uint64_t>> Steps(const std::string& job, uint32_t rank) override;
  absl::StatusOr<std::string> Manifest(const std::string& job, uint64_t step) override;
  absl::StatusOr<std::string> Shard(const std::string& job, uint64_t step, uint32_t rank) override;

 private:
  // The live holders of this node's fragments, each with its fragment's index.
  std::vector<std::pair<Holder, uint32_t>> LiveHolders() const;

  PeerDirectory& peers_;
  const int k_;
  const int threads_;
};

}  // namespace ckpt::replicate
