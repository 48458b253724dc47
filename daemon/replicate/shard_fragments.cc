#include "daemon/replicate/shard_fragments.h"

#include <fmt/format.h>

#include <algorithm>
#include <set>

#include "format/checksum.h"

namespace ckpt::replicate {

absl::StatusOr<std::vector<HeldFragment>> CodeShard(const ErasureCode& code, const std::string& job, uint64_t step,
                                                    uint32_t owner, uint32_t rank, uint64_t run,
                                                    std::span<const uint8_t> data, int threads) {
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
    if (format::ChecksumOf(f->bytes.data(), f->bytes.size()) != f->meta.checksum) {
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
