// gRPC Trainer service: registration, the RPC snapshot path, waits, restore.
#pragma once

#include <functional>

#include "daemon/control/call_limiter.h"
#include "daemon/control/status_board.h"
#include "daemon/persist/retention_keeper.h"
#include "daemon/restorer.h"
#include "daemon/schedule/save_clock.h"
#include "daemon/session/arena_deposits.h"
#include "daemon/session/job_owners.h"
#include "daemon/session/peer_identity.h"
#include "daemon/session/session_registry.h"
#include "daemon/staging/snapshot_sink.h"
#include "daemon/staging/stager.h"
#include "daemon/upload/upload_policy.h"
#include "proto/trainer.grpc.pb.h"

namespace ckpt::daemon {

class TrainerService final : public ::ckptd::v1::Trainer::Service {
 public:
  static constexpr size_t kMaxLongCallsPerUid = 32;
  static constexpr size_t kMaxLongCalls = 256;

  TrainerService(SessionRegistry& sessions, Stager& stager, SnapshotSink& persist,
                 persist::RetentionKeeper& retention, Restorer& restorer, StatusBoard& board,
                 Session::Limits limits, const PeerTable& peers, JobOwners& owners,
                 ArenaDeposits& arenas, SaveClock& saves, upload::UploadPolicies& upload_policies,
                 std::string control_socket)
      : sessions_(sessions), stager_(stager), persist_(persist), retention_(retention),
        restorer_(restorer), board_(board), limits_(std::move(limits)), peers_(peers),
        owners_(owners), arenas_(arenas), saves_(saves), upload_policies_(upload_policies),
        control_socket_(std::move(control_socket)) {}

  grpc::Status Register(grpc::ServerContext*, const ::ckptd::v1::RegisterRequest* request,
                        ::ckptd::v1::RegisterReply* reply) override;
  grpc::Status Snapshot(grpc::ServerContext*, const ::ckptd::v1::SnapshotRequest* request,
                        ::ckptd::v1::SnapshotReply* reply) override;
  grpc::Status Wait(grpc::ServerContext*, const ::ckptd::v1::WaitRequest* request,
                    ::ckptd::v1::WaitReply* reply) override;
  // Called after a session restored `step` of its job from `source` (--increments on: the
  // step becomes the rank's base, so the session's first save references what it did not
  // change, when this node holds the step's files).
  using RestoredHook = std::function<void(const std::string& job, uint32_t rank, uint64_t session, uint64_t step,
                                          RestoreResult::Source source)>;
  void set_restored_hook(RestoredHook hook) { restored_hook_ = std::move(hook); }

  grpc::Status Restore(grpc::ServerContext*, const ::ckptd::v1::RestoreRequest* request,
                       ::ckptd::v1::RestoreReply* reply) override;
  grpc::Status Update(grpc::ServerContext*, const ::ckptd::v1::UpdateRequest* request,
                      ::ckptd::v1::UpdateReply* reply) override;
  grpc::Status ShouldSave(grpc::ServerContext*, const ::ckptd::v1::ShouldSaveRequest* request,
                          ::ckptd::v1::ShouldSaveReply* reply) override;
  grpc::Status Unregister(grpc::ServerContext*, const ::ckptd::v1::UnregisterRequest* request,
                          ::ckptd::v1::UnregisterReply* reply) override;

 private:
  // The arenas the caller handed over under `tokens` (one per batch), in order.
  absl::StatusOr<std::vector<UniqueFd>> TakeArenas(
      const google::protobuf::RepeatedPtrField<std::string>& tokens, const PeerIdentity& caller);

  SessionRegistry& sessions_;
  Stager& stager_;
  SnapshotSink& persist_;
  persist::RetentionKeeper& retention_;
  Restorer& restorer_;
  StatusBoard& board_;
  const Session::Limits limits_;
  const PeerTable& peers_;  // who is calling, from the socket
  JobOwners& owners_;
  ArenaDeposits& arenas_;  // trainers' arenas, handed over on the descriptor socket
  SaveClock& saves_;       // decides the steps of jobs that save by time
  upload::UploadPolicies& upload_policies_;  // a job's own, when its trainers send one
  // Wait and Restore may hold a server thread for minutes: bounded per user and in all.
  CallLimiter long_calls_{kMaxLongCallsPerUid, kMaxLongCalls};
  const std::string control_socket_;  // where trainers fetch their control blocks
  RestoredHook restored_hook_;
};

}  // namespace ckpt::daemon
