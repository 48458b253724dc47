#include "daemon/group/grpc_util.h"

#include <string>

#include "common/log.h"
#include "common/status.h"

namespace ckpt::group {

grpc::Status ToGrpc(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  const std::string message = Message(status);
  if (message.size() > kMaxWireMessageBytes) {
    log::Get(log::Component::kGroup).warn("an answer's error, in full: {}", message);
  }
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), Truncated(message));
}

absl::Status FromGrpc(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

}  // namespace ckpt::group
