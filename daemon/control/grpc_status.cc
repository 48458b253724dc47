#include "daemon/control/grpc_status.h"

#include "common/status.h"

namespace ckpt::daemon {

grpc::Status ToGrpc(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  // absl and gRPC share the canonical code numbering.
  const std::string message = Message(status);
  if (message.size() > kMaxWireMessageBytes) {
    // The caller gets it cut: the log keeps all of it, as the cut message says.
    log::Get(log::Component::kControl).warn("an answer's error, in full: {}", message);
  }
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), Truncated(message));
}

}  // namespace ckpt::daemon
