#include "client/checkpoint_list.h"

#include <fmt/format.h>
#include <grpcpp/grpcpp.h>

#include <chrono>

#include "proto/admin.grpc.pb.h"

namespace ckpt {

absl::StatusOr<CheckpointList> ListCheckpoints(const std::string& socket, const std::string& job) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);  // a job's listing, not a bounded reply
  auto channel = grpc::CreateCustomChannel("unix:" + socket, grpc::InsecureChannelCredentials(), args);
  auto stub = ::ckptd::v1::Admin::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));  // a remote tier lists slowly
  ::ckptd::v1::ListRequest request;
  request.set_job(job);
  ::ckptd::v1::ListReply reply;
  if (grpc::Status s = stub->List(&ctx, request, &reply); !s.ok()) {
    const auto code = s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED ? absl::StatusCode::kUnavailable
                                                                           : static_cast<absl::StatusCode>(s.error_code());
    return absl::Status(code, fmt::format("list: ckptd at {}: {}", socket, s.error_message()));
  }
  CheckpointList list;
  for (const auto& c : reply.checkpoints()) {
    list.checkpoints.push_back({c.job(), c.step(), c.world_size(), c.tensors(), c.bytes(), c.unix_time(),
                                {c.tiers().begin(), c.tiers().end()}, {c.flags().begin(), c.flags().end()},
                                c.error(), {c.files().begin(), c.files().end()}});
  }
  list.errors.assign(reply.errors().begin(), reply.errors().end());
  return list;
}

}  // namespace ckpt
