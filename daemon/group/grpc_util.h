// What the group's client and server share about gRPC: the status conversion (absl and
// gRPC use the same canonical codes), the token metadata and its constant-time check.
#pragma once

#include <grpcpp/support/status.h>

#include <string_view>

#include "absl/status/status.h"

namespace ckpt::group {

// The metadata key under which every group call carries the shared token.
inline constexpr char kTokenMetadata[] = "x-ckptd-group-token";

grpc::Status ToGrpc(const absl::Status& status);
absl::Status FromGrpc(const grpc::Status& status);

// True when `a` equals `b`, in time that depends on their lengths only, so that a peer
// cannot learn the token a byte at a time by timing refusals.
bool ConstantTimeEquals(std::string_view a, std::string_view b);

}  // namespace ckpt::group
