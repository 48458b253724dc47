#include "daemon/control/grpc_status.h"

#include "common/status.h"

namespace ckpt::daemon {

grpc::Status ToGrpc(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  // absl and gRPC share the canonical code numbering.
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), Truncated(Message(status)));
}

}  // namespace ckpt::daemon
