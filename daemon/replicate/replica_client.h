// A node's calls to one peer's Replicas service (replica_service.h): send a fragment in
// chunks, seal a step, fetch a fragment back. Blocking; each call bounded by `timeout`.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/status/statusor.h"
#include "daemon/replicate/fragment_store.h"
#include "daemon/replicate/replica_service.h"
#include "proto/replicas.grpc.pb.h"

namespace ckpt::replicate {

// A peer's fetch channel and ticket (fetch_channel.h), handed out with ListHeld.
struct FetchGrant {
  int port = 0;
  std::string ticket;
};

class ReplicaClient {
 public:
  // `chunk_bytes`: what a fragment is sent in (tests send small fragments in several).
  ReplicaClient(std::shared_ptr<grpc::Channel> channel, std::string token, std::chrono::milliseconds timeout,
                size_t chunk_bytes = kFragmentChunkBytes);

  // Sends `fragment` for the peer to hold, counted in the share of `uid` (the job's owner).
  absl::Status Put(uid_t uid, const HeldFragment& fragment);
  // Sends `fragment` as a patch of the peer's fragment of `patch.base_step`: its bytes are the
  // patch's chunks only (ShardPatch), its checksum the whole new fragment's. The peer answers
  // FAILED_PRECONDITION when it lacks the base (the caller sends the fragment whole).
  absl::Status PutPatch(uid_t uid, const HeldFragment& fragment, const FragmentPatch& patch);
  absl::Status Seal(const std::string& job, uint64_t step, uint32_t owner, size_t count,
                    const std::string& manifest_json = {});
  // Every holder sealed `step`: the peer drops the owner's older steps of the job.
  absl::Status Release(const std::string& job, uint64_t step, uint32_t owner);
  // What the peer holds of `owner`'s steps of `job`, ascending; in `grant` (may be null)
  // where and how to fetch them over the plain TCP channel (port 0: none).
  absl::StatusOr<std::vector<HeldStep>> List(const std::string& job, uint32_t owner, FetchGrant* grant = nullptr);
  // Whose `job` is as the peer knows it (JobOwner); nullopt when it knows no owner. Bounded
  // by `timeout`, not the client's.
  struct JobOwnerAnswer {
    uint32_t uid = 0;
    std::optional<uint32_t> gid;
    std::string source;  // "owner record", "fragments held"
  };
  absl::StatusOr<std::optional<JobOwnerAnswer>> JobOwner(const std::string& job, std::chrono::milliseconds timeout);
  // The manifest a sealed step came with (untrusted: the caller parses it with care).
  absl::StatusOr<std::string> GetManifest(const std::string& job, uint64_t step, uint32_t owner);
  // The fragment as the peer holds it: DataLoss when what arrives is not the fragment asked
  // for, or its bytes do not match its checksum (the rebuild would leave it out anyway).
  // `k` (0: any) and `max_data_bytes`: what the caller knows the fragment must be; anything
  // else is refused on its first chunk.
  absl::StatusOr<HeldFragment> Get(const FragmentId& id, uint32_t k = 0,
                                   uint64_t max_data_bytes = UINT64_MAX);

 private:
  std::unique_ptr<grpc::ClientContext> Context(bool wait_for_ready = false) const;
  absl::Status Send(uid_t uid, const HeldFragment& fragment, const FragmentPatch* patch);

  std::unique_ptr<ckptd::replicas::v1::Replicas::Stub> stub_;
  const std::string token_;
  const std::chrono::milliseconds timeout_;
  const size_t chunk_bytes_;
};

}  // namespace ckpt::replicate
