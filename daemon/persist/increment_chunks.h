// How an incremental step cuts each tensor piece into chunks, the unit that is compared with
// the base and referenced or written again (docs/design/incremental.md, section 4). Pure.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "format/increment.h"

namespace ckpt::persist {

// --increment-chunk-bytes: the chunk a piece is cut into, about; allowed range.
inline constexpr uint64_t kDefaultIncrementChunkBytes = uint64_t{4} << 20;
inline constexpr uint64_t kMinIncrementChunkBytes = uint64_t{64} << 10;
inline constexpr uint64_t kMaxIncrementChunkBytes = uint64_t{64} << 20;
// The chunk of a tensor updated sparsely (an embedding with sparse gradients): small, so that
// a few rows changed at random touch few chunks; at least one row. 1% of rows changed at
// random touch 1 - 0.99^(rows a chunk) of the chunks, and each chunk costs its checksum in
// every step's manifest (about 25 bytes, 2.4% of 1 KiB): at 1 KiB a table of 256-byte rows
// writes about 6% of itself a step, one of 4 KiB rows 1.6% (16 KiB wrote 47% and 4.3%).
inline constexpr uint64_t kSparseChunkBytes = uint64_t{1} << 10;
// How many chunks the sparse pieces of one job on one node may have together: about 25 MiB
// of checksums in every step's node manifest (which must stay under 64 MiB). A dense
// piece has at most format::kMaxPieceChunks (its checksums are of 4 MiB chunks).
inline constexpr uint64_t kSparseChunksPerNode = uint64_t{1} << 20;

// The most chunks a sparse piece of `bytes` may have: its share, by size, of the node's
// budget (kSparseChunksPerNode split evenly between the job's `local_ranks` ranks on the
// node, a rank's share between its sparse pieces of `rank_sparse_bytes` in all), never
// fewer than a dense piece may have nor more than a reader takes (format/increment.h).
// So a 256 MB table of 256-byte rows alone on its node gets 1 KiB chunks, not 4 KiB.
uint64_t SparsePieceMaxChunks(uint64_t bytes, uint64_t rank_sparse_bytes, uint32_t local_ranks);

// OK when `bytes` is a valid --increment-chunk-bytes; InvalidArgument saying the range
// otherwise.
absl::Status CheckIncrementChunkBytes(uint64_t bytes);

// The chunk size of a piece of local `shape` and `itemsize`-byte elements:
//   - a piece of at most `target` bytes (kSparseChunkBytes when `sparse`) is one chunk, of its own
//     size (so that a later change of the target does not make an unchanged small piece
//     incomparable with its base); an empty piece's chunk is one element;
//   - a box piece of 2 or more dimensions (`flat` false): row blocks of its first
//     dimension, max(1, target / row bytes) rows each; a row larger than the target is cut in
//     windows of the target rounded down to whole elements (a sparse piece keeps whole rows);
//   - a 1-D or flat piece: windows of the target rounded down to whole elements;
//   - more than `max_chunks` chunks: the chunk grows until they fit (in whole rows for row
//     blocks).
// Always a positive multiple of `itemsize` (which must be positive). `target` is any
// positive size here (a per-tensor hint may be below the flag's range); it is rounded up to
// one element.
uint64_t PieceChunkBytes(const std::vector<int64_t>& shape, size_t itemsize, bool flat, uint64_t target,
                         bool sparse, uint64_t max_chunks = format::kMaxPieceChunks);

}  // namespace ckpt::persist
