// The plan of one rank's incremental write (docs/design/incremental.md, section 5): given its
// base and the chunk checksums of what it is about to write, which pieces go whole, which
// chunks are written again as "__delta__" entries and which are referenced where an earlier
// step wrote them (one hop), which train-state blobs are referenced; the file's entries in
// order, with where each begins in the data region, and the manifest's fields of every
// piece. A rebase (--full-every) also writes again what sits in files that are mostly dead.
// Pure: no I/O, nothing of the daemon; the writer lays the file out as the plan says.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/persist/increment_base.h"
#include "daemon/persist/increment_chunks.h"
#include "format/increment.h"
#include "format/manifest.h"

namespace ckpt::persist {

// A train-state blob of 64 KiB or more equal to its base's is referenced; smaller ones are
// written (a reference would cost about what it saves).
inline constexpr uint64_t kReferencedBlobMinBytes = uint64_t{64} << 10;
// After a rebase a rank references at most this many files.
inline constexpr size_t kRebaseMaxOrigins = 16;
// A piece may have max(this, chunks / 2) extents (so its extents never outnumber half its
// chunk checksums in the manifest): one that needs more has its shortest referenced runs
// written again until it fits (whole when that is more than half of it). chunks / 8 held a
// table updated at 1% random rows to about a fifth of its bytes per step; chunks / 2 to 3%.
inline constexpr uint64_t kMinExtentLimit = 64;

// A piece about to be written: its placement, its size, its chunking (PieceChunkBytes) and
// the XXH3-64 of each of its format::PieceChunks(bytes, chunk_bytes) chunks.
struct PieceToWrite {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape, offset;
  std::vector<format::ElementRange> flat;
  uint64_t bytes = 0;
  uint64_t chunk_bytes = 0;
  std::vector<uint64_t> chunk_checksums;
  std::string checksum;  // "xxh3:..." of the whole piece, copied into the manifest
};

struct BlobToWrite {
  std::string name;
  uint64_t bytes = 0;
  uint64_t checksum = 0;  // XXH3-64
};

// One rank's write: its step, its own file (format::TaggedShardFileName), pieces in the order
// the file should hold them, train state.
struct RankWrite {
  uint64_t step = 0;
  uint32_t rank = 0;
  std::string file;
  std::vector<PieceToWrite> pieces;
  std::vector<BlobToWrite> train_state;
};

struct PlanOptions {
  bool full = false;    // save(full=True): nothing referenced
  bool rebase = false;  // RebaseDue: write again what sits in mostly dead or surplus files
};

// Whether the save about to be planned is a rebase: `saves_since` saves of the rank were
// committed since its last full save or rebase (0 right after one), so this is save
// saves_since + 1 of the cycle. `full_every` 0: never.
bool RebaseDue(uint32_t saves_since, uint32_t full_every);

enum class WriteMode { kFull, kIncrement, kRebase };
const char* WriteModeName(WriteMode mode);  // "full", "increment", "rebase"

// One entry of the rank's own file, in file order.
struct PlannedEntry {
  std::string name;  // the tensor's, format::DeltaEntryName, or format::TrainStateKey
  std::string dtype;
  std::vector<int64_t> shape;  // [rows, ...] for a delta of whole rows, [elements] otherwise
  bool train_state = false;    // the source is RankWrite::train_state[index], else pieces[index]
  size_t index = 0;
  uint64_t begin = 0, end = 0;  // the source's bytes this entry holds
  uint64_t at = 0;              // where it begins in the file's data region
};

struct PlannedPiece {
  // The manifest's piece: rank, placement, checksum, chunk_bytes and chunk_checksums; and
  // file/begin/end when written whole, else extents (`at` filled in).
  format::TensorShard shard;
  bool whole = true;
  std::string why;  // "new", "80% changed", "3 extents", ... (for logs and tests)
};

struct RankWritePlan {
  WriteMode mode = WriteMode::kFull;
  std::string reason;  // one line: "full: no base", "increment: 2% written", ...
  std::vector<PlannedEntry> entries;
  std::vector<PlannedPiece> pieces;  // in RankWrite::pieces' order
  std::map<std::string, format::TrainStateEntry> train_state;
  std::vector<format::Origin> origins;  // every file referenced, ascending by step
  uint64_t data_bytes = 0;        // the own file's data region: every entry's bytes
  uint64_t referenced_bytes = 0;  // bytes of pieces and blobs referenced in origins
  // Bytes of the pieces' chunks unlike the base's (a piece not comparable with the base
  // counts whole), whatever was decided: what a writer that streams a full save learns of
  // how much changed, to choose the mode of the rank's next save (design, section 5).
  uint64_t changed_bytes = 0;
};

// Plans `write` against `base` (nullptr: none, or increments off: all whole). InvalidArgument
// when `write` does not hold together (a piece's checksums not one per chunk, a chunk size
// that is not a positive multiple of its dtype's, an unknown dtype, a base of another rank).
absl::StatusOr<RankWritePlan> PlanRankWrite(const RankBase* base, const RankWrite& write,
                                            const PlanOptions& options);

// The rank's share of the manifest's `increment` once its file is written (`file_bytes`:
// header and data): own and referenced bytes, origins and origin steps.
format::Increment PlanIncrement(const RankWritePlan& plan, uint64_t file_bytes);

}  // namespace ckpt::persist
