// gRPC Admin service for operators (ckptctl): status, list, show, verify, delete.
#pragma once

#include <chrono>
#include <string>

#include "cuda/staging_pool.h"
#include "daemon/checkpointer.h"
#include "daemon/config.h"
#include "daemon/control/status_board.h"
#include "daemon/persist/checkpoint_store.h"
#include "daemon/session/session_registry.h"
#include "proto/admin.grpc.pb.h"

namespace ckpt::daemon {

class AdminService final : public ::ckptd::v1::Admin::Service {
 public:
  AdminService(const Config& config, persist::CheckpointStore& store, Checkpointer& checkpointer,
               SessionRegistry& sessions, cuda::StagingPool& pool, StatusBoard& board)
      : config_(config), store_(store), checkpointer_(checkpointer), sessions_(sessions),
        pool_(pool), board_(board), started_(std::chrono::steady_clock::now()) {}

  grpc::Status Status(grpc::ServerContext*, const ::ckptd::v1::StatusRequest*,
                      ::ckptd::v1::StatusReply* reply) override;
  grpc::Status List(grpc::ServerContext*, const ::ckptd::v1::ListRequest* request,
                    ::ckptd::v1::ListReply* reply) override;
  grpc::Status Show(grpc::ServerContext*, const ::ckptd::v1::CheckpointRef* request,
                    ::ckptd::v1::ShowReply* reply) override;
  grpc::Status Verify(grpc::ServerContext*, const ::ckptd::v1::CheckpointRef* request,
                      ::ckptd::v1::VerifyReply* reply) override;
  grpc::Status Delete(grpc::ServerContext*, const ::ckptd::v1::CheckpointRef* request,
                      ::ckptd::v1::DeleteReply* reply) override;

 private:
  const Config& config_;
  persist::CheckpointStore& store_;
  Checkpointer& checkpointer_;
  SessionRegistry& sessions_;
  cuda::StagingPool& pool_;
  StatusBoard& board_;
  const std::chrono::steady_clock::time_point started_;
};

}  // namespace ckpt::daemon
