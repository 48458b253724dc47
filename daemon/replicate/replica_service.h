// The Replicas service (proto/replicas.proto) over this node's FragmentStore: the fragments
// its peers send it, their seals, and the fragments a replacement node asks back. Every call
// must carry the group token; a fragment is kept only when it is whole, its bytes match its
// checksum and it fits --replica-bytes (FragmentStore::Put).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>

#include "daemon/replicate/fragment_store.h"
#include "proto/replicas.grpc.pb.h"

namespace ckpt::replicate {

class FetchServer;

// What a fragment is sent and served in: with its header, under gRPC's default 4 MiB
// message limit, so that any server built with defaults takes it.
inline constexpr size_t kFragmentChunkBytes = size_t{2} << 20;

// A fragment's id and coding as they go on the wire (the uid is the sender's to add), and
// back.
void ToHeader(const FragmentId& id, const FragmentMeta& meta, ckptd::replicas::v1::FragmentHeader* header);
std::pair<FragmentId, FragmentMeta> FromHeader(const ckptd::replicas::v1::FragmentHeader& header);
// A patch as it goes on the wire (its chunks as a bitmap), and back: nullopt for a whole
// fragment; InvalidArgument for a bitmap that does not fit a fragment of `fragment_bytes`.
void ToPatchHeader(const FragmentPatch& patch, ckptd::replicas::v1::FragmentHeader* header);
absl::StatusOr<std::optional<FragmentPatch>> PatchFromHeader(const ckptd::replicas::v1::FragmentHeader& header,
                                                             size_t fragment_bytes);

// Whether the fragment a peer serves (`got`, `meta`: its header) is the one asked for, of
// the caller's code (`k`; 0: any) and coding at most `max_data_bytes`: checked before any
// of its bytes is read. DataLoss naming what is wrong.
absl::Status CheckServed(const FragmentId& asked, const FragmentId& got, const FragmentMeta& meta, uint32_t k,
                         uint64_t max_data_bytes);

// Test-only faults (CKPTD_FAULT; tests/integration/replication_test.cc).
struct ReplicaFaults {
  bool corrupt_served = false;  // every fragment served with a byte flipped
  std::string stall_while;      // while this file exists, fragments sent here are never answered
};

class ReplicaService final : public ckptd::replicas::v1::Replicas::CallbackService {
 public:
  // A job's owner as this node's own record has it (uid, and the --job-group that shares the
  // job); nullopt when it has none. Answers JobOwner before the fragments held are looked at.
  struct RecordedOwner {
    uint32_t uid = 0;
    std::optional<uint32_t> gid;
  };
  using OwnerRecords = std::function<std::optional<RecordedOwner>(const std::string& job)>;

  ReplicaService(FragmentStore& store, std::string token, ReplicaFaults faults = {});

  grpc::ServerReadReactor<ckptd::replicas::v1::FragmentChunk>* PutFragment(
      grpc::CallbackServerContext* ctx, ckptd::replicas::v1::PutFragmentReply* reply) override;
  grpc::ServerUnaryReactor* Seal(grpc::CallbackServerContext* ctx, const ckptd::replicas::v1::SealRequest* request,
                                 ckptd::replicas::v1::SealReply* reply) override;
  grpc::ServerWriteReactor<ckptd::replicas::v1::FragmentChunk>* GetFragment(
      grpc::CallbackServerContext* ctx, const ckptd::replicas::v1::FragmentRequest* request) override;
  grpc::ServerUnaryReactor* ListHeld(grpc::CallbackServerContext* ctx, const ckptd::replicas::v1::ListHeldRequest* request,
                                     ckptd::replicas::v1::ListHeldReply* reply) override;
  grpc::ServerUnaryReactor* GetManifest(grpc::CallbackServerContext* ctx,
                                        const ckptd::replicas::v1::ManifestRequest* request,
                                        ckptd::replicas::v1::ManifestReply* reply) override;
  grpc::ServerUnaryReactor* JobOwner(grpc::CallbackServerContext* ctx, const ckptd::replicas::v1::JobOwnerRequest* request,
                                     ckptd::replicas::v1::JobOwnerReply* reply) override;

  FragmentStore& store() { return store_; }
  // Bytes of fragments being received now, not yet in the store: bounded by the budget
  // together, so that peers sending at once cannot hold more memory than it.
  std::atomic<size_t>& receiving() { return receiving_; }
  // OK when the call carries the group token.
  absl::Status Admit(grpc::CallbackServerContext* ctx) const;
  // Whether the stall fault is on now.
  bool Stalled() const;
  // The plain TCP channel for restores (fetch_channel.h), whose tickets ListHeld hands out;
  // null: none (fragments are fetched with GetFragment). Set before the server serves.
  void set_fetch(FetchServer* fetch) { fetch_ = fetch; }
  // This node's owner records (JobOwners); none: JobOwner answers from the fragments held
  // alone. Set before the server serves.
  void set_owner_records(OwnerRecords records) { owner_records_ = std::move(records); }

 private:
  FragmentStore& store_;
  const std::string token_;
  const ReplicaFaults faults_;
  FetchServer* fetch_ = nullptr;
  OwnerRecords owner_records_;
  std::atomic<size_t> receiving_{0};
};

}  // namespace ckpt::replicate
