// A node's connection to the coordinator: one gRPC channel (keepalive, optional mutual
// TLS), and one to its parent relay for heartbeats, prepares and outcome polls (relay_tree.h; the
// coordinator whenever the parent fails), the shared token on every call, deadlines on every call, retries with back-off
// only where a call is idempotent (all of them are: prepare and abort are keyed by job,
// step and rank).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>
#include <grpcpp/channel.h>

#include "absl/status/statusor.h"
#include "daemon/group/commit_coordinator.h"
#include "daemon/group/gather_table.h"
#include "daemon/group/group_options.h"
#include "daemon/group/membership.h"
#include "daemon/group/relay.h"
#include "format/manifest.h"
#include "daemon/schedule/save_schedule.h"

namespace ckpt::group {

struct GroupViewData {
  std::vector<MemberView> members;
  std::vector<StepProgress> steps;
  std::map<std::string, uint64_t> committed;  // newest globally committed step per job
  std::map<std::string, uint64_t> uploading;  // the step node 0 uploads per job (upload_targets.h)
};

class GroupClient {
 public:
  virtual ~GroupClient() = default;

  // Joins under `incarnation`, retrying with exponential back-off (100 ms doubling to 2 s)
  // while the coordinator is unreachable, until `deadline`. Refusals (wrong token, wrong
  // --num-nodes) are returned at once.
  virtual absl::StatusOr<GroupViewData> Join(std::chrono::steady_clock::time_point deadline) = 0;
  // FailedPrecondition: the coordinator does not know this incarnation (it restarted, or
  // marked this node lost): join again.
  virtual absl::StatusOr<GroupViewData> Heartbeat() = 0;
  // `attempt`: see CommitCoordinator::Prepare.
  virtual absl::StatusOr<Decision> Prepare(const format::Manifest& part, uint64_t attempt) = 0;
  // `run`: the run of the aborting attempt (Manifest::run; 0: not known). An abort of a
  // newer run than a step's commit ends the new round even before it opens.
  virtual absl::Status Abort(const std::string& job, uint64_t step, uint64_t attempt, uint64_t run,
                             const std::string& reason) = 0;
  // Long-poll: returns when decided or after `wait` (then kPending). A commit comes with
  // the step's header and this node's share; with the whole manifest only on node 0 or
  // when `whole_manifest` (a node that kept the step in doubt and lost what it wrote).
  // `attempt`: the attempt this node waits to hear about (0: any), so that a relay's cached
  // commit of an earlier attempt at the step number is not taken for this one's.
  virtual absl::StatusOr<Decision> GetOutcome(const std::string& job, uint64_t step,
                                              std::chrono::milliseconds wait,
                                              bool whole_manifest = false, uint64_t attempt = 0) = 0;
  // All-gather among `participants` (any node may host any participant); the payloads by
  // participant, or DeadlineExceeded naming who is missing. A coordinator that is away
  // (unreachable, restarting) is tried again until `timeout`; then Unavailable, one message
  // on every node (docs/architecture.md, "The restore barrier").
  virtual absl::StatusOr<std::vector<std::string>> Gather(const std::string& key,
                                                          uint32_t participant,
                                                          uint32_t participants,
                                                          std::string payload,
                                                          std::chrono::milliseconds timeout) = 0;
  // The same, answered with each distinct payload once (GatherTable::Distinct): what a
  // collective whose participants mostly bring the same payload needs, in O(distinct)
  // bytes per participant instead of O(participants).
  virtual absl::StatusOr<GatherTable::Distinct> GatherDistinct(const std::string& key, uint32_t participant,
                                                               uint32_t participants, std::string payload,
                                                               std::chrono::milliseconds timeout) = 0;
  // The coordinator's SaveSchedule decision for `question`.
  virtual absl::StatusOr<bool> DecideSave(const daemon::SaveQuestion& question) = 0;
  // Ends the gathers in flight and fails later ones at once with `why` (shutdown).
  virtual void CancelGathers(const std::string& why) = 0;
  // Where this node's relay forwards what it relays (this client's parent, else the
  // coordinator); null when the client cannot relay.
  virtual RelayUpstream* relay_upstream() { return nullptr; }
  // Calls this node sent to the coordinator itself although it has a parent relay (the
  // relay not yet known alive, passed over after a failed call, or refusing), since start.
  virtual uint64_t relay_bypasses() const { return 0; }
};

using GroupClientPtr = std::unique_ptr<GroupClient>;

// The other collectives, as gathers: a barrier is a gather of empty payloads; a broadcast
// is a gather in which only `root`'s payload is read.
absl::Status Barrier(GroupClient& client, const std::string& key, uint32_t participant,
                     uint32_t participants, std::chrono::milliseconds timeout);
absl::StatusOr<std::string> Broadcast(GroupClient& client, const std::string& key,
                                      uint32_t participant, uint32_t participants, uint32_t root,
                                      std::string payload, std::chrono::milliseconds timeout);

// A channel to another node's group server at `address` (its Replicas service, say), with
// the group's credentials and keepalive: what the group client uses for node 0.
std::shared_ptr<grpc::Channel> MakePeerChannel(const GroupOptions& options, const std::string& address);

// Connects (lazily) to options.coordinator.
absl::StatusOr<GroupClientPtr> MakeGrpcGroupClient(const GroupOptions& options,
                                                   uint64_t incarnation,
                                                   std::string advertised_address);

}  // namespace ckpt::group
