// The one place where absl::Status becomes grpc::Status, and the guard that keeps
// exceptions from escaping a gRPC handler.
#pragma once

#include <grpcpp/support/status.h>

#include <exception>
#include <string>

#include "absl/status/status.h"
#include "common/log.h"

namespace ckpt::daemon {

grpc::Status ToGrpc(const absl::Status& status);

template <typename Fn>
grpc::Status Guarded(const char* method, Fn&& fn) {
  try {
    return ToGrpc(fn());
  } catch (const std::exception& e) {
    log::Get(log::Component::kControl).error("{}: unexpected exception: {}", method, e.what());
    return grpc::Status(grpc::StatusCode::INTERNAL, std::string(method) + ": " + e.what());
  }
}

}  // namespace ckpt::daemon
