#include "daemon/replicate/replica_client.h"

#include <fmt/format.h>

#include <algorithm>
#include <tuple>
#include <utility>

#include "common/status.h"
#include "daemon/group/grpc_util.h"
#include "daemon/replicate/erasure_code.h"
#include "daemon/replicate/replica_service.h"
#include "daemon/replicate/fragment_checksum.h"

namespace ckpt::replicate {
namespace {

namespace pb = ckptd::replicas::v1;

}  // namespace

ReplicaClient::ReplicaClient(std::shared_ptr<grpc::Channel> channel, std::string token,
                             std::chrono::milliseconds timeout, size_t chunk_bytes)
    : stub_(pb::Replicas::NewStub(std::move(channel))),
      token_(std::move(token)),
      timeout_(timeout),
      chunk_bytes_(std::clamp<size_t>(chunk_bytes, 1, kFragmentChunkBytes)) {}

std::unique_ptr<grpc::ClientContext> ReplicaClient::Context(bool wait_for_ready) const {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->AddMetadata(group::kTokenMetadata, token_);
  ctx->set_deadline(std::chrono::system_clock::now() + timeout_);
  // The replicator's calls go to holders the group's view says are alive: a connection that
  // is still being made (or was cut short once) is waited for, up to the deadline, rather
  // than failing the step at once.
  ctx->set_wait_for_ready(wait_for_ready);
  return ctx;
}

absl::Status ReplicaClient::Put(uid_t uid, const HeldFragment& f) { return Send(uid, f, nullptr); }

absl::Status ReplicaClient::PutPatch(uid_t uid, const HeldFragment& f, const FragmentPatch& patch) {
  return Send(uid, f, &patch);
}

absl::Status ReplicaClient::Send(uid_t uid, const HeldFragment& f, const FragmentPatch* patch) {
  auto ctx = Context(/*wait_for_ready=*/true);
  pb::PutFragmentReply reply;
  std::unique_ptr<grpc::ClientWriter<pb::FragmentChunk>> writer = stub_->PutFragment(ctx.get(), &reply);
  pb::FragmentChunk chunk;
  ToHeader(f.id, f.meta, chunk.mutable_header());
  chunk.mutable_header()->set_uid(static_cast<uint32_t>(uid));
  if (patch != nullptr) ToPatchHeader(*patch, chunk.mutable_header());
  size_t offset = 0;
  do {
    const size_t n = std::min(chunk_bytes_, f.bytes.size() - offset);
    chunk.set_data(f.bytes.data() + offset, n);
    offset += n;
    // A write that fails means the peer ended the call: its status says why.
    if (!writer->Write(chunk)) break;
    chunk.clear_header();
  } while (offset < f.bytes.size());
  writer->WritesDone();
  return group::FromGrpc(writer->Finish());
}

absl::Status ReplicaClient::Seal(const std::string& job, uint64_t step, uint32_t owner, size_t count,
                                 const std::string& manifest_json) {
  auto ctx = Context(/*wait_for_ready=*/true);
  pb::SealRequest request;
  request.set_job(job);
  request.set_step(step);
  request.set_owner(owner);
  request.set_count(static_cast<uint32_t>(count));
  request.set_manifest_json(manifest_json);
  pb::SealReply reply;
  return group::FromGrpc(stub_->Seal(ctx.get(), request, &reply));
}

absl::Status ReplicaClient::Release(const std::string& job, uint64_t step, uint32_t owner) {
  auto ctx = Context(/*wait_for_ready=*/true);
  pb::SealRequest request;
  request.set_job(job);
  request.set_step(step);
  request.set_owner(owner);
  request.set_release_older(true);
  pb::SealReply reply;
  return group::FromGrpc(stub_->Seal(ctx.get(), request, &reply));
}

absl::StatusOr<std::vector<HeldStep>> ReplicaClient::List(const std::string& job, uint32_t owner,
                                                          FetchGrant* grant) {
  auto ctx = Context();
  pb::ListHeldRequest request;
  request.set_job(job);
  request.set_owner(owner);
  pb::ListHeldReply reply;
  CKPT_RETURN_IF_ERROR(group::FromGrpc(stub_->ListHeld(ctx.get(), request, &reply)));
  if (grant != nullptr) {
    grant->port = static_cast<int>(reply.fetch_port() <= 65535 ? reply.fetch_port() : 0);
    grant->ticket = reply.fetch_ticket();
  }
  std::vector<HeldStep> steps;
  for (const pb::HeldStepInfo& s : reply.steps()) {
    HeldStep held;
    held.job = job;
    held.owner = owner;
    held.step = s.step();
    held.fragments = static_cast<size_t>(s.pieces_size());
    held.sealed = s.sealed();
    held.run = s.run();
    held.k = s.k();
    held.m = s.m();
    held.uid = s.uid();
    for (const pb::HeldPiece& piece : s.pieces()) held.pieces.emplace_back(piece.rank(), piece.index());
    steps.push_back(std::move(held));
  }
  return steps;
}

absl::StatusOr<std::optional<ReplicaClient::JobOwnerAnswer>> ReplicaClient::JobOwner(
    const std::string& job, std::chrono::milliseconds timeout) {
  grpc::ClientContext ctx;
  ctx.AddMetadata(group::kTokenMetadata, token_);
  ctx.set_deadline(std::chrono::system_clock::now() + timeout);
  pb::JobOwnerRequest request;
  request.set_job(job);
  pb::JobOwnerReply reply;
  CKPT_RETURN_IF_ERROR(group::FromGrpc(stub_->JobOwner(&ctx, request, &reply)));
  if (!reply.known()) return std::optional<JobOwnerAnswer>();
  JobOwnerAnswer answer{reply.uid(), std::nullopt, reply.source().substr(0, 64)};
  if (reply.has_gid()) answer.gid = reply.gid();
  return std::optional<JobOwnerAnswer>(std::move(answer));
}

absl::StatusOr<std::string> ReplicaClient::GetManifest(const std::string& job, uint64_t step, uint32_t owner) {
  auto ctx = Context();
  pb::ManifestRequest request;
  request.set_job(job);
  request.set_step(step);
  request.set_owner(owner);
  pb::ManifestReply reply;
  CKPT_RETURN_IF_ERROR(group::FromGrpc(stub_->GetManifest(ctx.get(), request, &reply)));
  return std::move(*reply.mutable_manifest_json());
}

absl::StatusOr<HeldFragment> ReplicaClient::Get(const FragmentId& id, uint32_t k, uint64_t max_data_bytes) {
  auto ctx = Context();
  pb::FragmentRequest request;
  request.set_job(id.job);
  request.set_step(id.step);
  request.set_owner(id.owner);
  request.set_rank(id.rank);
  request.set_index(id.index);
  std::unique_ptr<grpc::ClientReader<pb::FragmentChunk>> reader = stub_->GetFragment(ctx.get(), request);
  pb::FragmentChunk chunk;
  HeldFragment f;
  bool started = false;
  size_t expected = 0;
  absl::Status wrong;
  while (wrong.ok() && reader->Read(&chunk)) {
    if (!started) {
      std::tie(f.id, f.meta) = FromHeader(chunk.header());
      // Refused before a byte more is read: what the restore can use is known.
      wrong = chunk.has_header() ? CheckServed(id, f.id, f.meta, k, max_data_bytes)
                                 : absl::DataLossError("the peer's first chunk has no header");
      if (!wrong.ok()) break;
      expected = ErasureCode::FragmentBytes(f.meta.data_bytes, static_cast<int>(f.meta.k));
      f.bytes.reserve(expected);  // bounded above: the caller's max_data_bytes
      started = true;
    }
    if (f.bytes.size() + chunk.data().size() > expected) {
      wrong = absl::DataLossError(fmt::format("the peer sent more than the fragment's {} bytes", expected));
      break;
    }
    f.bytes.append(chunk.data());
  }
  if (!wrong.ok()) {
    ctx->TryCancel();
    (void)reader->Finish();
    return wrong;
  }
  CKPT_RETURN_IF_ERROR(group::FromGrpc(reader->Finish()));
  if (!started || f.bytes.size() != expected || !ChecksumMatches(f.bytes.data(), f.bytes.size(), f.meta.checksum)) {
    return absl::DataLossError(fmt::format("fragment {} of job {} step {} rank {} from the peer is not whole or not "
                                           "what its checksum says",
                                           id.index, id.job, id.step, id.rank));
  }
  return f;
}

}  // namespace ckpt::replicate
