// A rank's staged shard as the k + m fragments its node's coding group holds, and the shard
// rebuilt from any k of them: the data path of peer replicas between the staging memory and
// the network (docs/architecture.md, "Peer replicas"). Pure: no daemon state, no I/O.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/replicate/coding_groups.h"
#include "daemon/replicate/erasure_code.h"
#include "daemon/replicate/fragment_store.h"

namespace ckpt::replicate {

// The k + m fragments of `data`, `rank`'s shard of `step` of `job` held by node `owner`,
// saved by `run`: each with its id, its coding and the checksum of its bytes.
absl::StatusOr<std::vector<HeldFragment>> CodeShard(const ErasureCode& code, const std::string& job, uint64_t step,
                                                    uint32_t owner, uint32_t rank, uint64_t run,
                                                    const ScatteredBytes& data, int threads = 1);
inline absl::StatusOr<std::vector<HeldFragment>> CodeShard(const ErasureCode& code, const std::string& job,
                                                           uint64_t step, uint32_t owner, uint32_t rank, uint64_t run,
                                                           std::span<const uint8_t> data, int threads = 1) {
  return CodeShard(code, job, step, owner, rank, run,
                   ScatteredBytes(reinterpret_cast<const char*>(data.data()), data.size()), threads);
}

// The columns a patch is cut in: fragment bytes per chunk. Chunk c of data fragment i is
// the shard's bytes [i * F + c * C, i * F + (c + 1) * C) (F the fragment's size), and chunk
// c of every fragment is a function of chunk c of the k data fragments alone.
inline constexpr size_t kPatchChunkBytes = size_t{256} << 10;

// What an owner keeps of a shard it sent, to send the next one as a patch: the XXH3 of each
// chunk of each fragment it sent (fragment_checksum.h). The data fragments' rows are the
// shard's bytes' sums: they say which columns changed; the parity rows give the fragments'
// chunked checksums without the whole new fragments at hand.
struct FragmentSums {
  size_t chunk_bytes = kPatchChunkBytes;
  std::vector<std::vector<uint64_t>> sums;  // [fragment index][chunk], indexes 0..count-1
};

// The chunk sums of the first `count` of `fragments` (whole, as CodeShard makes them).
FragmentSums SumsOf(std::span<const HeldFragment> fragments, size_t count, size_t chunk_bytes = kPatchChunkBytes,
                    int threads = 1);

// A shard coded as patches of the first `count` fragments of a step sent before.
struct ShardPatch {
  std::vector<uint32_t> chunks;         // those whose columns changed, ascending
  std::vector<HeldFragment> fragments;  // by index: id, meta (checksum "xxh3c:" of the whole new
                                        // fragment), and bytes: the changed chunks only, in order
  FragmentSums sums;                    // the new shard's: the base's with the changed chunks'
};

// `data` coded as a patch of the shard that `base` was kept of (the same coding, size and
// `count`): the k data fragments' chunks are hashed, and only the columns of the chunks
// where any differs from the base are coded, from `data` alone. InvalidArgument when
// `base` is not of this coding, size or count.
absl::StatusOr<ShardPatch> CodePatch(const ErasureCode& code, const std::string& job, uint64_t step, uint32_t owner,
                                     uint32_t rank, uint64_t run, const ScatteredBytes& data, size_t count,
                                     const FragmentSums& base, int threads = 1);
inline absl::StatusOr<ShardPatch> CodePatch(const ErasureCode& code, const std::string& job, uint64_t step,
                                            uint32_t owner, uint32_t rank, uint64_t run, std::span<const uint8_t> data,
                                            size_t count, const FragmentSums& base, int threads = 1) {
  return CodePatch(code, job, step, owner, rank, run,
                   ScatteredBytes(reinterpret_cast<const char*>(data.data()), data.size()), count, base, threads);
}

// The shard back from the fragments at hand, all of one shard and one coding: each is
// checked against its checksum first, and one that fails it is left out (another is used
// where there is one). DataLoss naming how many fragments were usable when fewer than k are;
// InvalidArgument when the fragments are of different shards or codings.
absl::StatusOr<std::string> RebuildShard(std::span<const std::shared_ptr<const HeldFragment>> fragments,
                                         int threads = 1);

// Which node holds each fragment of `owner`'s shards that it sends (by fragment index,
// 0..k+m-2): the next k + m - 1 members of its coding group after `owner`, one each. The
// owner holds the whole shard itself, which counts for the last fragment: when the owner is
// among any m nodes lost, at most m - 1 peers went with it, each with one fragment, and k
// remain. So a 1+1 code is a plain mirror, and 4+2 sends 1.25 times the data where two
// copies send 2. InvalidArgument when `owner` is not in `group` or the group is smaller
// than k + m.
absl::StatusOr<std::vector<uint32_t>> FragmentHolders(const CodingGroup& group, uint32_t owner, int k, int m);

}  // namespace ckpt::replicate
