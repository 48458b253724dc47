#include "format/tiling.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <numeric>
#include <set>
#include <unordered_set>
#include <utility>

namespace ckpt::format {

uint64_t Box::Volume() const {
  uint64_t v = 1;
  for (int64_t e : extent) v *= static_cast<uint64_t>(e);
  return v;
}

std::string Box::Range() const {
  std::vector<std::string> dims;
  for (size_t d = 0; d < lo.size(); ++d) dims.push_back(fmt::format("{}:{}", lo[d], lo[d] + extent[d]));
  return fmt::format("[{}]", fmt::join(dims, ", "));
}

bool Box::Inside(const std::vector<int64_t>& shape) const {
  if (lo.size() != shape.size() || extent.size() != shape.size()) return false;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (lo[d] < 0 || extent[d] < 0 || lo[d] + extent[d] > shape[d]) return false;
  }
  return true;
}

Box PlacementBox(const std::vector<int64_t>& offset, const std::vector<int64_t>& shape,
                 const std::vector<int64_t>& global) {
  return {offset.empty() ? std::vector<int64_t>(global.size(), 0) : offset, shape.empty() ? global : shape};
}

std::optional<Box> Intersect(const Box& a, const Box& b) {
  Box out{std::vector<int64_t>(a.lo.size()), std::vector<int64_t>(a.lo.size())};
  for (size_t d = 0; d < a.lo.size(); ++d) {
    int64_t lo = std::max(a.lo[d], b.lo[d]);
    int64_t hi = std::min(a.lo[d] + a.extent[d], b.lo[d] + b.extent[d]);
    if (lo >= hi) return std::nullopt;
    out.lo[d] = lo;
    out.extent[d] = hi - lo;
  }
  return out;
}

std::optional<Box> FindGap(const Box& whole, const std::vector<Box>& covered) {
  // The boxes' edges cut `whole` into cells, each held by some box or by none.
  const size_t n = whole.lo.size();
  std::vector<std::vector<int64_t>> cuts(n);
  uint64_t cells = 1;
  for (size_t d = 0; d < n; ++d) {
    std::set<int64_t> at = {whole.lo[d], whole.lo[d] + whole.extent[d]};
    for (const Box& b : covered) {
      at.insert(std::clamp(b.lo[d], whole.lo[d], whole.lo[d] + whole.extent[d]));
      at.insert(std::clamp(b.lo[d] + b.extent[d], whole.lo[d], whole.lo[d] + whole.extent[d]));
    }
    cuts[d].assign(at.begin(), at.end());
    cells *= cuts[d].size() - 1;
  }
  if (cells == 0 || cells * std::max<size_t>(covered.size(), 1) > (uint64_t{1} << 24)) return std::nullopt;
  std::vector<size_t> cell(n, 0);
  for (uint64_t c = 0; c < cells; ++c) {
    Box box{std::vector<int64_t>(n), std::vector<int64_t>(n)};
    for (size_t d = 0; d < n; ++d) {
      box.lo[d] = cuts[d][cell[d]];
      box.extent[d] = cuts[d][cell[d] + 1] - box.lo[d];
    }
    if (std::none_of(covered.begin(), covered.end(), [&](const Box& b) { return Intersect(b, box).has_value(); })) {
      return box;
    }
    for (size_t d = n; d-- > 0;) {
      if (++cell[d] < cuts[d].size() - 1) break;
      cell[d] = 0;
    }
  }
  return std::nullopt;
}

uint64_t Placement::Volume() const {
  if (!is_flat()) return box.Volume();
  uint64_t v = 0;
  for (const ElementRange& r : flat) v += static_cast<uint64_t>(r.end - r.begin);
  return v;
}

std::string Placement::Describe() const {
  if (!is_flat()) return box.Range();
  std::vector<std::string> ranges;
  for (const ElementRange& r : flat) ranges.push_back(fmt::format("[{}, {})", r.begin, r.end));
  return fmt::format("elements {}", fmt::join(ranges, " "));
}

std::string Placement::Key() const {
  if (!is_flat()) return fmt::format("b{}|{}", fmt::join(box.lo, ","), fmt::join(box.extent, ","));
  std::string key = "f";
  for (const ElementRange& r : flat) key += fmt::format("{},{};", r.begin, r.end);
  return key;
}

Placement PlacementOf(const std::vector<int64_t>& offset, const std::vector<int64_t>& shape,
                      const std::vector<ElementRange>& flat, const std::vector<int64_t>& global) {
  if (!flat.empty()) return {{}, flat};
  return {PlacementBox(offset, shape, global), {}};
}

Placement ShardPlacement(const TensorShard& shard, const std::vector<int64_t>& global) {
  return PlacementOf(shard.offset, shard.shape, shard.flat, global);
}

absl::StatusOr<std::vector<Segment>> Segments(const Placement& placement,
                                              const std::vector<int64_t>& global, uint64_t max) {
  std::vector<Segment> out;
  auto too_many = [&] {
    return absl::ResourceExhaustedError(fmt::format(
        "{} is more than {} separate runs of elements of the tensor", placement.Describe(), max));
  };
  if (placement.is_flat()) {
    if (placement.flat.size() > max) return too_many();
    uint64_t local = 0;
    for (const ElementRange& r : placement.flat) {
      const auto length = static_cast<uint64_t>(r.end - r.begin);
      out.push_back({static_cast<uint64_t>(r.begin), local, length});
      local += length;
    }
    return out;
  }
  const Box& box = placement.box;
  const size_t n = global.size();
  if (box.Volume() == 0) return out;
  if (n == 0) return std::vector<Segment>{{0, 0, 1}};
  // Segments span dimension j partly and every dimension after it whole.
  size_t j = n - 1;
  while (j > 0 && box.extent[j] == global[j]) --j;
  uint64_t length = 1, count = 1;
  for (size_t d = j; d < n; ++d) length *= static_cast<uint64_t>(box.extent[d]);
  for (size_t d = 0; d < j; ++d) count *= static_cast<uint64_t>(box.extent[d]);
  if (count > max) return too_many();
  std::vector<uint64_t> stride(n, 1);
  for (size_t d = n - 1; d > 0; --d) stride[d - 1] = stride[d] * static_cast<uint64_t>(global[d]);
  out.reserve(count);
  std::vector<int64_t> at = box.lo;  // walks dimensions [0, j) in row-major order
  for (uint64_t i = 0; i < count; ++i) {
    uint64_t start = 0;
    for (size_t d = 0; d < n; ++d) start += static_cast<uint64_t>(at[d]) * stride[d];
    out.push_back({start, i * length, length});
    for (size_t d = j; d-- > 0;) {
      if (++at[d] < box.lo[d] + box.extent[d]) break;
      at[d] = box.lo[d];
    }
  }
  return out;
}

std::optional<ElementRange> FirstUncovered(const std::vector<Segment>& wanted,
                                           std::vector<ElementRange> covered) {
  std::sort(covered.begin(), covered.end(), [](const ElementRange& a, const ElementRange& b) { return a.begin < b.begin; });
  size_t c = 0;
  for (const Segment& w : wanted) {
    auto at = static_cast<int64_t>(w.global);
    const auto end = static_cast<int64_t>(w.global + w.length);
    while (at < end) {
      while (c < covered.size() && covered[c].end <= at) ++c;
      if (c == covered.size() || covered[c].begin > at) {
        return ElementRange{at, c == covered.size() ? end : std::min(end, covered[c].begin)};
      }
      at = covered[c].end;
    }
  }
  return std::nullopt;
}

namespace {

constexpr uint64_t kMaxTilingSegments = uint64_t{1} << 24;

// The tiling check when some piece is a flat shard: every piece as runs of flat indices,
// swept in order.
absl::Status CheckFlatTensor(const std::string& name, const ManifestTensor& t) {
  struct Held {
    uint64_t begin, end;
    uint32_t rank;
  };
  std::vector<Held> held;
  std::unordered_set<std::string> seen;  // Placement::Key() of each piece counted
  for (const TensorShard& s : t.shards) {
    if (absl::Status placed = CheckPlacement(s, t.global_shape); !placed.ok()) {
      return absl::FailedPreconditionError(fmt::format("tensor {}: rank {}'s piece {}", name, s.rank, std::string(placed.message())));
    }
    Placement p = ShardPlacement(s, t.global_shape);
    if (!seen.insert(p.Key()).second) continue;  // a replica
    absl::StatusOr<std::vector<Segment>> segments = Segments(p, t.global_shape, kMaxTilingSegments - held.size());
    if (!segments.ok()) {
      return absl::FailedPreconditionError(fmt::format("tensor {}: rank {}'s piece {}: too finely cut to check", name, s.rank, std::string(segments.status().message())));
    }
    for (const Segment& g : *segments) held.push_back({g.global, g.global + g.length, s.rank});
  }
  std::sort(held.begin(), held.end(), [](const Held& a, const Held& b) { return a.begin < b.begin; });
  uint64_t numel = 1;
  for (int64_t d : t.global_shape) numel *= static_cast<uint64_t>(d);
  uint64_t reach = 0;
  const Held* last = nullptr;
  for (const Held& h : held) {
    if (h.begin < reach) {
      return absl::FailedPreconditionError(fmt::format("tensor {}: ranks {} and {} both hold elements [{}, {})",
                                                       name, last->rank, h.rank, h.begin, std::min(reach, h.end)));
    }
    if (h.begin > reach) break;
    reach = h.end;
    last = &h;
  }
  if (reach != numel) {
    uint64_t gap_end = numel;
    for (const Held& h : held) {
      if (h.begin > reach) {
        gap_end = h.begin;
        break;
      }
    }
    return absl::FailedPreconditionError(fmt::format("tensor {}: no rank holds elements [{}, {}) of the flattened tensor",
                                                     name, reach, gap_end));
  }
  return absl::OkStatus();
}

absl::Status CheckTensor(const std::string& name, const ManifestTensor& t) {
  if (std::any_of(t.shards.begin(), t.shards.end(), [](const TensorShard& s) { return !s.flat.empty(); })) {
    return CheckFlatTensor(name, t);
  }
  const size_t n = t.global_shape.size();
  const Box whole{std::vector<int64_t>(n, 0), t.global_shape};
  std::vector<Box> boxes;
  std::vector<uint32_t> ranks;  // of each box
  std::unordered_set<std::string> seen;  // Placement::Key() of each box counted
  uint64_t volume = 0;
  for (const TensorShard& s : t.shards) {
    Box b = PlacementBox(s.offset, s.shape, t.global_shape);
    if (!b.Inside(t.global_shape)) {
      return absl::FailedPreconditionError(fmt::format(
          "tensor {}: rank {} places its shard at [{}] of shape [{}], outside the global shape [{}]",
          name, s.rank, fmt::join(s.offset, ", "), fmt::join(s.shape, ", "), fmt::join(t.global_shape, ", ")));
    }
    // Several ranks holding the very same box are replicas (data parallel, or HSDP's
    // replicated shards): one of them counts.
    if (!seen.insert(Placement{b, {}}.Key()).second) continue;
    volume += b.Volume();
    ranks.push_back(s.rank);
    boxes.push_back(std::move(b));
  }
  // No two shards overlap: sweep along the dimension whose starts differ most, comparing
  // each shard only with those still open there (one for row shards).
  size_t sweep = 0, most = 0;
  for (size_t d = 0; d < n; ++d) {
    std::set<int64_t> starts;
    for (const Box& b : boxes) starts.insert(b.lo[d]);
    if (starts.size() > most) most = starts.size(), sweep = d;
  }
  std::vector<size_t> order(boxes.size());
  std::iota(order.begin(), order.end(), 0);
  if (n > 0) {
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return boxes[a].lo[sweep] < boxes[b].lo[sweep]; });
  }
  std::vector<size_t> open;
  for (size_t i : order) {
    if (boxes[i].Volume() == 0) continue;
    if (n > 0) {
      std::erase_if(open, [&](size_t o) { return boxes[o].lo[sweep] + boxes[o].extent[sweep] <= boxes[i].lo[sweep]; });
    }
    for (size_t o : open) {
      if (std::optional<Box> both = Intersect(boxes[o], boxes[i])) {
        return absl::FailedPreconditionError(fmt::format("tensor {}: ranks {} and {} both hold {}", name,
                                                         ranks[o], ranks[i], both->Range()));
      }
    }
    open.push_back(i);
  }
  if (volume != whole.Volume()) {
    std::optional<Box> gap = FindGap(whole, boxes);
    return absl::FailedPreconditionError(fmt::format(
        "tensor {}: no rank holds {} ({} of {} elements are held)", name,
        gap ? gap->Range() : "part of " + whole.Range(), volume, whole.Volume()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckTensorTiling(const std::string& name, const ManifestTensor& tensor) {
  return CheckTensor(name, tensor);
}

absl::Status CheckTiling(const Manifest& manifest) {
  for (const auto& [name, tensor] : manifest.tensors) {
    if (absl::Status ok = CheckTensor(name, tensor); !ok.ok()) return ok;
  }
  return absl::OkStatus();
}

}  // namespace ckpt::format
