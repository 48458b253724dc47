// Sends this node's staged shards to its coding group (docs/architecture.md, "Peer
// replicas"): each rank's shard, once it has landed in staging memory, is coded into k + m
// fragments and k + m - 1 of them go to the peers that hold them (FragmentHolders), on a
// thread of its own, beside the write to disk: the local commit never waits for it. Once
// the step commits and every fragment is acknowledged, the replicator seals the step with
// each holder, handing it this node's manifest of the step: only then is the step
// "replicated", and only then does it replace the step before in the peers' memory.
// A step whose fragments could not all be sent (a peer lost or slow, memory refused) is
// reported incomplete with why, never claimed; the peers drop what they got of it.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "daemon/replicate/erasure_code.h"
#include "daemon/replicate/peer_directory.h"
#include "daemon/replicate/shard_fragments.h"

namespace ckpt::replicate {

// How a step of a job stands with the peers, as this node sent it.
struct StepReplication {
  enum class State { kSending, kReplicated, kIncomplete };
  std::string job;
  uint64_t step = 0;
  State state = State::kSending;
  std::string why;          // kIncomplete: what stopped it
  uint64_t bytes_sent = 0;  // fragments' bytes, every holder's
  // Fragments' bytes not sent: unchanged since the step the holders held, which they
  // patched (every holder's). bytes_sent + bytes_unchanged: what whole fragments would be.
  uint64_t bytes_unchanged = 0;
  double seconds = 0;       // from the first shard staged to the seal (kReplicated)
  double unix_time = 0;     // the step's commit time (its manifest's), once committed
};

const char* StateName(StepReplication::State state);

class Replicator {
 public:
  // `threads`: for coding each shard, and as many sends as there are holders at once.
  // `yield` (may be empty): called before each shard is coded and sent, so that copies a
  // trainer waits for (staging, restores) have the node's memory bandwidth first, as the
  // writer does (cuda::CopyPriority::YieldToCopies).
  Replicator(PeerDirectory& peers, ErasureCode code, int threads = 2, std::function<void()> yield = {});
  ~Replicator();

  // A rank's shard of `step` has landed in staging memory (`data` keeps it there while it
  // is coded). `uid`: the job's owner, in whose share of the peers' memory it counts.
  // Queued shards of the job's older steps not yet sent are given up for it.
  void Staged(const std::string& job, uint64_t step, uint32_t rank, uint64_t run, uid_t uid,
              std::shared_ptr<const ScatteredBytes> data, uint64_t bytes);
  // The step committed with these ranks on this node; `manifest_json` is this node's
  // manifest of it. Sealed with the holders once every rank's fragments are acknowledged.
  void Committed(const std::string& job, uint64_t step, std::vector<uint32_t> ranks, std::string manifest_json,
                 double unix_time = 0);
  // The step did not commit: nothing of it is sealed, and the peers drop what they got.
  void Failed(const std::string& job, uint64_t step);

  // The newest steps of each job (a few), ascending by job then step.
  std::vector<StepReplication> Steps() const;
  // Whether the step was replicated (every fragment acknowledged, sealed) and is still the
  // newest so (by run, then step): a newer step replicated replaces it in the peers' memory.
  bool Replicated(const std::string& job, uint64_t step) const;
  // Stops the worker; a step still being sent is left incomplete.
  void Stop();

 private:
  using Key = std::pair<std::string, uint64_t>;
  struct Shard {
    std::string job;
    uint64_t step = 0;
    uint32_t rank = 0;
    uint64_t run = 0;
    uid_t uid = 0;
    std::shared_ptr<const ScatteredBytes> data;  // the staged data region
    uint64_t bytes = 0;
  };
  // What a rank's shard left at its holders, once its step is sealed and released at every
  // one of them (so that they hold exactly that step): the next shard of the same run, size
  // and holders is sent as a patch of it (only the column chunks that changed).
  struct Base {
    uint64_t step = 0;
    uint64_t run = 0;
    uint64_t data_bytes = 0;
    std::vector<std::pair<uint32_t, std::string>> holders;  // node, address: by fragment index
    FragmentSums sums;                                      // of the fragments sent
  };
  struct Sent {
    uint64_t bytes = 0;
    uint64_t unchanged = 0;
    std::shared_ptr<const Base> next;  // what the shard leaves at the holders
  };
  struct Record {
    StepReplication status;
    uint64_t run = 0;  // of its shards: a step of a newer run is newer whatever its number
    std::chrono::steady_clock::time_point started;
    std::optional<std::vector<Holder>> holders;  // fixed at the step's first send
    std::map<uint32_t, absl::Status> sent;       // by rank
    std::optional<std::vector<uint32_t>> committed_ranks;
    std::string manifest_json;
    bool sealing = false;
    bool failed = false;  // did not commit
    std::map<uint32_t, std::shared_ptr<const Base>> coded;  // by rank: the next step's base, once released
  };

  void Loop();
  // This node's holders, once the group's view has them all alive (or a few seconds on).
  absl::StatusOr<std::vector<Holder>> WaitForHolders();
  // Codes and sends one shard; the status names the holder that failed.
  // `base` (may be null): what the holders hold of the rank, the shard is sent as a patch of
  // it where it can be; a holder that refuses the patch gets its fragment whole.
  absl::Status Send(const Shard& shard, const std::vector<Holder>& holders, const std::shared_ptr<const Base>& base,
                    Sent& sent);
  // With mu_ held: the step is ready to seal (committed, every rank sent) or has failed.
  bool ReadyLocked(const Record& r) const;
  // Seals the step with every holder, then releases its older steps there; or, when it
  // cannot be replicated, has every holder drop what it got of it.
  void Finish(const Key& key);
  // `call(i, holder i)` on every live holder at once (a thread each, RunEach); a holder not
  // alive is Unavailable.
  std::vector<absl::Status> OnEachHolder(const std::vector<Holder>& holders,
                                         const std::function<absl::Status(size_t, ReplicaClient&)>& call);
  // `cause`: the ckptd_replication_errors_total label it counts under (empty: not counted).
  void MarkIncompleteLocked(Record& r, std::string why, std::string_view cause);
  void PruneLocked();

  PeerDirectory& peers_;
  const ErasureCode code_;
  const int threads_;
  const std::function<void()> yield_;
  mutable std::mutex mu_;
  std::condition_variable wake_;
  std::deque<Shard> queue_;         // guarded by mu_
  std::deque<Key> to_finish_;       // guarded by mu_
  std::map<Key, Record> records_;   // guarded by mu_
  // By job and rank: what the holders hold exactly (Base); guarded by mu_.
  std::map<std::pair<std::string, uint32_t>, std::shared_ptr<const Base>> bases_;
  bool stopping_ = false;           // guarded by mu_
  std::optional<Key> sending_;      // the step a shard of which is being sent; guarded by mu_
  std::thread worker_;              // last: started once the rest is there
};

}  // namespace ckpt::replicate
