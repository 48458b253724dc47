// gRPC Admin service for operators (ckptctl): status, list, show, verify, delete.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "common/slow_questions.h"
#include "cuda/staging_pool.h"
#include "daemon/commit/committer.h"
#include "daemon/config.h"
#include "daemon/control/status_board.h"
#include "format/checkpoint_store.h"
#include "format/verify.h"
#include "daemon/persist/retention_keeper.h"
#include "daemon/persist/write_queue.h"
#include "daemon/staging/hot_cache.h"
#include "daemon/session/job_owners.h"
#include "daemon/session/peer_identity.h"
#include "daemon/session/session_registry.h"
#include "proto/admin.grpc.pb.h"

namespace ckpt::daemon {

// What the admin service reads; all outlive it.
struct AdminSources {
  format::CheckpointStore& store;
  HotCache& hot;
  persist::RetentionKeeper& retention;
  commit::Committer& committer;
  persist::WriteQueue& writes;
  SessionRegistry& sessions;
  cuda::StagingPool& pool;
  StatusBoard& board;
  // Fills the group section and each job's global view; empty without a group.
  std::function<void(::ckptd::v1::StatusReply*)> group_status;
  // The remote tier (--remote, tiered mode); null without one. `list` shows its steps.
  format::CheckpointStore* remote = nullptr;
  // Fills each job's uploads and newest remote step; empty without a remote tier.
  std::function<void(::ckptd::v1::StatusReply*)> upload_status;
  // Whether this node's step of a job is replicated in its peers' memory (--replication);
  // empty without replication.
  std::function<bool(const std::string& job, uint64_t step)> replicated;
};

// Where an AdminService answers. On the Unix socket peers were checked when they
// connected; over TCP (--admin-addr) anyone who reaches the port may read, and a call that
// destroys data must carry the admin token.
struct AdminExposure {
  bool over_tcp = false;
  std::string token;  // empty: destructive calls over TCP are refused
  // On the socket: who is calling, and whose jobs are whose (null: no checks, for tests).
  const PeerTable* peers = nullptr;
  JobOwners* owners = nullptr;
};

// The metadata key of the admin token.
inline constexpr char kAdminTokenMetadata[] = "x-ckptd-admin-token";

class AdminService final : public ::ckptd::v1::Admin::Service {
 public:
  AdminService(const Config& config, AdminSources sources, AdminExposure exposure = {})
      : config_(config), src_(std::move(sources)), exposure_(std::move(exposure)),
        store_(src_.store), sessions_(src_.sessions), pool_(src_.pool), board_(src_.board),
        started_(std::chrono::steady_clock::now()) {
    if (src_.remote != nullptr) remote_listings_ = std::make_unique<RemoteListings>(16);
  }
  // Ends the remote tier's listings still waiting on it (after the store was cancelled):
  // before the remote tier goes.
  void Stop() {
    if (remote_listings_) remote_listings_->Stop();
  }

  grpc::Status Status(grpc::ServerContext*, const ::ckptd::v1::StatusRequest*,
                      ::ckptd::v1::StatusReply* reply) override;
  grpc::Status List(grpc::ServerContext*, const ::ckptd::v1::ListRequest* request,
                    ::ckptd::v1::ListReply* reply) override;
  grpc::Status Show(grpc::ServerContext*, const ::ckptd::v1::CheckpointRef* request,
                    ::ckptd::v1::ShowReply* reply) override;
  grpc::Status Verify(grpc::ServerContext*, const ::ckptd::v1::CheckpointRef* request,
                      ::ckptd::v1::VerifyReply* reply) override;
  grpc::Status VerifyWithProgress(grpc::ServerContext*, const ::ckptd::v1::CheckpointRef* request,
                                  grpc::ServerWriter<::ckptd::v1::VerifyUpdate>* writer) override;
  grpc::Status Delete(grpc::ServerContext* ctx, const ::ckptd::v1::CheckpointRef* request,
                      ::ckptd::v1::DeleteReply* reply) override;

 private:
  // May the caller `call` (show, verify, delete) steps of `job`? On the Unix socket, who may
  // act on the job (its owner, its --job-group, root, ckptd's uid); over TCP only the holder
  // of the admin token.
  absl::Status MayAct(grpc::ServerContext* ctx, const char* call, const std::string& job) const;
  // Which jobs `list` and `status` show the caller: on the Unix socket, those it may see
  // (its own, its --job-group's); nullopt when it may see every job (root and ckptd's uid
  // on the socket, anyone over TCP).
  using JobFilter = std::function<bool(const std::string& job)>;
  absl::StatusOr<std::optional<JobFilter>> ListableJobs(grpc::ServerContext* ctx) const;
  // Both verify calls: one verify at a time, the step pinned against retention while it runs.
  absl::StatusOr<format::VerifyReport> RunVerify(grpc::ServerContext* ctx,
                                                 const ::ckptd::v1::CheckpointRef& request,
                                                 format::VerifyOptions options);
  // This node's rank when its disk holds only its own ranks' shards (a group without
  // --shared-root); nullopt when it holds every shard.
  std::optional<uint32_t> LocalNode() const {
    if (config_.num_nodes > 1 && !config_.shared_root) return config_.node_rank;
    return std::nullopt;
  }

  const Config& config_;
  AdminSources src_;
  const AdminExposure exposure_;
  format::CheckpointStore& store_;
  SessionRegistry& sessions_;
  cuda::StagingPool& pool_;
  StatusBoard& board_;
  const std::chrono::steady_clock::time_point started_;
  // The remote tier's listings, on a thread of their own: a store that stopped answering
  // costs `list` the caller's deadline at most, and the local tier is listed all the same.
  using RemoteListings = SlowQuestions<absl::StatusOr<std::vector<format::CheckpointSummary>>>;
  std::unique_ptr<RemoteListings> remote_listings_;  // with a remote tier
};

}  // namespace ckpt::daemon
