#include "daemon/persist/increment_plan.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <set>

#include "common/dtype.h"
#include "format/checksum.h"

namespace ckpt::persist {
namespace {

// A run of a piece's chunks [c0, c1): written in this step's file (own), or referenced in
// base file `file` from byte `at`.
struct Run {
  uint32_t c0 = 0, c1 = 0;
  bool own = true;
  uint32_t file = 0;
  uint64_t at = 0;
};

struct PieceWork {
  const PieceToWrite* in = nullptr;
  size_t itemsize = 0;
  uint64_t chunks = 0;
  const PieceBase* base = nullptr;  // null: written whole, for `why`
  std::string why;
  std::vector<bool> changed;
  uint64_t changed_bytes = 0;
  // This round's decision.
  bool whole = true;
  std::vector<Run> runs;
};

uint64_t Percent(uint64_t part, uint64_t whole) { return whole == 0 ? 0 : part * 100 / whole; }

uint64_t SpanBytes(const PieceWork& p, uint64_t c0, uint64_t c1) {
  auto [lo, hi] = format::ChunkSpan(p.in->bytes, p.in->chunk_bytes, c0, c1);
  return hi - lo;
}

// Why a base piece cannot be compared with `in`, or empty when it can.
std::string Unlike(const PieceToWrite& in, const PieceBase& base) {
  if (in.dtype != base.dtype) return fmt::format("dtype {}, its base's {}", in.dtype, base.dtype);
  if (in.shape != base.shape) return fmt::format("shape [{}], its base's [{}]", fmt::join(in.shape, ", "), fmt::join(base.shape, ", "));
  if (in.offset != base.offset || in.flat != base.flat) return "placed elsewhere than its base";
  if (in.chunk_bytes != base.chunk_bytes) {
    return fmt::format("chunks of {} bytes, its base's of {}", in.chunk_bytes, base.chunk_bytes);
  }
  return {};
}

absl::Status CheckPiece(const PieceToWrite& in, size_t* itemsize) {
  absl::StatusOr<size_t> size = DTypeSize(in.dtype);
  if (!size.ok()) return size.status();
  *itemsize = *size;
  absl::Status bytes = CheckTensorBytes(in.name, in.dtype, in.shape, in.bytes);
  if (!bytes.ok()) return bytes;
  if (in.chunk_bytes == 0 || in.chunk_bytes % *size != 0) {
    return absl::InvalidArgumentError(fmt::format("tensor {}: chunk_bytes {} is not a positive multiple of {}'s {} bytes",
                                                  in.name, in.chunk_bytes, in.dtype, *size));
  }
  const uint64_t chunks = format::PieceChunks(in.bytes, in.chunk_bytes);
  if (chunks > format::kMaxReadPieceChunks) {
    return absl::InvalidArgumentError(fmt::format("tensor {}: {} chunks, more than the {} a piece may have", in.name,
                                                  chunks, format::kMaxReadPieceChunks));
  }
  if (in.chunk_checksums.size() != chunks) {
    return absl::InvalidArgumentError(fmt::format("tensor {}: {} chunk checksums for {} chunks of {} bytes", in.name,
                                                  in.chunk_checksums.size(), chunks, in.chunk_bytes));
  }
  return absl::OkStatus();
}

// Own runs of changed (or dropped) chunks, and references merged while contiguous in one
// entry of one file.
std::vector<Run> RunsOf(const PieceWork& p, const std::vector<bool>& dropped) {
  const std::vector<ChunkWhere>& where = p.base->chunks;
  auto own = [&](uint64_t c) { return p.changed[c] || dropped[where[c].file]; };
  std::vector<Run> runs;
  for (uint64_t c = 0; c < p.chunks;) {
    uint64_t e = c + 1;
    if (own(c)) {
      while (e < p.chunks && own(e)) ++e;
      runs.push_back({static_cast<uint32_t>(c), static_cast<uint32_t>(e), true, 0, 0});
    } else {
      while (e < p.chunks && !own(e) && where[e].continues && where[e].file == where[c].file &&
             where[e].at == where[c].at + (e - c) * p.in->chunk_bytes) {
        ++e;
      }
      runs.push_back({static_cast<uint32_t>(c), static_cast<uint32_t>(e), false, where[c].file, where[c].at});
    }
    c = e;
  }
  return runs;
}

// `runs` with every referenced run of at most `t` chunks written again (own), merged with the
// own runs beside it.
std::vector<Run> Rewritten(const std::vector<Run>& runs, uint32_t t) {
  std::vector<Run> out;
  for (const Run& r : runs) {
    const bool own = r.own || r.c1 - r.c0 <= t;
    if (own && !out.empty() && out.back().own) {
      out.back().c1 = r.c1;
    } else {
      out.push_back(own ? Run{r.c0, r.c1, true, 0, 0} : r);
    }
  }
  return out;
}

// A piece updated sparsely (rows of an embedding changed at random) splits into more extents
// from step to step, as its chunks come to live in more files. Past `limit`, the shortest
// referenced runs are written again, the fewest that bring it within: the least length t such
// that rewriting the referenced runs of at most t chunks leaves `limit` runs or fewer (the run
// count only falls as t grows).
std::vector<Run> WithinLimit(const std::vector<Run>& runs, uint64_t limit) {
  uint32_t lo = 0, hi = 0;
  for (const Run& r : runs) {
    if (!r.own) hi = std::max(hi, r.c1 - r.c0);
  }
  while (lo < hi) {  // Rewritten(runs, hi) is one own run: it fits
    const uint32_t mid = lo + (hi - lo) / 2;
    if (Rewritten(runs, mid).size() <= limit) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return Rewritten(runs, lo);
}

void Decide(PieceWork& p, const std::vector<bool>& dropped) {
  p.runs.clear();
  p.whole = true;
  if (p.base == nullptr) return;
  std::vector<Run> runs = RunsOf(p, dropped);
  auto own_bytes = [&] {
    uint64_t own = 0;
    for (const Run& r : runs) own += r.own ? SpanBytes(p, r.c0, r.c1) : 0;
    return own;
  };
  uint64_t own = own_bytes();
  const uint64_t limit = std::max<uint64_t>(kMinExtentLimit, p.chunks / 2);
  if (own * 2 > p.in->bytes) {
    p.why = own == p.changed_bytes ? fmt::format("{}% changed", Percent(own, p.in->bytes))
                                   : fmt::format("{}% changed or in files the rebase drops", Percent(own, p.in->bytes));
    return;
  }
  std::string rewritten;
  if (runs.size() > limit) {
    const size_t needed = runs.size();
    runs = WithinLimit(runs, limit);
    own = own_bytes();
    if (own * 2 > p.in->bytes) {
      p.why = fmt::format("{} extents, more than {}", needed, limit);
      return;
    }
    rewritten = fmt::format(" ({} needed, more than {}: the shortest references written again)", needed, limit);
  }
  p.whole = false;
  p.why = fmt::format("{} extent{}{}", runs.size(), runs.size() == 1 ? "" : "s", rewritten);
  p.runs = std::move(runs);
}

// The blobs referenced this round: index into write.train_state -> base blob.
std::map<size_t, const BlobWhere*> ReferencedBlobs(const RankBase* base, const RankWrite& write,
                                                   const PlanOptions& options, const std::vector<bool>& dropped) {
  std::map<size_t, const BlobWhere*> out;
  if (base == nullptr || options.full) return out;
  for (size_t i = 0; i < write.train_state.size(); ++i) {
    const BlobToWrite& blob = write.train_state[i];
    auto it = base->train_state.find(blob.name);
    if (blob.bytes < kReferencedBlobMinBytes || it == base->train_state.end()) continue;
    if (it->second.checksum != blob.checksum || it->second.bytes != blob.bytes || dropped[it->second.file]) continue;
    out[i] = &it->second;
  }
  return out;
}

// Bytes this round references in each base file.
std::vector<uint64_t> LiveBytes(const RankBase& base, const std::vector<PieceWork>& work,
                                const std::map<size_t, const BlobWhere*>& blobs, const RankWrite& write) {
  std::vector<uint64_t> live(base.files.size(), 0);
  for (const PieceWork& p : work) {
    for (const Run& r : p.runs) live[r.file] += r.own ? 0 : SpanBytes(p, r.c0, r.c1);
  }
  for (const auto& [i, where] : blobs) live[where->file] += write.train_state[i].bytes;
  return live;
}

// A rebase's next round: drops the files less than half live and those beyond the
// kRebaseMaxOrigins liveliest; false when it dropped none.
bool DropDeadFiles(const RankBase& base, const std::vector<uint64_t>& live, std::vector<bool>& dropped) {
  bool more = false;
  std::vector<uint32_t> kept;
  for (uint32_t i = 0; i < base.files.size(); ++i) {
    if (dropped[i] || live[i] == 0) continue;
    if (live[i] * 2 < base.files[i].bytes) {
      dropped[i] = more = true;
    } else {
      kept.push_back(i);
    }
  }
  // Liveliest first: the larger live fraction, then the newer step.
  std::sort(kept.begin(), kept.end(), [&](uint32_t a, uint32_t b) {
    const auto fa = static_cast<unsigned __int128>(live[a]) * base.files[b].bytes;
    const auto fb = static_cast<unsigned __int128>(live[b]) * base.files[a].bytes;
    return fa != fb ? fa > fb : base.files[a].step > base.files[b].step;
  });
  for (size_t k = kRebaseMaxOrigins; k < kept.size(); ++k) dropped[kept[k]] = more = true;
  return more;
}

std::vector<int64_t> DeltaShape(const PieceWork& p, uint64_t bytes) {
  const PieceToWrite& in = *p.in;
  if (in.flat.empty() && in.shape.size() >= 2 && in.shape[0] > 0) {
    const uint64_t row_bytes = in.bytes / static_cast<uint64_t>(in.shape[0]);
    if (row_bytes > 0 && in.chunk_bytes % row_bytes == 0) {
      std::vector<int64_t> shape = in.shape;
      shape[0] = static_cast<int64_t>(bytes / row_bytes);
      return shape;
    }
  }
  return {static_cast<int64_t>(bytes / p.itemsize)};
}

// The manifest's piece, whole or by extents, and its own entries appended to the plan.
PlannedPiece Lay(const PieceWork& p, size_t index, const RankBase* base, const RankWrite& write,
                 RankWritePlan& plan, std::set<uint32_t>& used) {
  const PieceToWrite& in = *p.in;
  PlannedPiece out;
  out.whole = p.whole;
  out.why = p.why;
  format::TensorShard& s = out.shard;
  s.rank = write.rank;
  s.offset = in.offset;
  s.shape = in.shape;
  s.flat = in.flat;
  s.checksum = in.checksum;
  s.chunk_bytes = in.chunk_bytes;
  if (p.chunks > 1) {
    for (uint64_t sum : in.chunk_checksums) s.chunk_checksums.push_back(format::ChecksumText(sum));
  }
  if (p.whole) {
    s.file = write.file;
    s.begin = plan.data_bytes;
    s.end = s.begin + in.bytes;
    plan.entries.push_back({in.name, in.dtype, in.shape, false, index, 0, in.bytes, s.begin});
    plan.data_bytes = s.end;
    return out;
  }
  for (const Run& r : p.runs) {
    auto [lo, hi] = format::ChunkSpan(in.bytes, in.chunk_bytes, r.c0, r.c1);
    if (r.own) {
      plan.entries.push_back({format::DeltaEntryName(in.name, r.c0, r.c1), in.dtype, DeltaShape(p, hi - lo), false,
                              index, lo, hi, plan.data_bytes});
      s.extents.push_back({r.c0, r.c1, std::nullopt, plan.data_bytes});
      plan.data_bytes += hi - lo;
    } else {
      s.extents.push_back({r.c0, r.c1, base->files[r.file].step, r.at});
      plan.referenced_bytes += hi - lo;
      used.insert(r.file);
    }
  }
  return out;
}

std::string FullReason(const RankBase* base, const PlanOptions& options, const std::vector<PieceWork>& work) {
  if (base == nullptr) return "full: no base";
  if (options.full) return "full: asked for";
  uint64_t changed = 0, total = 0;
  for (const PieceWork& p : work) {
    if (p.base == nullptr) return fmt::format("full: tensor {}: {}", p.in->name, p.why);
    changed += p.changed_bytes;
    total += p.in->bytes;
  }
  return fmt::format("full: {}% changed", Percent(changed, total));
}

}  // namespace

bool RebaseDue(uint32_t saves_since, uint32_t full_every) {
  return full_every != 0 && uint64_t{saves_since} + 1 >= full_every;
}

const char* WriteModeName(WriteMode mode) {
  switch (mode) {
    case WriteMode::kFull:
      return "full";
    case WriteMode::kIncrement:
      return "increment";
    case WriteMode::kRebase:
      return "rebase";
  }
  return "?";
}

absl::StatusOr<RankWritePlan> PlanRankWrite(const RankBase* base, const RankWrite& write, const PlanOptions& options) {
  if (base != nullptr && base->rank != write.rank) {
    return absl::InvalidArgumentError(
        fmt::format("rank {}'s write planned against rank {}'s base (step {})", write.rank, base->rank, base->step));
  }
  std::vector<PieceWork> work(write.pieces.size());
  std::set<std::string> names;
  for (size_t i = 0; i < write.pieces.size(); ++i) {
    PieceWork& p = work[i];
    p.in = &write.pieces[i];
    absl::Status ok = CheckPiece(*p.in, &p.itemsize);
    if (!ok.ok()) return ok;
    if (!names.insert(p.in->name).second) {
      return absl::InvalidArgumentError(fmt::format("tensor {} is written twice by rank {}", p.in->name, write.rank));
    }
    p.chunks = p.in->chunk_checksums.size();
    p.changed_bytes = p.in->bytes;  // unless compared with a base below
    if (base == nullptr) {
      p.why = "no base";
      continue;
    }
    auto it = base->pieces.find(p.in->name);
    if (it == base->pieces.end()) {
      p.why = "new";
      continue;
    }
    if (p.why = Unlike(*p.in, it->second); !p.why.empty()) continue;
    // Compared even when written whole as asked: the changed fraction is for the writer.
    p.changed.resize(p.chunks);
    p.changed_bytes = 0;
    for (uint64_t c = 0; c < p.chunks; ++c) {
      p.changed[c] = p.in->chunk_checksums[c] != it->second.chunks[c].checksum;
      if (p.changed[c]) p.changed_bytes += SpanBytes(p, c, c + 1);
    }
    if (options.full) {
      p.why = "asked for";
      continue;
    }
    p.base = &it->second;
  }
  // No file of this very step is referenced (a step saved again on top of its own base).
  std::vector<bool> dropped(base == nullptr ? 0 : base->files.size(), false);
  for (size_t i = 0; i < dropped.size(); ++i) dropped[i] = base->files[i].step == write.step;
  // Decide; a rebase drops the files that decision leaves mostly dead, and decides again,
  // until no more are dropped (each round only drops, so at most one round per file).
  std::map<size_t, const BlobWhere*> blobs;
  size_t files_dropped = 0;
  while (true) {
    for (PieceWork& p : work) Decide(p, dropped);
    blobs = ReferencedBlobs(base, write, options, dropped);
    if (!options.rebase || base == nullptr) break;
    if (!DropDeadFiles(*base, LiveBytes(*base, work, blobs, write), dropped)) break;
  }
  for (size_t i = 0; i < dropped.size(); ++i) files_dropped += dropped[i] && base->files[i].step != write.step;

  RankWritePlan plan;
  for (const PieceWork& p : work) plan.changed_bytes += p.changed_bytes;
  std::set<uint32_t> used;
  for (size_t i = 0; i < work.size(); ++i) {
    plan.pieces.push_back(Lay(work[i], i, base, write, plan, used));
  }
  for (size_t i = 0; i < write.train_state.size(); ++i) {
    const BlobToWrite& blob = write.train_state[i];
    format::TrainStateEntry& entry = plan.train_state[blob.name];
    entry.checksum = format::ChecksumText(blob.checksum);
    if (auto it = blobs.find(i); it != blobs.end()) {
      entry.step = base->files[it->second->file].step;
      entry.begin = it->second->at;
      entry.end = entry.begin + blob.bytes;
      plan.referenced_bytes += blob.bytes;
      used.insert(it->second->file);
      continue;
    }
    entry.begin = plan.data_bytes;
    entry.end = entry.begin + blob.bytes;
    plan.entries.push_back({format::TrainStateKey(blob.name), "U8", {static_cast<int64_t>(blob.bytes)}, true, i, 0,
                            blob.bytes, entry.begin});
    plan.data_bytes = entry.end;
  }
  for (uint32_t f : used) plan.origins.push_back(base->files[f]);
  std::sort(plan.origins.begin(), plan.origins.end(),
            [](const format::Origin& a, const format::Origin& b) { return a.step < b.step; });

  if (used.empty()) {
    plan.mode = WriteMode::kFull;
    plan.reason = FullReason(base, options, work);
    return plan;
  }
  plan.mode = options.rebase ? WriteMode::kRebase : WriteMode::kIncrement;
  const uint64_t total = plan.data_bytes + plan.referenced_bytes;
  plan.reason = fmt::format("{}: {}% written ({} of {} bytes), {} referenced in {} file{}", WriteModeName(plan.mode),
                            Percent(plan.data_bytes, total), plan.data_bytes, total, plan.referenced_bytes,
                            plan.origins.size(), plan.origins.size() == 1 ? "" : "s");
  if (plan.mode == WriteMode::kRebase) {
    plan.reason += fmt::format(", {} file{} dropped", files_dropped, files_dropped == 1 ? "" : "s");
  }
  return plan;
}

format::Increment PlanIncrement(const RankWritePlan& plan, uint64_t file_bytes) {
  format::Increment inc;
  inc.own_bytes = file_bytes;
  inc.referenced_bytes = plan.referenced_bytes;
  inc.origins = plan.origins;
  for (const format::Origin& o : plan.origins) inc.origin_steps.push_back({o.step, o.run});
  std::sort(inc.origin_steps.begin(), inc.origin_steps.end());
  inc.origin_steps.erase(std::unique(inc.origin_steps.begin(), inc.origin_steps.end()), inc.origin_steps.end());
  return inc;
}

}  // namespace ckpt::persist
