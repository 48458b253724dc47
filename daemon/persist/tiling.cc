#include "daemon/persist/tiling.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <numeric>
#include <set>

namespace ckpt::persist {

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

namespace {

absl::Status CheckTensor(const std::string& name, const ManifestTensor& t) {
  const size_t n = t.global_shape.size();
  const Box whole{std::vector<int64_t>(n, 0), t.global_shape};
  std::vector<Box> boxes;
  std::vector<uint32_t> ranks;  // of each box
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
    if (std::find(boxes.begin(), boxes.end(), b) != boxes.end()) {
      continue;
    }
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

absl::Status CheckTiling(const Manifest& manifest) {
  for (const auto& [name, tensor] : manifest.tensors) {
    if (absl::Status ok = CheckTensor(name, tensor); !ok.ok()) return ok;
  }
  return absl::OkStatus();
}

}  // namespace ckpt::persist
