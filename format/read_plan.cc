#include "format/read_plan.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <unordered_map>

#include "common/dtype.h"
#include "common/status.h"

namespace ckpt::format {
namespace {

// How many of a plan's problems an error names (each is a line's worth).
constexpr size_t kProblemsShown = 5;

uint64_t PieceBytes(const std::vector<int64_t>& shape, size_t itemsize) {
  uint64_t bytes = itemsize;
  for (int64_t d : shape) bytes *= static_cast<uint64_t>(d);  // ParseManifest checked the shape
  return bytes;
}

// What reading saved piece `s` of `bytes` starts from (the runs are added after): its entry,
// or its extents and chunks (version 5), which the reader follows.
ShardRead ReadOf(const format::TensorShard& s, const std::string& dtype, uint64_t manifest_chunk_bytes,
                 uint64_t bytes) {
  ShardRead read{s.rank, s.file, s.begin, s.end, s.checksum, s.chunk_checksums, {}, dtype, s.shape,
                 s.chunk_bytes != 0 ? s.chunk_bytes : manifest_chunk_bytes, s.extents};
  if (!s.extents.empty()) {
    read.entry_begin = 0;
    read.entry_end = bytes;
  }
  return read;
}

using Index = std::vector<int64_t>;

using format::Box;
using format::FindGap;
using format::Intersect;
using format::Segment;

// Row-major element offset of global index `at` inside box `in`.
uint64_t Linear(const Box& in, const Index& at) {
  uint64_t linear = 0;
  for (size_t d = 0; d < at.size(); ++d) {
    linear = linear * static_cast<uint64_t>(in.extent[d]) + static_cast<uint64_t>(at[d] - in.lo[d]);
  }
  return linear;
}

// The runs that copy `overlap` from saved box `saved` to wanted box `wanted`: contiguous
// in both over the trailing dimensions that the overlap spans whole in both.
void AddRuns(const Box& overlap, const Box& saved, const Box& wanted, size_t itemsize,
             std::vector<ByteRun>& runs) {
  const size_t n = overlap.lo.size();
  if (n == 0) {
    runs.push_back({0, 0, itemsize});
    return;
  }
  size_t j = n - 1;  // runs span dimension j partly and every dimension after it whole
  auto whole = [&](size_t d) { return overlap.extent[d] == saved.extent[d] && overlap.extent[d] == wanted.extent[d]; };
  while (j > 0 && whole(j)) --j;
  uint64_t run_elements = 1;
  for (size_t d = j; d < n; ++d) run_elements *= static_cast<uint64_t>(overlap.extent[d]);
  Index at = overlap.lo;  // walks dimensions [0, j) in row-major order
  while (true) {
    runs.push_back({Linear(saved, at) * itemsize, Linear(wanted, at) * itemsize, run_elements * itemsize});
    size_t d = j;
    while (d > 0) {
      --d;
      if (++at[d] < overlap.lo[d] + overlap.extent[d]) break;
      at[d] = overlap.lo[d];
      if (d == 0) return;
    }
    if (j == 0) return;
  }
}

// The runs that copy the elements both `saved` and `wanted` hold (segments of the two
// placements, each by flat index); returns how many elements that is and adds their flat
// ranges to `overlaps`. Both lists ascend in local order too, so the runs come out by
// source, and runs that continue each other in both pieces are merged.
uint64_t AddSegmentRuns(const std::vector<Segment>& saved, const std::vector<Segment>& wanted,
                        size_t itemsize, std::vector<ByteRun>& runs,
                        std::vector<format::ElementRange>& overlaps) {
  uint64_t elements = 0;
  size_t i = 0, k = 0;
  if (!saved.empty()) {  // skip the wanted segments that end before this shard starts
    auto first = std::partition_point(wanted.begin(), wanted.end(), [&](const Segment& w) {
      return w.global + w.length <= saved.front().global;
    });
    k = static_cast<size_t>(first - wanted.begin());
  }
  while (i < saved.size() && k < wanted.size()) {
    const Segment& a = saved[i];
    const Segment& b = wanted[k];
    const uint64_t lo = std::max(a.global, b.global);
    const uint64_t hi = std::min(a.global + a.length, b.global + b.length);
    if (lo < hi) {
      const uint64_t source = (a.local + lo - a.global) * itemsize;
      const uint64_t destination = (b.local + lo - b.global) * itemsize;
      const uint64_t bytes = (hi - lo) * itemsize;
      if (!runs.empty() && runs.back().source + runs.back().bytes == source &&
          runs.back().destination + runs.back().bytes == destination) {
        runs.back().bytes += bytes;
      } else {
        runs.push_back({source, destination, bytes});
      }
      if (!overlaps.empty() && static_cast<uint64_t>(overlaps.back().end) == lo) {
        overlaps.back().end = static_cast<int64_t>(hi);
      } else {
        overlaps.push_back({static_cast<int64_t>(lo), static_cast<int64_t>(hi)});
      }
      elements += hi - lo;
    }
    (a.global + a.length <= b.global + b.length) ? ++i : ++k;
  }
  return elements;
}

// A saved placement of a tensor and the ranks holding it (several: replicas).
struct SavedPlacement {
  format::Placement placement;
  const format::TensorShard* first = nullptr;
  std::unordered_map<uint32_t, const format::TensorShard*> replicas;  // by rank, when several
  // Of replicas, the preferred rank's shard (its own file, in the saved topology), else the first.
  const format::TensorShard* Holder(std::optional<uint32_t> prefer) const {
    if (prefer && !replicas.empty()) {
      if (auto it = replicas.find(*prefer); it != replicas.end()) return it->second;
    }
    return first;
  }
};

// One tensor's saved placements, built once per PlanRead call however many pieces of the
// tensor are wanted (verify plans every rank's pieces in one call).
struct SavedIndex {
  std::vector<SavedPlacement> placements;
  std::unordered_map<std::string, size_t> by_key;  // Placement::Key() -> placements[]
};

absl::StatusOr<const SavedIndex*> IndexOf(std::unordered_map<std::string, SavedIndex>& indexes,
                                        const std::string& name, const format::ManifestTensor& saved,
                                        const std::vector<int64_t>& global) {
  auto [it, fresh] = indexes.try_emplace(name);
  SavedIndex& index = it->second;
  if (!fresh) return &index;
  for (const format::TensorShard& s : saved.shards) {
    if (absl::Status placed = format::CheckPlacement(s, global); !placed.ok()) {
      indexes.erase(it);
      return absl::DataLossError(fmt::format("the manifest's shard of {} from rank {} {}", name, s.rank,
                                             std::string(placed.message())));
    }
    format::Placement p = format::ShardPlacement(s, global);
    auto [at, added] = index.by_key.try_emplace(p.Key(), index.placements.size());
    if (added) {
      index.placements.push_back({std::move(p), &s, {}});
      continue;
    }
    SavedPlacement& same = index.placements[at->second];
    if (same.replicas.empty()) same.replicas.emplace(same.first->rank, same.first);
    same.replicas.emplace(s.rank, &s);
  }
  return &index;
}

// Why a node-scoped manifest (Manifest::scope) cannot give what its node does not hold.
std::string ScopeNote(const format::Manifest& manifest) {
  return fmt::format("node {}'s manifest lists only its own ranks ({} of {}); the others are held "
                     "by other nodes (read node 0's manifest or the remote tier's)",
                     manifest.scope->node, manifest.shards.size(), manifest.world_size);
}

absl::Status TooFine(const std::string& name, uint64_t max_runs) {
  return absl::ResourceExhaustedError(fmt::format(
      "reading {} would take more than {} separate byte runs: its saved shards and the "
      "wanted placement cut it too finely",
      name, max_runs));
}

}  // namespace

std::vector<std::vector<WantedTensor>> SavedPieces(const format::Manifest& manifest) {
  std::vector<std::vector<WantedTensor>> out(manifest.world_size);
  for (const auto& [name, tensor] : manifest.tensors) {
    for (const format::TensorShard& s : tensor.shards) {
      if (s.rank >= out.size()) out.resize(s.rank + 1);
      out[s.rank].push_back({name, tensor.dtype, s.shape, tensor.global_shape, s.offset, s.flat, s.rank});
    }
  }
  return out;
}

absl::StatusOr<ReadPlan> PlanRead(const format::Manifest& manifest,
                                  const std::vector<WantedTensor>& wanted,
                                  const ReadPlanOptions& options) {
  ReadPlan plan;
  std::vector<std::string> problems;
  uint64_t total_runs = 0;
  std::unordered_map<std::string, SavedIndex> indexes;
  for (const WantedTensor& w : wanted) {
    auto it = manifest.tensors.find(w.name);
    if (it == manifest.tensors.end()) {
      // A node-scoped manifest that lists fewer tensors than the step has cannot tell a
      // tensor the step lacks from one only other nodes hold: never skipped as missing.
      if (manifest.scope && manifest.tensors.size() < manifest.StepTensors()) {
        problems.push_back(fmt::format("{}: {}", w.name, ScopeNote(manifest)));
      } else if (options.allow_missing) {
        plan.missing.push_back(w.name);
      } else {
        problems.push_back(fmt::format("{}: not in the checkpoint", w.name));
      }
      continue;
    }
    const format::ManifestTensor& saved = it->second;
    const Index global = w.global_shape.empty() ? w.shape : w.global_shape;
    if (std::optional<std::string> problem =
            LayoutProblem(w.name, saved.dtype, saved.global_shape, w.dtype, global, "global shape")) {
      problems.push_back(std::move(*problem));
      continue;
    }
    const format::Placement want = format::PlacementOf(w.offset, w.shape, w.flat, global);
    format::TensorShard probe;  // the wanted placement, checked as a saved one would be
    probe.shape = w.shape;
    probe.offset = want.box.lo;
    probe.flat = w.flat;
    if (absl::Status placed = format::CheckPlacement(probe, global); !placed.ok()) {
      problems.push_back(fmt::format("{}: the wanted piece {} (global shape [{}])", w.name,
                                     std::string(placed.message()), fmt::join(global, ", ")));
      continue;
    }
    absl::StatusOr<size_t> itemsize = DTypeSize(w.dtype);
    if (!itemsize.ok()) {
      problems.push_back(fmt::format("{}: {}", w.name, std::string(itemsize.status().message())));
      continue;
    }
    const uint64_t volume = want.Volume();
    TensorReadPlan t{w.name, volume * *itemsize, {}};
    uint64_t covered = 0;
    std::vector<Box> overlaps;                      // box with box
    std::vector<format::ElementRange> flat_overlaps;  // where a flat placement is involved
    std::optional<std::vector<Segment>> want_segments;  // computed when first needed
    absl::StatusOr<const SavedIndex*> index = IndexOf(indexes, w.name, saved, global);
    if (!index.ok()) return index.status();
    const std::optional<uint32_t> prefer = w.from_rank ? w.from_rank : options.prefer_rank;
    // The piece exactly as one rank saved it (every restore in the saved topology, verify):
    // that rank's whole entry, found without looking at the other ranks' shards.
    if (auto exact = (*index)->by_key.find(want.Key()); exact != (*index)->by_key.end() && volume > 0) {
      const format::TensorShard& s = *(*index)->placements[exact->second].Holder(prefer);
      t.reads.push_back(ReadOf(s, saved.dtype, manifest.checksum_chunk_bytes, t.bytes));
      t.reads.back().runs = {{0, 0, t.bytes}};
      if (++total_runs > options.max_runs) return TooFine(w.name, options.max_runs);
      plan.tensors.push_back(std::move(t));
      continue;
    }
    for (const SavedPlacement& saved_placement : (*index)->placements) {
      const format::Placement& placement = saved_placement.placement;
      const format::TensorShard& s = *saved_placement.Holder(prefer);
      ShardRead read = ReadOf(s, saved.dtype, manifest.checksum_chunk_bytes, PieceBytes(s.shape, *itemsize));
      if (!placement.is_flat() && !want.is_flat()) {
        std::optional<Box> overlap = Intersect(placement.box, want.box);
        if (!overlap || overlap->Volume() == 0) continue;
        AddRuns(*overlap, placement.box, want.box, *itemsize, read.runs);
        covered += overlap->Volume();
        overlaps.push_back(*overlap);
      } else {
        if (!want_segments) {
          absl::StatusOr<std::vector<Segment>> segments = format::Segments(want, global, options.max_runs);
          if (!segments.ok()) return TooFine(w.name, options.max_runs);
          want_segments = std::move(*segments);
        }
        absl::StatusOr<std::vector<Segment>> saved_segments = format::Segments(placement, global, options.max_runs);
        if (!saved_segments.ok()) return TooFine(w.name, options.max_runs);
        covered += AddSegmentRuns(*saved_segments, *want_segments, *itemsize, read.runs, flat_overlaps);
        if (read.runs.empty()) continue;
      }
      total_runs += read.runs.size();
      if (total_runs > options.max_runs) return TooFine(w.name, options.max_runs);
      t.reads.push_back(std::move(read));
    }
    if (covered > volume) {
      return absl::DataLossError(fmt::format(
          "the checkpoint's shards of {} overlap (they hold {} elements of a piece of {})", w.name,
          covered, volume));
    }
    if (covered < volume) {
      std::string where;
      if (want.is_flat() || !flat_overlaps.empty()) {
        // Some overlaps were found as flat runs: name the gap as flat indices.
        for (const Box& b : overlaps) {
          absl::StatusOr<std::vector<Segment>> runs = format::Segments({b, {}}, global, options.max_runs);
          if (!runs.ok()) break;
          for (const Segment& g : *runs) flat_overlaps.push_back({static_cast<int64_t>(g.global), static_cast<int64_t>(g.global + g.length)});
        }
        std::optional<format::ElementRange> gap;
        if (want_segments) gap = format::FirstUncovered(*want_segments, flat_overlaps);
        where = gap ? fmt::format("elements [{}, {}) of the flattened tensor", gap->begin, gap->end)
                    : "part of " + want.Describe();
      } else {
        std::optional<Box> gap = FindGap(want.box, overlaps);
        where = gap ? gap->Range() : "part of " + want.box.Range();
      }
      problems.push_back(fmt::format("{}: no saved shard holds {} ({} of {} wanted elements "
                                     "are missing){}",
                                     w.name, where, volume - covered, volume,
                                     manifest.scope ? "; " + ScopeNote(manifest) : ""));
      continue;
    }
    plan.tensors.push_back(std::move(t));
  }
  if (!problems.empty()) return CannotRead(problems, manifest.step);
  return plan;
}

absl::Status CannotRead(const std::vector<std::string>& problems, uint64_t step) {
  // A model built with another width mismatches in every tensor: the first few say what
  // changed, and the count how much.
  return absl::InvalidArgumentError(fmt::format("{} tensor(s) cannot be read from step {}: {}", problems.size(),
                                                step, JoinSome(problems, kProblemsShown, "; ")));
}

std::optional<std::string> LayoutProblem(const std::string& name, const std::string& saved_dtype,
                                         const std::vector<int64_t>& saved_shape,
                                         const std::string& wanted_dtype,
                                         const std::vector<int64_t>& wanted_shape, const char* shape_kind) {
  if (saved_dtype != wanted_dtype) return fmt::format("{}: saved as {}, wanted as {}", name, saved_dtype, wanted_dtype);
  if (saved_shape != wanted_shape) {
    return fmt::format("{}: {} [{}] saved, [{}] wanted", name, shape_kind, fmt::join(saved_shape, ", "),
                       fmt::join(wanted_shape, ", "));
  }
  return std::nullopt;
}

}  // namespace ckpt::format
