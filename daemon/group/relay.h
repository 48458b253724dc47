// A node's relay for the nodes below it in the tree (relay_tree.h): it batches their
// prepares and heartbeats into one call upstream each, and answers their outcome polls
// from one upstream poll per step. At 10,000 nodes and fan-out 32 the coordinator hears
// about 32 calls per step instead of 10,000: what a gRPC call costs there (~100 us of its
// CPU) is paid once per batch.
//
// Every node holds the group token, and the coordinator checks each item of a batch as if
// it came on its own (incarnation, job, ranks, values). A relay keeps only what is final
// (commits, and each node's share of them), never an abort or "pending", which a new
// attempt at the step could contradict. A relay that dies or stops answering only makes
// its children call the coordinator directly (GrpcGroupClient), and every call it carries
// is idempotent.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/group/batch_queue.h"
#include "daemon/group/gather_merger.h"
#include "daemon/group/gather_table.h"
#include "proto/group.pb.h"

namespace ckpt::group {

// Where a relay's calls go: its own parent, or the coordinator when the parent does not
// answer. Blocking; called from the relay's own threads.
class RelayUpstream {
 public:
  virtual ~RelayUpstream() = default;
  virtual absl::StatusOr<ckptd::group::v1::PrepareBatchReply> ForwardPrepares(
      const ckptd::group::v1::PrepareBatchRequest& batch) = 0;
  virtual absl::StatusOr<ckptd::group::v1::HeartbeatBatchReply> ForwardHeartbeats(
      const ckptd::group::v1::HeartbeatBatchRequest& batch) = 0;
  // A long poll: returns within the request's wait_ms plus the call deadline.
  virtual absl::StatusOr<ckptd::group::v1::OutcomeReply> ForwardOutcome(
      const ckptd::group::v1::OutcomeRequest& request) = 0;
  // Merged arrivals of a distinct gather, answered by `deadline` (a gather waits for every
  // participant) with the round's distinct payloads.
  virtual absl::StatusOr<GatherTable::Distinct> ForwardGather(const std::string& key, uint32_t participants,
                                                              const std::vector<GatherTable::Sent>& sent,
                                                              std::chrono::steady_clock::time_point deadline) = 0;
  // Ends the forwards in flight and fails later ones at once (shutdown).
  virtual void CancelForwards(const std::string& why) = 0;
};

class Relay {
 public:
  using Clock = std::chrono::steady_clock;
  using PrepareDone = std::function<void(absl::StatusOr<ckptd::group::v1::PrepareBatchReply>)>;
  using HeartbeatDone = std::function<void(absl::StatusOr<ckptd::group::v1::HeartbeatBatchReply>)>;
  using OutcomeDone = std::function<void(absl::StatusOr<ckptd::group::v1::OutcomeReply>)>;

  struct Limits {
    size_t batch_items = 4096;                // prepares or heartbeats per call upstream
    size_t batch_bytes = size_t{16} << 20;    // per call upstream (gRPC's cap is 64 MiB)
    size_t queued_items = 65536;              // of each, waiting; beyond: RESOURCE_EXHAUSTED
    size_t outcome_waiters = 16384;           // polls held; beyond: RESOURCE_EXHAUSTED
    size_t polled_steps = 64;                 // steps polled upstream at once (a thread each)
    size_t decided_steps = 256;               // decisions kept to answer late polls
  };

  Relay(uint32_t node, RelayUpstream& upstream, Limits limits);
  explicit Relay(uint32_t node, RelayUpstream& upstream) : Relay(node, upstream, Limits{}) {}
  ~Relay();  // Stop()
  Relay(const Relay&) = delete;
  Relay& operator=(const Relay&) = delete;

  // A batch from a node below (a leaf sends a batch of one). `done` gets the results, in
  // order, once the coordinator answered them all, or the status of the relay's own call
  // upstream, for the whole batch: the child then calls the coordinator itself.
  void Prepare(ckptd::group::v1::PrepareBatchRequest batch, PrepareDone done);
  // Heartbeats from the nodes below, the same way: node 0 checks each, and each view they
  // hear comes back once (node 0 sends at most two per batch).
  void Heartbeat(ckptd::group::v1::HeartbeatBatchRequest batch, HeartbeatDone done);
  // An outcome poll from a node below, answered by `deadline` (then "pending"). Polls for
  // one step share one poll upstream; a commit is kept for the polls that come later (an
  // abort is not: the step may be saved again under a new attempt).
  void GetOutcome(const ckptd::group::v1::OutcomeRequest& request, Clock::time_point deadline,
                  OutcomeDone done);
  // Arrivals of a distinct gather from the nodes below (a node's ranks, merged, or a relay's
  // subtree), merged with the others of the key that come within a short linger and sent
  // up as one call (gather_merger.h). `done` runs once; a refusal (stopping, too many
  // merges held) keeps nothing, and the child then calls the coordinator itself.
  absl::Status Gather(const std::string& key, uint32_t participants, std::vector<GatherTable::Sent> sent,
                      Clock::time_point deadline, GatherTable::DistinctDone done);
  // Fails what waits and everything later with Unavailable; waits for the relay's threads.
  // Only the first call does anything (and uses the upstream).
  void Stop();

  struct Counters {
    uint64_t prepares = 0;         // relayed upstream
    uint64_t batches = 0;          // calls upstream carrying them
    uint64_t heartbeats = 0;       // relayed upstream
    uint64_t heartbeat_batches = 0;
    uint64_t outcome_polls = 0;    // answered
    uint64_t upstream_polls = 0;   // calls upstream for them
    uint64_t gathers = 0;          // gather arrivals relayed
    uint64_t gather_merges = 0;    // calls upstream carrying them
  };
  Counters counters() const;

 private:
  // A heartbeat's answer: its status, and the view it hears (shared by every heartbeat of
  // a batch that knew the same membership version).
  struct HeartbeatAnswer {
    ckptd::group::v1::HeartbeatResult result;
    std::shared_ptr<const ckptd::group::v1::GroupView> view;
  };
  struct Waiter {
    uint32_t node;
    std::vector<uint32_t> shares_for;  // a relay below asks for its subtree's shares
    Clock::time_point deadline;
    OutcomeDone done;
  };
  struct Step {
    std::unique_ptr<ckptd::group::v1::OutcomeReply> decided;  // committed: final
    std::map<uint32_t, ckptd::group::v1::NodeShare> shares;  // of `decided`, by node
    std::set<uint32_t> asked;                                 // shares the coordinator sent
    std::vector<Waiter> waiters;
    bool polling = false;
    uint64_t decided_order = 0;
  };
  using StepKey = std::pair<std::string, uint64_t>;

  BatchQueue<ckptd::group::v1::PrepareRequest, ckptd::group::v1::PrepareResult>::Answers SendPrepares(
      std::vector<ckptd::group::v1::PrepareRequest>& items);
  BatchQueue<ckptd::group::v1::HeartbeatRequest, HeartbeatAnswer>::Answers SendHeartbeats(
      std::vector<ckptd::group::v1::HeartbeatRequest>& items);
  void PollLoop(StepKey key);
  // Answers (into `later`, run after unlocking) every waiter of `s` whose node and
  // asked-for shares the decision covers.
  void AnswerCoveredLocked(Step& s, std::vector<std::function<void()>>& later);
  // Drops the commit of `key` this relay holds, if any: it is of an earlier attempt at the
  // step number than the one being prepared or polled for.
  void ForgetDecidedLocked(const StepKey& key);
  void ForgetOldDecisionsLocked();

  const uint32_t node_;
  RelayUpstream& upstream_;
  const Limits limits_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::map<StepKey, Step> steps_;
  size_t waiters_ = 0;
  uint64_t decisions_ = 0;
  int pollers_ = 0;  // PollLoop threads running (detached, counted)
  Counters counters_;  // outcome polls; the queues count their own
  BatchQueue<ckptd::group::v1::PrepareRequest, ckptd::group::v1::PrepareResult> prepares_;
  BatchQueue<ckptd::group::v1::HeartbeatRequest, HeartbeatAnswer> heartbeats_;
  GatherMerger gathers_;
};

}  // namespace ckpt::group
