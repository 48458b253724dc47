#include "daemon/persist/increment_writer.h"

#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <optional>
#include <vector>

#include "common/dtype.h"
#include "common/log.h"
#include "common/status.h"
#include "daemon/persist/run_appender.h"
#include "format/checksum.h"
#include "format/increment.h"
#include "format/safetensors.h"

namespace ckpt::persist {
namespace {

constexpr uint64_t kBlock = 4096;          // the data region starts aligned, as a full shard's

using KnownSums = std::function<std::optional<daemon::FrozenChecksums>(uint64_t chunk_bytes)>;

// How a snapshot's pieces are chunked: --increment-chunk-bytes, and what a sparse piece's
// share of its node's budget of sparse chunks depends on (increment_chunks.h).
struct ChunkPolicy {
  uint64_t target = 0;
  uint64_t rank_sparse_bytes = 0;  // of every sparse piece of the snapshot
  uint32_t local_ranks = 1;
};

ChunkPolicy PolicyOf(const daemon::StagedSnapshot& snap, uint64_t target) {
  ChunkPolicy policy{target, 0, std::max<uint32_t>(snap.local_ranks, 1)};
  for (size_t i = 0; i < snap.sparse.size() && i < snap.tensor_count; ++i) {
    if (snap.sparse[i]) policy.rank_sparse_bytes += snap.shard.entries[i].end - snap.shard.entries[i].begin;
  }
  return policy;
}

// The piece of tensor entry `i` without its checksums: placement and chunking.
absl::StatusOr<PieceToWrite> PieceShape(const daemon::StagedSnapshot& snap, size_t i, const ChunkPolicy& policy) {
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
  const bool sparse = i < snap.sparse.size() && snap.sparse[i];
  piece.chunk_bytes =
      PieceChunkBytes(e.shape, itemsize, !p.flat.empty(), policy.target, sparse,
                      sparse ? SparsePieceMaxChunks(piece.bytes, policy.rank_sparse_bytes, policy.local_ranks)
                             : format::kMaxPieceChunks);
  return piece;
}

// The piece of tensor entry `i` as the planner takes it: placement, chunking, checksums.
// `known`: the checksums of a frozen piece's bytes in chunks of that size, when an earlier
// snapshot's writer computed them: its bytes are then neither waited for (`wait`) nor read.
absl::StatusOr<PieceToWrite> PieceOf(const daemon::StagedSnapshot& snap, size_t i, const ChunkPolicy& policy,
                                     const KnownSums& known, const std::function<absl::Status()>& wait) {
  CKPT_ASSIGN_OR_RETURN(PieceToWrite piece, PieceShape(snap, i, policy));
  const format::TensorEntry& e = snap.shard.entries[i];
  if (std::optional<daemon::FrozenChecksums> sums = known(piece.chunk_bytes)) {
    piece.chunk_checksums = std::move(sums->chunks);
    piece.checksum = std::move(sums->whole);
    return piece;
  }
  CKPT_RETURN_IF_ERROR(wait());
  const char* data = snap.shard.Data(e);
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

// The safetensors header of the own file `plan` lays out.
std::string HeaderOf(const RankWritePlan& plan, const std::map<std::string, std::string>& metadata) {
  std::vector<format::TensorEntry> entries;
  entries.reserve(plan.entries.size());
  for (const PlannedEntry& pe : plan.entries) {
    entries.push_back({pe.name, pe.dtype, pe.shape, pe.at, pe.at + (pe.end - pe.begin)});
  }
  return format::EncodeHeader(entries, metadata, kBlock);
}

// The trainer asked for a full save (kFullSaveKey in the snapshot metadata).
bool AskedFull(const daemon::StagedSnapshot& snap) {
  auto it = snap.shard.metadata.find(kFullSaveKey);
  return it != snap.shard.metadata.end() && it->second == "1";
}

// Waits until tensor entry `i`'s bytes are in staging memory. A frozen entry shared with an
// earlier snapshot was in place when the snapshot was laid out.
absl::Status WaitForEntry(const daemon::StagedSnapshot& snap, size_t i) {
  const daemon::StagedShard& shard = snap.shard;
  if (shard.landed == nullptr || (!snap.frozen.empty() && snap.frozen[i].shared)) return absl::OkStatus();
  return shard.landed->WaitFor(shard.entries[i].end);
}

// Waits until frozen entry `i`'s generation is set: a shared entry's was when the snapshot was
// laid out; a copied one's once every byte has landed (the stager sets it just before the last).
absl::Status WaitForGeneration(const daemon::StagedSnapshot& snap, size_t i) {
  if (snap.shard.landed == nullptr || snap.frozen[i].shared) return absl::OkStatus();
  return snap.shard.landed->WaitFor(snap.shard.data_bytes);
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
  // Asked for (CheckpointManager.save(full=True): the snapshot's metadata says so): every
  // piece whole, as with no base, and a new cycle of --full-every starts.
  if (!base || base->mostly_changed || AskedFull(snap)) {
    CKPT_ASSIGN_OR_RETURN(WrittenShard out, Stream(snap, dir, base ? base->base.get() : nullptr, std::move(write)));
    out.base_pin = std::move(pin);
    return out;
  }
  // Which chunks changed is known once they are hashed, and the header lists the file's
  // entries: each piece is hashed as soon as it has landed (overlapping the copy of the
  // next), and the file is written once every one has.
  // A frozen piece's checksums are computed once per generation of its bytes (frozen_sums.h):
  // a piece whose are known is neither waited for nor read.
  const ChunkPolicy policy = PolicyOf(snap, options_.chunk_bytes);
  const bool has_frozen = !snap.frozen.empty() && snap.frozen_sums != nullptr;
  for (size_t i = 0; i < snap.tensor_count; ++i) {
    if (has_frozen && snap.frozen[i].frozen) CKPT_RETURN_IF_ERROR(WaitForGeneration(snap, i));
    const bool frozen = has_frozen && snap.frozen[i].frozen && snap.frozen[i].generation != 0;
    KnownSums known = [&](uint64_t chunk_bytes) -> std::optional<daemon::FrozenChecksums> {
      if (!frozen) return std::nullopt;
      return snap.frozen_sums->Find(snap.frozen[i].generation, chunk_bytes);
    };
    CKPT_ASSIGN_OR_RETURN(PieceToWrite piece,
                          PieceOf(snap, i, policy, known, [&] { return WaitForEntry(snap, i); }));
    if (frozen) {
      snap.frozen_sums->Put(snap.frozen[i].generation, piece.chunk_bytes, {piece.chunk_checksums, piece.checksum});
    }
    write.pieces.push_back(std::move(piece));
    if (between_chunks_) between_chunks_();
  }
  if (shard.landed != nullptr) CKPT_RETURN_IF_ERROR(shard.landed->WaitFor(shard.data_bytes));
  for (size_t i = snap.tensor_count; i < shard.entries.size(); ++i) {
    const format::TensorEntry& e = shard.entries[i];
    write.train_state.push_back({snap.train_state_names[i - snap.tensor_count], e.end - e.begin,
                                 format::Checksum64(shard.Data(e), e.end - e.begin)});
  }
  PlanOptions plan_options;
  plan_options.rebase = base && RebaseDue(base->saves_since_full, options_.full_every);
  CKPT_ASSIGN_OR_RETURN(RankWritePlan plan, PlanRankWrite(base ? base->base.get() : nullptr, write, plan_options));
  // The file as planned: its entries in order, each from where its source is in staging.
  const std::string header = HeaderOf(plan, shard.metadata);
  if (absl::Status fits = format::CheckHeaderFits(header, plan.entries.size(), write.file, options_.max_header_bytes);
      !fits.ok()) {
    // Changed runs scattered over many pieces (a sparse table's rows) can list more
    // entries than a safetensors header may hold; the rank's pieces whole have far fewer.
    log::Get(log::Component::kPersist)
        .warn("[{} s{}] r{} written whole: {}", snap.job, snap.step, snap.rank, Message(fits));
    RankWrite whole{snap.step, snap.rank, write.file, {}, {}};
    CKPT_ASSIGN_OR_RETURN(WrittenShard out, Stream(snap, dir, base->base.get(), std::move(whole)));
    out.base_pin = std::move(pin);
    return out;
  }
  bases_.Planned(snap.job, snap.rank, snap.session_started_unix_ns, snap.step, plan.mode,
                 MostlyChanged(plan, write));
  log::Get(log::Component::kPersist)
      .debug("[{} s{}] r{} {}", snap.job, snap.step, snap.rank, plan.reason);
  WrittenShard out;
  out.file = write.file;
  const std::string key = dir + "/" + out.file;
  CKPT_ASSIGN_OR_RETURN(out.bytes, WriteFile(key, header, [&](RunAppender& appender) -> absl::Status {
    for (const PlannedEntry& pe : plan.entries) {
      const size_t source = pe.train_state ? snap.tensor_count + pe.index : pe.index;
      CKPT_RETURN_IF_ERROR(appender.Add(shard.Data(shard.entries[source]) + pe.begin, pe.end - pe.begin));
    }
    return absl::OkStatus();
  }));
  out.plan = std::make_shared<const RankWritePlan>(std::move(plan));
  out.base_pin = std::move(pin);
  return out;
}

absl::StatusOr<uint64_t> IncrementWriter::WriteFile(const std::string& key, const std::string& header,
                                                    const std::function<absl::Status(RunAppender&)>& body) {
  absl::StatusOr<uint64_t> written = [&]() -> absl::StatusOr<uint64_t> {
    CKPT_ASSIGN_OR_RETURN(std::unique_ptr<storage::ObjectWriter> object, store_.objects().Create(key));
    CKPT_RETURN_IF_ERROR(object->Append(header.data(), header.size()));
    RunAppender appender(*object, between_chunks_);
    CKPT_RETURN_IF_ERROR(body(appender));
    CKPT_RETURN_IF_ERROR(appender.Flush());
    return object->Finish();
  }();
  if (written.ok()) return written;
  const std::string where = store_.objects().Describe(key);
  return Message(written.status()).find(where) == std::string::npos ? Annotate(written.status(), where)
                                                                      : written.status();
}

bool IncrementWriter::MostlyChanged(const RankWritePlan& plan, const RankWrite& write) {
  uint64_t total = 0;
  for (const PieceToWrite& p : write.pieces) total += p.bytes;
  return plan.changed_bytes * 2 > total;
}

absl::StatusOr<WrittenShard> IncrementWriter::Stream(const daemon::StagedSnapshot& snap, const std::string& dir,
                                                     const RankBase* base, RankWrite write) {
  const StagedShard& shard = snap.shard;
  // Laid out before a byte is hashed: every piece whole, in staging order, then the train
  // state (the planner with no base), with checksums filled in as the bytes go out.
  const ChunkPolicy policy = PolicyOf(snap, options_.chunk_bytes);
  for (size_t i = 0; i < snap.tensor_count; ++i) {
    CKPT_ASSIGN_OR_RETURN(PieceToWrite piece, PieceShape(snap, i, policy));
    piece.chunk_checksums.assign(format::PieceChunks(piece.bytes, piece.chunk_bytes), 0);
    write.pieces.push_back(std::move(piece));
  }
  for (size_t i = snap.tensor_count; i < shard.entries.size(); ++i) {
    const format::TensorEntry& e = shard.entries[i];
    write.train_state.push_back({snap.train_state_names[i - snap.tensor_count], e.end - e.begin, 0});
  }
  CKPT_ASSIGN_OR_RETURN(RankWritePlan plan, PlanRankWrite(nullptr, write, {}));
  const std::string header = HeaderOf(plan, shard.metadata);
  CKPT_RETURN_IF_ERROR(format::CheckHeaderFits(header, plan.entries.size(),
                                               store_.objects().Describe(dir + "/" + write.file),
                                               options_.max_header_bytes));
  WrittenShard out;
  out.file = write.file;
  CKPT_ASSIGN_OR_RETURN(out.bytes, WriteFile(dir + "/" + out.file, header, [&](RunAppender& appender) -> absl::Status {
    for (const PlannedEntry& pe : plan.entries) {
      if (pe.train_state) {
        if (shard.landed != nullptr) CKPT_RETURN_IF_ERROR(shard.landed->WaitFor(shard.data_bytes));
        const format::TensorEntry& e = shard.entries[snap.tensor_count + pe.index];
        BlobToWrite& blob = write.train_state[pe.index];
        blob.checksum = format::Checksum64(shard.Data(e), blob.bytes);
        plan.train_state[blob.name].checksum = format::ChecksumText(blob.checksum);
        CKPT_RETURN_IF_ERROR(appender.Add(shard.Data(e), blob.bytes));
        continue;
      }
      // Each chunk hashed and appended while it is in cache, as a full shard's.
      CKPT_RETURN_IF_ERROR(WaitForEntry(snap, pe.index));
      PieceToWrite& piece = write.pieces[pe.index];
      const char* data = shard.Data(shard.entries[pe.index]);
      format::Checksum whole;
      for (uint64_t c = 0; c < piece.chunk_checksums.size(); ++c) {
        const auto [lo, hi] = format::ChunkSpan(piece.bytes, piece.chunk_bytes, c, c + 1);
        piece.chunk_checksums[c] = format::Checksum64(data + lo, hi - lo);
        whole.Update(data + lo, hi - lo);
        CKPT_RETURN_IF_ERROR(appender.Add(data + lo, hi - lo));
      }
      piece.checksum = whole.Finish();
      format::TensorShard& saved = plan.pieces[pe.index].shard;
      // As the planner lays a piece out: a piece of one chunk lists none (its checksum is it).
      saved.chunk_checksums.clear();
      if (piece.chunk_checksums.size() > 1) {
        for (uint64_t sum : piece.chunk_checksums) saved.chunk_checksums.push_back(format::ChecksumText(sum));
      }
      saved.checksum = piece.checksum;
      const bool frozen = !snap.frozen.empty() && snap.frozen[pe.index].frozen;
      if (frozen) CKPT_RETURN_IF_ERROR(WaitForGeneration(snap, pe.index));
      if (frozen && snap.frozen[pe.index].generation != 0) {
        snap.frozen_sums->Put(snap.frozen[pe.index].generation, piece.chunk_bytes,
                              {piece.chunk_checksums, piece.checksum});
      }
    }
    // The last byte lands only once the trainer is released (Stager): a snapshot it abandoned
    // during the copy fails here, not committed with torn tensors, even when its last entries
    // were never waited for (frozen ones shared from an earlier snapshot).
    if (shard.landed != nullptr) CKPT_RETURN_IF_ERROR(shard.landed->WaitFor(shard.data_bytes));
    return absl::OkStatus();
  }));
  // How much changed since the base tells the rank's next save whether to plan or stream.
  bool mostly_changed = false;
  if (base != nullptr) {
    absl::StatusOr<RankWritePlan> compared = PlanRankWrite(base, write, {});
    if (compared.ok()) {
      plan.changed_bytes = compared->changed_bytes;
      mostly_changed = MostlyChanged(plan, write);
    }
  }
  plan.reason = AskedFull(snap)   ? "full, streamed: asked for"
                : base == nullptr ? "full, streamed: no base"
                                  : fmt::format("full, streamed ({} of {} piece bytes changed since the base)",
                                              plan.changed_bytes, plan.data_bytes);
  bases_.Planned(snap.job, snap.rank, snap.session_started_unix_ns, snap.step, plan.mode, mostly_changed);
  log::Get(log::Component::kPersist).debug("[{} s{}] r{} {}", snap.job, snap.step, snap.rank, plan.reason);
  out.plan = std::make_shared<const RankWritePlan>(std::move(plan));
  return out;
}

}  // namespace ckpt::persist
