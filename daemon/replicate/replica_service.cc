#include "daemon/replicate/replica_service.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <memory>
#include <optional>
#include <utility>

#include "daemon/group/grpc_util.h"
#include "daemon/replicate/erasure_code.h"
#include "daemon/replicate/fetch_channel.h"
#include "format/manifest.h"
#include "storage/secret.h"

namespace ckpt::replicate {
namespace {

namespace pb = ckptd::replicas::v1;


// Receives one fragment's chunks and hands the whole fragment to the store.
class PutReactor final : public grpc::ServerReadReactor<pb::FragmentChunk> {
 public:
  PutReactor(ReplicaService& service, grpc::CallbackServerContext* ctx) : service_(service) {
    if (absl::Status admitted = service_.Admit(ctx); !admitted.ok()) {
      Finish(group::ToGrpc(admitted));
      return;
    }
    if (service_.Stalled()) {
      stalled_ = true;  // never read, never answered: the sender's deadline ends the call
      return;
    }
    StartRead(&chunk_);
  }

  void OnCancel() override {
    if (stalled_) Finish(grpc::Status::CANCELLED);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the sender has sent it all
      End(Complete());
      return;
    }
    if (absl::Status taken = Take(); !taken.ok()) {
      End(taken);
      return;
    }
    StartRead(&chunk_);
  }

  void OnDone() override {
    service_.receiving() -= counted_;  // a call cancelled mid-fragment
    delete this;
  }

 private:
  absl::Status Take() {
    if (!started_) {
      if (!chunk_.has_header()) return absl::InvalidArgumentError("a fragment's first chunk has no header");
      header_ = chunk_.header();
      if (header_.k() < 1 || uint64_t{header_.k()} + header_.m() > static_cast<uint64_t>(kMaxFragments)) {
        return absl::InvalidArgumentError(fmt::format("no {}+{} code is kept here", header_.k(), header_.m()));
      }
      const size_t fragment = ErasureCode::FragmentBytes(header_.data_bytes(), static_cast<int>(header_.k()));
      if (fragment > service_.store().budget()) {
        return absl::ResourceExhaustedError(fmt::format("a fragment of {} bytes is larger than --replica-bytes {}",
                                                        fragment, service_.store().budget()));
      }
      absl::StatusOr<std::optional<FragmentPatch>> patch = PatchFromHeader(header_, fragment);
      if (!patch.ok()) return patch.status();
      patch_ = std::move(*patch);
      expected_ = fragment;
      if (patch_) {
        absl::StatusOr<size_t> bytes = PatchBytes(*patch_, fragment);
        if (!bytes.ok()) return bytes.status();
        expected_ = *bytes;
      }
      started_ = true;
      // The bytes sent are held from here (one allocation, no regrowth), and a patch's whole
      // fragment once built: they count against the budget until the store has it, with
      // what the store holds already.
      counted_ = expected_ + (patch_ ? fragment : 0);
      if (service_.receiving() += counted_;
          service_.receiving() + service_.store().used() > service_.store().budget()) {
        return absl::ResourceExhaustedError(fmt::format(
            "fragments being received hold more than --replica-bytes {}: try again", service_.store().budget()));
      }
      bytes_.reserve(expected_);
    } else if (chunk_.has_header()) {
      return absl::InvalidArgumentError("a fragment's header came again after its first chunk");
    }
    const std::string& data = chunk_.data();
    if (bytes_.size() + data.size() > expected_) {
      return absl::InvalidArgumentError(
          fmt::format("the fragment's chunks hold more than the {} bytes its header gives it", expected_));
    }
    bytes_.append(data);
    return absl::OkStatus();
  }

  // What was received stops counting as being received (it is in the store, or refused)
  // before the sender hears the answer.
  void End(const absl::Status& status) {
    service_.receiving() -= counted_;
    counted_ = 0;
    std::string().swap(bytes_);
    Finish(group::ToGrpc(status));
  }

  absl::Status Complete() {
    if (!started_) return absl::InvalidArgumentError("no fragment was sent");
    if (bytes_.size() != expected_) {
      return absl::DataLossError(fmt::format("the fragment ended after {} of its {} bytes", bytes_.size(), expected_));
    }
    auto [id, meta] = FromHeader(header_);
    if (patch_) return service_.store().PutPatch(static_cast<uid_t>(header_.uid()), id, meta, *patch_, bytes_);
    return service_.store().Put(static_cast<uid_t>(header_.uid()), id, meta, std::move(bytes_));
  }

  ReplicaService& service_;
  pb::FragmentChunk chunk_;
  pb::FragmentHeader header_;
  bool started_ = false;
  size_t expected_ = 0;  // bytes sent: the fragment's, or its patch's
  size_t counted_ = 0;
  std::optional<FragmentPatch> patch_;
  bool stalled_ = false;
  std::string bytes_;
};

// Serves one held fragment in chunks, the header with the first.
class GetReactor final : public grpc::ServerWriteReactor<pb::FragmentChunk> {
 public:
  explicit GetReactor(std::shared_ptr<const HeldFragment> fragment) : fragment_(std::move(fragment)) { Next(); }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the fragment's reader went away"));
      return;
    }
    Next();
  }

  void OnDone() override { delete this; }

 private:
  void Next() {
    const std::string& bytes = fragment_->bytes;
    if (sent_header_ && offset_ >= bytes.size()) {
      Finish(grpc::Status::OK);
      return;
    }
    chunk_.Clear();
    if (!sent_header_) {
      ToHeader(fragment_->id, fragment_->meta, chunk_.mutable_header());
      sent_header_ = true;
    }
    const size_t n = std::min(kFragmentChunkBytes, bytes.size() - offset_);
    chunk_.set_data(bytes.data() + offset_, n);
    offset_ += n;
    StartWrite(&chunk_);
  }

  std::shared_ptr<const HeldFragment> fragment_;
  pb::FragmentChunk chunk_;
  bool sent_header_ = false;
  size_t offset_ = 0;
};

}  // namespace

void ToHeader(const FragmentId& id, const FragmentMeta& meta, pb::FragmentHeader* h) {
  h->set_job(id.job);
  h->set_step(id.step);
  h->set_owner(id.owner);
  h->set_rank(id.rank);
  h->set_index(id.index);
  h->set_k(meta.k);
  h->set_m(meta.m);
  h->set_data_bytes(meta.data_bytes);
  h->set_run(meta.run);
  h->set_checksum(meta.checksum);
}

void ToPatchHeader(const FragmentPatch& patch, pb::FragmentHeader* h) {
  h->set_patch_chunk_bytes(patch.chunk_bytes);
  h->set_base_step(patch.base_step);
  std::string bitmap(patch.chunks.empty() ? 0 : patch.chunks.back() / 8 + 1, '\0');
  for (uint32_t c : patch.chunks) bitmap[c / 8] = static_cast<char>(bitmap[c / 8] | (1 << (c % 8)));
  h->set_patch_chunks(std::move(bitmap));
}

absl::StatusOr<std::optional<FragmentPatch>> PatchFromHeader(const pb::FragmentHeader& h, size_t fragment_bytes) {
  if (h.patch_chunk_bytes() == 0) return std::optional<FragmentPatch>();
  FragmentPatch patch{h.base_step(), h.patch_chunk_bytes(), {}};
  const std::string& bitmap = h.patch_chunks();
  const uint64_t chunks = (fragment_bytes + h.patch_chunk_bytes() - 1) / h.patch_chunk_bytes();
  if (bitmap.size() > (chunks + 7) / 8) {
    return absl::InvalidArgumentError(fmt::format("a patch's bitmap of {} bytes is longer than a fragment of {} "
                                                  "bytes in chunks of {} needs",
                                                  bitmap.size(), fragment_bytes, h.patch_chunk_bytes()));
  }
  for (size_t byte = 0; byte < bitmap.size(); ++byte) {
    for (int bit = 0; bit < 8; ++bit) {
      if (static_cast<uint8_t>(bitmap[byte]) >> bit & 1) patch.chunks.push_back(static_cast<uint32_t>(byte * 8 + bit));
    }
  }
  if (absl::StatusOr<size_t> bytes = PatchBytes(patch, fragment_bytes); !bytes.ok()) return bytes.status();
  return std::optional<FragmentPatch>(std::move(patch));
}

std::pair<FragmentId, FragmentMeta> FromHeader(const pb::FragmentHeader& h) {
  return {FragmentId{h.job(), h.step(), h.owner(), h.rank(), h.index()},
          FragmentMeta{h.k(), h.m(), h.data_bytes(), h.run(), h.checksum()}};
}

absl::Status CheckServed(const FragmentId& asked, const FragmentId& got, const FragmentMeta& meta, uint32_t k,
                         uint64_t max_data_bytes) {
  if (got != asked || meta.k < 1 || uint64_t{meta.k} + meta.m > static_cast<uint64_t>(kMaxFragments) ||
      (k != 0 && meta.k != k)) {
    return absl::DataLossError("the peer answered with another fragment than the one asked for");
  }
  if (meta.data_bytes > max_data_bytes) {
    return absl::DataLossError(fmt::format("the peer's fragment codes {} bytes, more than the {} its shard holds",
                                           meta.data_bytes, max_data_bytes));
  }
  return absl::OkStatus();
}

ReplicaService::ReplicaService(FragmentStore& store, std::string token, ReplicaFaults faults)
    : store_(store), token_(std::move(token)), faults_(std::move(faults)) {}

bool ReplicaService::Stalled() const {
  std::error_code ignored;
  return !faults_.stall_while.empty() && std::filesystem::exists(faults_.stall_while, ignored);
}

absl::Status ReplicaService::Admit(grpc::CallbackServerContext* ctx) const {
  const auto& metadata = ctx->client_metadata();
  auto it = metadata.find(group::kTokenMetadata);
  std::string_view given;
  if (it != metadata.end()) given = std::string_view(it->second.data(), it->second.size());
  if (!SecretEquals(given, token_)) return absl::UnauthenticatedError("the group token is missing or wrong");
  return absl::OkStatus();
}

grpc::ServerReadReactor<pb::FragmentChunk>* ReplicaService::PutFragment(grpc::CallbackServerContext* ctx,
                                                                        pb::PutFragmentReply*) {
  return new PutReactor(*this, ctx);
}

grpc::ServerUnaryReactor* ReplicaService::Seal(grpc::CallbackServerContext* ctx, const pb::SealRequest* request,
                                               pb::SealReply*) {
  auto* reactor = ctx->DefaultReactor();
  absl::Status sealed = Admit(ctx);
  if (sealed.ok() && request->manifest_json().size() > format::kMaxManifestBytes) {
    sealed = absl::InvalidArgumentError(fmt::format("a manifest of {} bytes is over the {} a reader accepts",
                                                    request->manifest_json().size(), format::kMaxManifestBytes));
  }
  if (sealed.ok()) {
    sealed = request->release_older()
                 ? store_.Release(request->job(), request->step(), request->owner())
                 : store_.Seal(request->job(), request->step(), request->owner(), request->count(),
                               request->manifest_json());
  }
  reactor->Finish(group::ToGrpc(sealed));
  return reactor;
}

grpc::ServerWriteReactor<pb::FragmentChunk>* ReplicaService::GetFragment(grpc::CallbackServerContext* ctx,
                                                                         const pb::FragmentRequest* request) {
  absl::Status admitted = Admit(ctx);
  std::shared_ptr<const HeldFragment> fragment;
  if (admitted.ok()) {
    fragment = store_.Find({request->job(), request->step(), request->owner(), request->rank(), request->index()});
    if (!fragment) {
      admitted = absl::NotFoundError(fmt::format("fragment {} of job {} step {} rank {} (node {}'s) is not held here",
                                                 request->index(), request->job(), request->step(), request->rank(),
                                                 request->owner()));
    }
  }
  if (!admitted.ok()) {
    // A reactor that only finishes: no fragment to send.
    class Refused final : public grpc::ServerWriteReactor<pb::FragmentChunk> {
     public:
      explicit Refused(const absl::Status& why) { Finish(group::ToGrpc(why)); }
      void OnDone() override { delete this; }
    };
    return new Refused(admitted);
  }
  if (faults_.corrupt_served) {
    // Test-only fault (CKPTD_FAULT=corrupt-served-fragments): a byte flipped on the way out,
    // as a bad link or memory would, for the restoring node to catch.
    auto damaged = std::make_shared<HeldFragment>(*fragment);
    if (!damaged->bytes.empty()) damaged->bytes[damaged->bytes.size() / 2] ^= 0x5a;
    fragment = std::move(damaged);
  }
  return new GetReactor(std::move(fragment));
}

grpc::ServerUnaryReactor* ReplicaService::ListHeld(grpc::CallbackServerContext* ctx,
                                                   const pb::ListHeldRequest* request, pb::ListHeldReply* reply) {
  auto* reactor = ctx->DefaultReactor();
  absl::Status admitted = Admit(ctx);
  if (admitted.ok() && request->job().empty()) admitted = absl::InvalidArgumentError("no job named");
  if (admitted.ok()) {
    if (fetch_ != nullptr) {
      reply->set_fetch_port(static_cast<uint32_t>(fetch_->port()));
      reply->set_fetch_ticket(fetch_->Issue(request->job(), request->owner()));
    }
    for (const HeldStep& held : store_.Held(request->job(), request->owner())) {
      pb::HeldStepInfo* step = reply->add_steps();
      step->set_step(held.step);
      step->set_run(held.run);
      step->set_sealed(held.sealed);
      step->set_uid(held.uid);
      step->set_k(held.k);
      step->set_m(held.m);
      for (const auto& [rank, index] : held.pieces) {
        pb::HeldPiece* piece = step->add_pieces();
        piece->set_rank(rank);
        piece->set_index(index);
      }
    }
  }
  reactor->Finish(group::ToGrpc(admitted));
  return reactor;
}

grpc::ServerUnaryReactor* ReplicaService::JobOwner(grpc::CallbackServerContext* ctx,
                                                   const pb::JobOwnerRequest* request, pb::JobOwnerReply* reply) {
  auto* reactor = ctx->DefaultReactor();
  absl::Status admitted = Admit(ctx);
  if (admitted.ok() && (request->job().empty() || request->job().size() > 4096)) {
    admitted = absl::InvalidArgumentError("no job named");
  }
  if (admitted.ok()) {
    // This node's own record first (it has the job's group too); else the owner the sending
    // nodes named with the fragments held here.
    if (std::optional<RecordedOwner> recorded = owner_records_ ? owner_records_(request->job()) : std::nullopt) {
      reply->set_known(true);
      reply->set_uid(recorded->uid);
      reply->set_has_gid(recorded->gid.has_value());
      reply->set_gid(recorded->gid.value_or(0));
      reply->set_source("owner record");
    } else if (std::vector<HeldStep> held = store_.Held(request->job()); !held.empty()) {
      reply->set_known(true);
      reply->set_uid(held.back().uid);
      reply->set_source("fragments held");
    }
  }
  reactor->Finish(group::ToGrpc(admitted));
  return reactor;
}

grpc::ServerUnaryReactor* ReplicaService::GetManifest(grpc::CallbackServerContext* ctx,
                                                      const pb::ManifestRequest* request, pb::ManifestReply* reply) {
  auto* reactor = ctx->DefaultReactor();
  absl::Status admitted = Admit(ctx);
  if (admitted.ok()) {
    std::shared_ptr<const std::string> manifest = store_.Manifest(request->job(), request->owner(), request->step());
    if (manifest == nullptr) {
      admitted = absl::NotFoundError(fmt::format("no sealed step {} of job {} from node {} is held here",
                                                 request->step(), request->job(), request->owner()));
    } else {
      reply->set_manifest_json(*manifest);
    }
  }
  reactor->Finish(group::ToGrpc(admitted));
  return reactor;
}

}  // namespace ckpt::replicate
