// What the group's client and server share about gRPC: the status conversion (absl and
// gRPC use the same canonical codes), and the token metadata.
#pragma once

#include <grpcpp/support/status.h>

#include <string_view>

#include "absl/status/status.h"

namespace ckpt::group {

// The metadata key under which every group call carries the shared token.
inline constexpr char kTokenMetadata[] = "x-ckptd-group-token";

grpc::Status ToGrpc(const absl::Status& status);
absl::Status FromGrpc(const grpc::Status& status);

}  // namespace ckpt::group
