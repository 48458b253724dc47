// The Group gRPC service behind GroupServer: token check, request validation and the
// mapping of each call onto the coordinator's pure-logic objects. Long polls (an outcome,
// a gather) register a callback and return: the thread that decides them finishes the
// call, so a waiting call holds no thread.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "daemon/group/commit_coordinator.h"
#include "daemon/group/decision_log.h"
#include "daemon/group/gather_table.h"
#include "daemon/group/grpc_util.h"
#include "daemon/group/group_options.h"
#include "daemon/group/membership.h"
#include "daemon/group/relay.h"
#include "daemon/group/structure_cache.h"
#include "daemon/group/structure_uploads.h"
#include "daemon/group/upload_targets.h"
#include "daemon/schedule/save_schedule.h"
#include "proto/group.grpc.pb.h"

namespace ckpt::group {

// What only node 0 holds. Owned by the server, outlives the service.
struct CoordinatorState {
  CoordinatorState(const GroupOptions& options, DecisionLog& log,
                   CommitCoordinator::Publisher publish, const UploadTargets* uploading)
      : membership(options.num_nodes, options.group_timeout),
        // On a shared root the coordinator publishes every step's whole manifest itself, so
        // it keeps every structure whole (a summary could not be joined into it).
        structures(size_t{1} << 30, /*summarize=*/!publish.commit),
        commits(log, CommitOptions(options, std::move(publish))),
        uploading(uploading) {}
  Membership membership;
  // The part structures nodes sent, so that their prepares carry only values. 1 GiB holds
  // about 1,000 nodes' structures of 8 ranks x 200 tensors; beyond it, summaries. Before
  // `commits`, which drops structures from it, and so outlives it.
  StructureCache structures;
  CommitCoordinator commits;
  StructureUploads uploads{StructureUploads::Limits{}};
  // One uploaded part parsed at a time: a parse holds several times its text in memory.
  std::mutex parse_mu;
  GatherTable gathers;
  daemon::SaveSchedule saves;  // every job's save clock (interval_seconds)
  const UploadTargets* uploading;  // node 0's uploader's (null without a remote tier)

  // forget_structure points at `structures` of this very object.
  CoordinatorState(const CoordinatorState&) = delete;
  CoordinatorState& operator=(const CoordinatorState&) = delete;

 private:
  CommitCoordinator::Options CommitOptions(const GroupOptions& options, CommitCoordinator::Publisher publish) {
    CommitCoordinator::Options o;
    o.step_timeout = options.step_timeout;
    o.max_whole_manifest_bytes = options.max_whole_manifest_bytes;
    o.publish = std::move(publish);
    o.forget_structure = [this](const std::string& digest) { structures.Forget(digest); };
    return o;
  }
};

class GroupService final : public ckptd::group::v1::Group::CallbackService {
 public:
  // `coordinator` is null on nodes other than 0; otherwise it must outlive the service.
  GroupService(const GroupOptions& options, uint64_t incarnation, CoordinatorState* coordinator);

  // From now on long polls answer at once (shutdown: nothing may wait any more).
  void StopWaiting() { stop_waiting_ = true; }
  // On nodes other than 0: relays heartbeats, prepares and outcome polls for the nodes below
  // (relay.h). Set before the server starts; must outlive it.
  void SetRelay(Relay* relay) { relay_ = relay; }

  grpc::ServerUnaryReactor* Join(grpc::CallbackServerContext* ctx,
                                 const ckptd::group::v1::JoinRequest* request,
                                 ckptd::group::v1::JoinReply* reply) override;
  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* ctx,
                                      const ckptd::group::v1::HeartbeatRequest* request,
                                      ckptd::group::v1::HeartbeatReply* reply) override;
  grpc::ServerUnaryReactor* HeartbeatBatch(grpc::CallbackServerContext* ctx,
                                           const ckptd::group::v1::HeartbeatBatchRequest* request,
                                           ckptd::group::v1::HeartbeatBatchReply* reply) override;
  grpc::ServerUnaryReactor* Prepare(grpc::CallbackServerContext* ctx,
                                    const ckptd::group::v1::PrepareRequest* request,
                                    ckptd::group::v1::PrepareReply* reply) override;
  grpc::ServerUnaryReactor* PrepareBatch(grpc::CallbackServerContext* ctx,
                                         const ckptd::group::v1::PrepareBatchRequest* request,
                                         ckptd::group::v1::PrepareBatchReply* reply) override;
  grpc::ServerUnaryReactor* PutStructure(grpc::CallbackServerContext* ctx,
                                         const ckptd::group::v1::StructureChunk* request,
                                         ckptd::group::v1::StructureChunkReply* reply) override;
  grpc::ServerUnaryReactor* Abort(grpc::CallbackServerContext* ctx,
                                  const ckptd::group::v1::AbortRequest* request,
                                  ckptd::group::v1::AbortReply* reply) override;
  grpc::ServerUnaryReactor* GetOutcome(grpc::CallbackServerContext* ctx,
                                       const ckptd::group::v1::OutcomeRequest* request,
                                       ckptd::group::v1::OutcomeReply* reply) override;
  grpc::ServerUnaryReactor* Gather(grpc::CallbackServerContext* ctx,
                                   const ckptd::group::v1::GatherRequest* request,
                                   ckptd::group::v1::GatherReply* reply) override;
  grpc::ServerUnaryReactor* DecideSave(grpc::CallbackServerContext* ctx,
                                       const ckptd::group::v1::SaveDecisionRequest* request,
                                       ckptd::group::v1::SaveDecisionReply* reply) override;
  grpc::ServerUnaryReactor* Ping(grpc::CallbackServerContext* ctx,
                                 const ckptd::group::v1::PingRequest* request,
                                 ckptd::group::v1::PingReply* reply) override;

 private:
  enum class Role { kAnyNode, kCoordinatorOnly };
  using Fill = std::function<absl::Status()>;

  // The checks a batch makes before its items (token, size, and that this node is the
  // coordinator or relays): the relay to hand it to, or null on the coordinator.
  absl::StatusOr<Relay*> AdmitBatch(grpc::CallbackServerContext* ctx, const char* method, const char* what,
                                    int size);
  // Checks and prepares one node's part (a Prepare, or one of a batch): `finish` runs once,
  // with what fills `reply` or the error, perhaps later on another thread (node 0 hears a
  // commit once the whole manifest is assembled).
  // `found`: the structure its digest names, looked up beforehand (a batch's at once), or
  // null to look it up here.
  void PrepareOne(const ckptd::group::v1::PrepareRequest& request, ckptd::group::v1::PrepareReply* reply,
                  std::function<void(const Fill&)> finish,
                  std::shared_ptr<const format::PartStructure> found = nullptr);

  // The token, then the role: the checks every handler makes before reading its request.
  absl::Status Admit(grpc::CallbackServerContext* ctx, const char* method, Role role);
  void WarnRefused(const std::string& peer, const char* method);
  absl::Status CheckNode(const char* field, uint32_t node) const;
  // The group view for a node that knows the membership at `known_members_version` (0:
  // nothing, so every member).
  void FillView(ckptd::group::v1::GroupView* view, uint64_t known_members_version) const;
  // The view a joining `node` hears, or one that knows no member and calls node 0 straight:
  // when it has a relay, only its relay among the members and no version, so that the
  // whole table reaches it through its relay, batched with its subtree's (FillView, every
  // member, otherwise). A node whose relay is down learns the others once it is back.
  void FillJoinView(ckptd::group::v1::GroupView* view, uint32_t node) const;
  // The steps in flight, committed and uploading, every view's.
  void FillProgress(ckptd::group::v1::GroupView* view) const;

  const GroupOptions options_;
  const uint64_t incarnation_;
  CoordinatorState* const coordinator_;
  std::atomic<Relay*> relay_{nullptr};
  std::atomic<bool> stop_waiting_{false};
  ArenaMessages<ckptd::group::v1::PrepareBatchRequest, ckptd::group::v1::PrepareBatchReply> prepare_batch_messages_;
  ArenaMessages<ckptd::group::v1::HeartbeatBatchRequest, ckptd::group::v1::HeartbeatBatchReply>
      heartbeat_batch_messages_;
  ArenaMessages<ckptd::group::v1::OutcomeRequest, ckptd::group::v1::OutcomeReply> outcome_messages_;

  // Refused peers, so that a misconfigured node logs one line a second, not one a call.
  std::mutex warn_mu_;
  std::map<std::string, std::chrono::steady_clock::time_point> last_warned_;
};

}  // namespace ckpt::group
