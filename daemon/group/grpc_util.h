// What the group's client and server share about gRPC: the status conversion (absl and
// gRPC use the same canonical codes), and the token metadata.
#pragma once

#include <google/protobuf/arena.h>
#include <grpcpp/support/message_allocator.h>
#include <grpcpp/support/status.h>

#include <string_view>

#include "absl/status/status.h"

namespace ckpt::group {

// The metadata key under which every group call carries the shared token.
inline constexpr char kTokenMetadata[] = "x-ckptd-group-token";

// Trailing metadata of a relay's answer to a gather (gathers are the one relayed call that
// passes node 0's status on as its own): the relay refused the arrival itself (stopping,
// full, invalid: the node may send it to node 0), or the answer is node 0's (final: asking
// node 0 again would only wait as long once more). Neither: the relay failed the call.
inline constexpr char kRelayRefusedMetadata[] = "x-ckptd-relay-refused";
inline constexpr char kRelayedAnswerMetadata[] = "x-ckptd-relayed-answer";

grpc::Status ToGrpc(const absl::Status& status);
absl::Status FromGrpc(const grpc::Status& status);

// A call's request and reply on one protobuf arena, freed at once when the call ends. A
// relayed batch of 300 prepares is thousands of small messages, maps and strings: one
// malloc and free each cost node 0 more than the work they carry.
template <typename Request, typename Reply>
class ArenaMessages final : public grpc::MessageAllocator<Request, Reply> {
 public:
  grpc::MessageHolder<Request, Reply>* AllocateMessages() override { return new Holder; }

 private:
  class Holder final : public grpc::MessageHolder<Request, Reply> {
   public:
    Holder() {
      this->set_request(google::protobuf::Arena::CreateMessage<Request>(&arena_));
      this->set_response(google::protobuf::Arena::CreateMessage<Reply>(&arena_));
    }
    void Release() override { delete this; }

   private:
    google::protobuf::Arena arena_;
  };
};

}  // namespace ckpt::group
