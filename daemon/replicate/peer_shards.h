// The restore's side of peer replicas: which steps of this node's ranks its peers can give
// back, the manifest this node sealed them with, and each rank's shard rebuilt from any k
// fragments fetched from the live peers that reported holding them (a fragment that fails
// its checksum, or a peer that does not answer, is passed over for the next). The holders
// of this node's coding group are asked first; when they report nothing (the groups were
// formed from another view of the failure domains, say), every live member is.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "daemon/replicate/peer_directory.h"
#include "daemon/restore/peer_source.h"

namespace ckpt::replicate {

class PeerShards final : public daemon::PeerSource {
 public:
  // `threads`: for decoding.
  // `survey_wait`: how long a survey of the holders waits for those that have not answered
  // yet (not yet known to this node's view, as on a replacement that has just joined, or
  // failing their calls), within the restore's deadline: silence is never taken for "none".
  // A holder the group's view knows to be lost is not waited for.
  PeerShards(PeerDirectory& peers, int k, std::chrono::milliseconds survey_wait = std::chrono::seconds(0),
             int threads = 2)
      : peers_(peers), k_(k), threads_(threads), survey_wait_(survey_wait) {}

  std::vector<std::pair<uint64_t, uint64_t>> Steps(const std::string& job, uint32_t rank, uid_t uid) override;
  absl::StatusOr<std::string> Manifest(const std::string& job, uint64_t step, uid_t uid) override;
  absl::StatusOr<daemon::ShardBytes> Shard(const std::string& job, uint64_t step, uint32_t rank, uid_t uid,
                                           uint64_t max_bytes, const Allocate& allocate = {}) override;

 private:
  // A fragment a live peer reported holding, and that peer's fetch channel.
  struct Source {
    Holder peer;
    uint32_t index = 0;
    FetchGrant grant;
  };
  // What the live peers hold of this node's sealed steps of `job` for `uid`, with this
  // node's code: by (run, step), then by rank.
  struct Survey {
    std::map<std::pair<uint64_t, uint64_t>, std::map<uint32_t, std::vector<Source>>> steps;
    std::map<std::pair<uint64_t, uint64_t>, uint32_t> m;  // each step's parity count
    std::vector<std::string> problems;  // peers that could not be asked
  };
  Survey Take(const std::string& job, uid_t uid);
  // Asks `peers` what they hold; whether each answered (its problem in `problems` if not).
  std::vector<bool> Ask(const std::vector<Holder>& peers, const std::string& job, uid_t uid, Survey& survey,
                        std::vector<std::string>& problems);
  // The newest run's entry of `step`, or null; its m in `m`.
  static const std::map<uint32_t, std::vector<Source>>* Newest(const Survey& survey, uint64_t step,
                                                               uint32_t* m = nullptr);

  PeerDirectory& peers_;
  const int k_;
  const int threads_;
  const std::chrono::milliseconds survey_wait_;
};

}  // namespace ckpt::replicate
