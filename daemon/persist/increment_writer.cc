#include "daemon/persist/increment_writer.h"

#include <fmt/format.h>

#include <algorithm>
#include <vector>

#include "common/dtype.h"
#include "common/log.h"
#include "common/status.h"
#include "format/checksum.h"
#include "format/increment.h"
#include "format/safetensors.h"

namespace ckpt::persist {
namespace {

constexpr uint64_t kBlock = 4096;          // the data region starts aligned, as a full shard's
constexpr uint64_t kWriteChunk = 32u << 20;

// The piece of tensor entry `i` as the planner takes it: placement, chunking, checksums.
absl::StatusOr<PieceToWrite> PieceOf(const daemon::StagedSnapshot& snap, size_t i, uint64_t target) {
  const format::TensorEntry& e = snap.shard.entries[i];
  const daemon::TensorPlacement& p = snap.placements[i];
  CKPT_ASSIGN_OR_RETURN(size_t itemsize, DTypeSize(e.dtype));
  PieceToWrite piece;
  piece.name = e.name;
  piece.dtype = e.dtype;
  piece.shape = e.shape;
  piece.flat = p.flat;
  if (p.flat.empty()) piece.offset = p.offset.empty() ? std::vector<int64_t>(e.shape.size(), 0) : p.offset;
  piece.bytes = e.end - e.begin;
  piece.chunk_bytes = PieceChunkBytes(e.shape, itemsize, !p.flat.empty(), target, /*sparse=*/false);
  const char* data = snap.shard.data + e.begin;
  // One pass over memory: each chunk hashed on its own and into the whole while it is in cache.
  format::Checksum whole;
  for (uint64_t c = 0, n = format::PieceChunks(piece.bytes, piece.chunk_bytes); c < n; ++c) {
    const auto [lo, hi] = format::ChunkSpan(piece.bytes, piece.chunk_bytes, c, c + 1);
    piece.chunk_checksums.push_back(format::Checksum64(data + lo, hi - lo));
    whole.Update(data + lo, hi - lo);
  }
  piece.checksum = whole.Finish();
  return piece;
}

}  // namespace

IncrementWriter::IncrementWriter(format::CheckpointStore& store, IncrementBases& bases, RetentionKeeper& retention,
                                 IncrementOptions options, std::function<void()> between_chunks)
    : store_(store), bases_(bases), retention_(retention), options_(options),
      between_chunks_(std::move(between_chunks)) {}

absl::StatusOr<WrittenShard> IncrementWriter::Write(const daemon::StagedSnapshot& snap, const std::string& dir) {
  const StagedShard& shard = snap.shard;

  // The base, pinned first, then checked to be still committed as it was: retention can
  // take neither it nor what it references (kept steps' origins) from here until this
  // step ends. A base that went meanwhile (deleted, retired, saved again) makes a full save.
  std::optional<IncrementBases::Base> base = bases_.Get(snap.job, snap.rank, snap.session_started_unix_ns);
  std::shared_ptr<RetentionKeeper::Pin> pin;
  if (base) {
    pin = std::make_shared<RetentionKeeper::Pin>(retention_, snap.job, base->base->step);
    absl::StatusOr<std::vector<std::pair<uint64_t, uint64_t>>> committed = store_.ListRunsAndSteps(snap.job);
    const std::pair<uint64_t, uint64_t> wanted{base->base->run, base->base->step};
    if (!committed.ok() || std::find(committed->begin(), committed->end(), wanted) == committed->end()) {
      base.reset();
      pin.reset();
    }
  }

  RankWrite write{snap.step, snap.rank, format::TaggedShardFileName(snap.rank, snap.session_started_unix_ns), {}, {}};
  // Which chunks changed is known once they are hashed, and the header lists the file's
  // entries: each piece is hashed as soon as it has landed (overlapping the copy of the
  // next), and the file is written once every one has.
  for (size_t i = 0; i < snap.tensor_count; ++i) {
    if (shard.landed != nullptr) CKPT_RETURN_IF_ERROR(shard.landed->WaitFor(shard.entries[i].end));
    CKPT_ASSIGN_OR_RETURN(PieceToWrite piece, PieceOf(snap, i, options_.chunk_bytes));
    write.pieces.push_back(std::move(piece));
    if (between_chunks_) between_chunks_();
  }
  if (shard.landed != nullptr) CKPT_RETURN_IF_ERROR(shard.landed->WaitFor(shard.data_bytes));
  for (size_t i = snap.tensor_count; i < shard.entries.size(); ++i) {
    const format::TensorEntry& e = shard.entries[i];
    write.train_state.push_back({snap.train_state_names[i - snap.tensor_count], e.end - e.begin,
                                 format::Checksum64(shard.data + e.begin, e.end - e.begin)});
  }
  PlanOptions plan_options;
  plan_options.rebase = base && RebaseDue(base->saves_since_full, options_.full_every);
  CKPT_ASSIGN_OR_RETURN(RankWritePlan plan, PlanRankWrite(base ? base->base.get() : nullptr, write, plan_options));
  bases_.Planned(snap.job, snap.rank, snap.session_started_unix_ns, snap.step, plan.mode);
  log::Get(log::Component::kPersist)
      .debug("[{} s{}] r{} {}", snap.job, snap.step, snap.rank, plan.reason);

  // The file as planned: its entries in order, each from where its source is in staging.
  std::vector<format::TensorEntry> entries;
  entries.reserve(plan.entries.size());
  for (const PlannedEntry& pe : plan.entries) {
    entries.push_back({pe.name, pe.dtype, pe.shape, pe.at, pe.at + (pe.end - pe.begin)});
  }
  const std::string header = format::EncodeHeader(entries, shard.metadata, kBlock);
  WrittenShard out;
  out.file = write.file;
  const std::string key = dir + "/" + out.file;
  absl::Status written = [&]() -> absl::Status {
    CKPT_ASSIGN_OR_RETURN(std::unique_ptr<storage::ObjectWriter> object, store_.objects().Create(key));
    CKPT_RETURN_IF_ERROR(object->Append(header.data(), header.size()));
    for (const PlannedEntry& pe : plan.entries) {
      const size_t source = pe.train_state ? snap.tensor_count + pe.index : pe.index;
      const char* from = shard.data + shard.entries[source].begin + pe.begin;
      for (uint64_t off = 0; off < pe.end - pe.begin; off += kWriteChunk) {
        if (between_chunks_) between_chunks_();
        CKPT_RETURN_IF_ERROR(object->Append(from + off, std::min(kWriteChunk, pe.end - pe.begin - off)));
      }
    }
    CKPT_ASSIGN_OR_RETURN(out.bytes, object->Finish());
    return absl::OkStatus();
  }();
  if (!written.ok()) {
    const std::string where = store_.objects().Describe(key);
    return Message(written).find(where) == std::string::npos ? Annotate(written, where) : written;
  }
  out.plan = std::make_shared<const RankWritePlan>(std::move(plan));
  out.base_pin = std::move(pin);
  return out;
}

}  // namespace ckpt::persist
