#include "daemon/restore/read_plan.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "common/dtype.h"

namespace ckpt::restore {
namespace {

using Index = std::vector<int64_t>;

using persist::Box;
using persist::FindGap;
using persist::Intersect;

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

}  // namespace

absl::StatusOr<ReadPlan> PlanRead(const persist::Manifest& manifest,
                                  const std::vector<WantedTensor>& wanted,
                                  const ReadPlanOptions& options) {
  ReadPlan plan;
  std::vector<std::string> problems;
  uint64_t total_runs = 0;
  for (const WantedTensor& w : wanted) {
    auto it = manifest.tensors.find(w.name);
    if (it == manifest.tensors.end()) {
      if (options.allow_missing) {
        plan.missing.push_back(w.name);
      } else {
        problems.push_back(fmt::format("{}: not in the checkpoint", w.name));
      }
      continue;
    }
    const persist::ManifestTensor& saved = it->second;
    const Index global = w.global_shape.empty() ? w.shape : w.global_shape;
    if (saved.dtype != w.dtype) {
      problems.push_back(fmt::format("{}: saved as {}, wanted as {}", w.name, saved.dtype, w.dtype));
      continue;
    }
    if (saved.global_shape != global) {
      problems.push_back(fmt::format("{}: global shape [{}] saved, [{}] wanted", w.name,
                                     fmt::join(saved.global_shape, ", "), fmt::join(global, ", ")));
      continue;
    }
    const size_t n = global.size();
    const Box want{w.offset.empty() ? Index(n, 0) : w.offset, w.shape};
    if (!want.Inside(global)) {
      problems.push_back(fmt::format("{}: the wanted piece at [{}] of shape [{}] is not inside the "
                                     "global shape [{}]",
                                     w.name, fmt::join(want.lo, ", "), fmt::join(want.extent, ", "),
                                     fmt::join(global, ", ")));
      continue;
    }
    absl::StatusOr<size_t> itemsize = DTypeSize(w.dtype);
    if (!itemsize.ok()) {
      problems.push_back(fmt::format("{}: {}", w.name, std::string(itemsize.status().message())));
      continue;
    }
    TensorReadPlan t{w.name, want.Volume() * *itemsize, {}};
    uint64_t covered = 0;
    std::vector<Box> overlaps;
    // Replicas (ranks holding the very same box) are read once: from the preferred rank's
    // shard when it is one of them (its own file, in the saved topology), else the first.
    std::vector<std::pair<Box, const persist::TensorShard*>> boxes;
    for (const persist::TensorShard& s : saved.shards) {
      Box box = persist::PlacementBox(s.offset, s.shape, global);
      if (box.lo.size() != n || box.extent.size() != n) {
        return absl::DataLossError(fmt::format(
            "the manifest places rank {}'s shard of {} in {} dimensions; the tensor has {}", s.rank,
            w.name, box.lo.size(), n));
      }
      auto same = std::find_if(boxes.begin(), boxes.end(), [&](const auto& b) { return b.first == box; });
      if (same == boxes.end()) {
        boxes.emplace_back(std::move(box), &s);
      } else if (options.prefer_rank && s.rank == *options.prefer_rank) {
        same->second = &s;
      }
    }
    for (const auto& [box, shard] : boxes) {
      const persist::TensorShard& s = *shard;
      std::optional<Box> overlap = Intersect(box, want);
      if (!overlap || overlap->Volume() == 0) continue;
      ShardRead read{s.rank, s.file, s.begin, s.end, s.checksum, s.chunk_checksums, {}};
      AddRuns(*overlap, box, want, *itemsize, read.runs);
      total_runs += read.runs.size();
      if (total_runs > options.max_runs) {
        return absl::ResourceExhaustedError(fmt::format(
            "reading {} would take more than {} separate byte runs: its saved shards and the "
            "wanted placement cut it too finely",
            w.name, options.max_runs));
      }
      covered += overlap->Volume();
      overlaps.push_back(*overlap);
      t.reads.push_back(std::move(read));
    }
    if (covered > want.Volume()) {
      return absl::DataLossError(fmt::format(
          "the checkpoint's shards of {} overlap (they hold {} elements of a piece of {})", w.name,
          covered, want.Volume()));
    }
    if (covered < want.Volume()) {
      std::optional<Box> gap = FindGap(want, overlaps);
      problems.push_back(fmt::format("{}: no saved shard holds {} ({} of {} wanted elements "
                                     "are missing)",
                                     w.name, gap ? gap->Range() : "part of " + want.Range(),
                                     want.Volume() - covered, want.Volume()));
      continue;
    }
    plan.tensors.push_back(std::move(t));
  }
  if (!problems.empty()) {
    return absl::InvalidArgumentError(fmt::format("{} tensor(s) cannot be read from step {}: {}",
                                                  problems.size(), manifest.step,
                                                  fmt::join(problems, "; ")));
  }
  return plan;
}

}  // namespace ckpt::restore
