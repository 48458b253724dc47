#include "daemon/replicate/shard_fragments.h"

#include <fmt/format.h>

#include <algorithm>
#include <set>
#include <utility>

#include "daemon/replicate/fragment_checksum.h"
#include "daemon/replicate/run_on_ranges.h"
#include "format/checksum.h"

namespace ckpt::replicate {

absl::StatusOr<std::vector<HeldFragment>> CodeShard(const ErasureCode& code, const std::string& job, uint64_t step,
                                                    uint32_t owner, uint32_t rank, uint64_t run,
                                                    const ScatteredBytes& data, int threads) {
  const int n = code.k() + code.m();
  const size_t each = code.FragmentBytes(data.size());
  std::vector<HeldFragment> out(static_cast<size_t>(n));
  std::vector<uint8_t*> buffers;
  for (int i = 0; i < n; ++i) {
    HeldFragment& f = out[static_cast<size_t>(i)];
    f.id = FragmentId{job, step, owner, rank, static_cast<uint32_t>(i)};
    f.meta = FragmentMeta{static_cast<uint32_t>(code.k()), static_cast<uint32_t>(code.m()), data.size(), run, {}};
    f.bytes.resize(each);
    buffers.push_back(reinterpret_cast<uint8_t*>(f.bytes.data()));
  }
  if (absl::Status coded = code.Encode(data, buffers, threads); !coded.ok()) return coded;
  for (HeldFragment& f : out) f.meta.checksum = format::ChecksumOf(f.bytes.data(), f.bytes.size());
  return out;
}

namespace {

// fn(begin, end) over [0, n) in up to `threads` contiguous parts, each on a thread of its own
// (the caller's the first).
template <typename Fn>
void ParallelFor(size_t n, int threads, const Fn& fn) {
  const size_t parts = std::clamp<size_t>(static_cast<size_t>(std::max(threads, 1)), 1, std::max<size_t>(n, 1));
  const size_t share = (n + parts - 1) / parts;
  std::vector<std::pair<size_t, size_t>> ranges{{0, std::min(n, share)}};
  for (size_t begin = share; begin < n; begin += share) ranges.emplace_back(begin, std::min(n, begin + share));
  RunOnRanges(ranges, fn);
}

size_t ChunksOf(size_t fragment_bytes, size_t chunk_bytes) { return (fragment_bytes + chunk_bytes - 1) / chunk_bytes; }

}  // namespace

FragmentSums SumsOf(std::span<const HeldFragment> fragments, size_t count, size_t chunk_bytes, int threads) {
  FragmentSums out;
  out.chunk_bytes = chunk_bytes;
  out.sums.resize(std::min(count, fragments.size()));
  if (out.sums.empty()) return out;
  const size_t size = fragments.front().bytes.size();
  const size_t chunks = ChunksOf(size, chunk_bytes);
  for (auto& row : out.sums) row.resize(chunks);
  // Every (fragment, chunk) is one task, so that a few threads share one fragment too.
  ParallelFor(out.sums.size() * chunks, threads, [&](size_t begin, size_t end) {
    for (size_t t = begin; t < end; ++t) {
      const size_t i = t / chunks, c = t % chunks;
      const size_t at = c * chunk_bytes;
      out.sums[i][c] = PaddedSum(fragments[i].bytes.data() + at, std::min(chunk_bytes, size - at),
                                 std::min(chunk_bytes, size - at));
    }
  });
  return out;
}

absl::StatusOr<ShardPatch> CodePatch(const ErasureCode& code, const std::string& job, uint64_t step, uint32_t owner,
                                     uint32_t rank, uint64_t run, const ScatteredBytes& data, size_t count,
                                     const FragmentSums& base, int threads) {
  const size_t k = static_cast<size_t>(code.k());
  const size_t each = code.FragmentBytes(data.size());
  const size_t c_bytes = base.chunk_bytes;
  const size_t chunks = c_bytes == 0 ? 0 : ChunksOf(each, c_bytes);
  if (count < k || count > k + static_cast<size_t>(code.m()) || base.sums.size() != count || c_bytes == 0 ||
      std::any_of(base.sums.begin(), base.sums.end(), [&](const auto& row) { return row.size() != chunks; })) {
    return absl::InvalidArgumentError(fmt::format(
        "rank {}'s shard of job {} step {}: the sums kept of the step before are not of {} fragments of {} bytes",
        rank, job, step, count, each));
  }
  ShardPatch out;
  out.sums = base;
  // The data fragments' chunks, hashed where they lie in the shard (the padding past its
  // end hashed as the zeros the fragment holds there).
  ParallelFor(k * chunks, threads, [&](size_t begin, size_t end) {
    for (size_t t = begin; t < end; ++t) {
      const size_t i = t / chunks, c = t % chunks;
      const size_t from = std::min(data.size(), i * each + c * c_bytes);
      const size_t size = std::min(c_bytes, each - c * c_bytes);
      const size_t have = std::min(size, data.size() - from);
      if (const char* at = data.Contiguous(from, have)) {
        out.sums.sums[i][c] = PaddedSum(at, have, size);
        continue;
      }
      // A chunk across two places of the shard (its own bytes and a frozen block): gathered.
      std::string gathered(have, '\0');
      data.CopyTo(from, have, gathered.data());
      out.sums.sums[i][c] = PaddedSum(gathered.data(), have, size);
    }
  });
  for (size_t c = 0; c < chunks; ++c) {
    for (size_t i = 0; i < k; ++i) {
      if (out.sums.sums[i][c] != base.sums[i][c]) {
        out.chunks.push_back(static_cast<uint32_t>(c));
        break;
      }
    }
  }
  size_t patch_bytes = 0;
  for (uint32_t c : out.chunks) patch_bytes += std::min(c_bytes, each - c * c_bytes);
  out.fragments.resize(count);
  for (size_t i = 0; i < count; ++i) {
    HeldFragment& f = out.fragments[i];
    f.id = FragmentId{job, step, owner, rank, static_cast<uint32_t>(i)};
    f.meta = FragmentMeta{static_cast<uint32_t>(code.k()), static_cast<uint32_t>(code.m()), data.size(), run, {}};
    f.bytes.resize(patch_bytes);
  }
  // Each run of adjacent changed chunks is one range of columns, coded straight into the
  // fragments' patch bytes.
  std::vector<uint8_t*> out_ptrs(count);
  for (size_t r = 0, offset = 0; r < out.chunks.size();) {
    size_t e = r + 1;
    while (e < out.chunks.size() && out.chunks[e] == out.chunks[e - 1] + 1) ++e;
    const size_t begin = out.chunks[r] * c_bytes;
    const size_t end = std::min(each, (static_cast<size_t>(out.chunks[e - 1]) + 1) * c_bytes);
    for (size_t i = 0; i < count; ++i) out_ptrs[i] = reinterpret_cast<uint8_t*>(out.fragments[i].bytes.data()) + offset;
    if (absl::Status coded = code.EncodeColumns(data, begin, end, out_ptrs, threads); !coded.ok()) return coded;
    offset += end - begin;
    r = e;
  }
  // The parity fragments' changed chunks hashed from what was coded (the data fragments'
  // are the shard's, hashed above).
  std::vector<size_t> offsets(out.chunks.size());
  for (size_t j = 1; j < out.chunks.size(); ++j) {
    offsets[j] = offsets[j - 1] + std::min(c_bytes, each - out.chunks[j - 1] * c_bytes);
  }
  const size_t parity = count - k;
  ParallelFor(parity * out.chunks.size(), threads, [&](size_t begin, size_t end) {
    for (size_t t = begin; t < end; ++t) {
      const size_t i = k + t / out.chunks.size(), j = t % out.chunks.size();
      const uint32_t c = out.chunks[j];
      const size_t size = std::min(c_bytes, each - c * c_bytes);
      out.sums.sums[i][c] = PaddedSum(out.fragments[i].bytes.data() + offsets[j], size, size);
    }
  });
  for (size_t i = 0; i < count; ++i) out.fragments[i].meta.checksum = ChunkedChecksum(out.sums.sums[i], c_bytes);
  return out;
}

absl::StatusOr<std::string> RebuildShard(std::span<const std::shared_ptr<const HeldFragment>> fragments, int threads) {
  if (fragments.empty()) return absl::NotFoundError("no fragment of the shard is at hand");
  const HeldFragment& first = *fragments.front();
  const std::string what = fmt::format("rank {}'s shard of job {} step {} (node {}'s)", first.id.rank, first.id.job,
                                       first.id.step, first.id.owner);
  std::vector<FragmentView> usable;
  std::set<uint32_t> indices;
  size_t damaged = 0;
  for (const auto& f : fragments) {
    const FragmentId& id = f->id;
    if (id.job != first.id.job || id.step != first.id.step || id.owner != first.id.owner ||
        id.rank != first.id.rank || f->meta.k != first.meta.k || f->meta.m != first.meta.m ||
        f->meta.data_bytes != first.meta.data_bytes || f->meta.run != first.meta.run) {
      return absl::InvalidArgumentError(fmt::format("{}: fragments of different shards or codings", what));
    }
    if (!ChecksumMatches(f->bytes.data(), f->bytes.size(), f->meta.checksum)) {
      ++damaged;  // another fragment serves instead, where there is one
      continue;
    }
    if (indices.insert(id.index).second) {
      usable.push_back({static_cast<int>(id.index),
                        {reinterpret_cast<const uint8_t*>(f->bytes.data()), f->bytes.size()}});
    }
  }
  if (usable.size() < first.meta.k) {
    return absl::DataLossError(fmt::format("{}: {} usable fragments of the {} needed ({} failed their checksum)", what,
                                           usable.size(), first.meta.k, damaged));
  }
  absl::StatusOr<ErasureCode> code = ErasureCode::Make(static_cast<int>(first.meta.k), static_cast<int>(first.meta.m));
  if (!code.ok()) return code.status();
  std::string data(first.meta.data_bytes, '\0');
  if (absl::Status decoded = code->Decode(usable, {reinterpret_cast<uint8_t*>(data.data()), data.size()}, threads);
      !decoded.ok()) {
    return decoded;
  }
  return data;
}

absl::StatusOr<std::vector<uint32_t>> FragmentHolders(const CodingGroup& group, uint32_t owner, int k, int m) {
  auto me = std::find(group.nodes.begin(), group.nodes.end(), owner);
  if (me == group.nodes.end()) {
    return absl::InvalidArgumentError(fmt::format("node {} is not in the coding group", owner));
  }
  if (k < 1 || m < 1 || group.nodes.size() < static_cast<size_t>(k + m)) {
    return absl::InvalidArgumentError(
        fmt::format("a coding group of {} nodes cannot hold a {}+{} code", group.nodes.size(), k, m));
  }
  std::vector<uint32_t> peers(me + 1, group.nodes.end());
  peers.insert(peers.end(), group.nodes.begin(), me);
  peers.resize(static_cast<size_t>(k + m - 1));  // the group has at least k + m - 1 peers
  return peers;
}

}  // namespace ckpt::replicate
