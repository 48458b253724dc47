// A rank's base: what its previous committed step holds, per piece and chunk, and where each
// chunk's bytes are (docs/design/incremental.md, section 1). Built from that step's manifest
// (version 5 only: older files are untagged, so never referenced); what an incremental write
// compares its chunks with (increment_plan.h). Pure.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "format/increment.h"
#include "format/manifest.h"

namespace ckpt::persist {

// Where one chunk of a base piece is: always in the file of the step that wrote it (one hop).
// 24 bytes a chunk, as the design budgets (6 MB per TB at 4 MiB chunks): the checksum is an
// integer, not the manifest's "xxh3:" text (8 bytes instead of a 21-character string on the
// heap), and the file is an index into RankBase::files instead of a name per chunk.
struct ChunkWhere {
  uint64_t checksum = 0;  // XXH3-64 of the chunk
  uint64_t at = 0;        // where the chunk begins in that file's data region
  uint32_t file = 0;      // index into RankBase::files
  // Whether the chunk's bytes directly follow the previous chunk's in the same entry of that
  // file (the same whole piece or extent): only such chunks may share one reference extent,
  // since a reader wants each extent inside one entry.
  bool continues = false;
};
static_assert(sizeof(ChunkWhere) == 24, "a base costs 24 bytes a chunk (docs/design/incremental.md, section 1)");

struct PieceBase {
  std::string dtype;
  std::vector<int64_t> shape, offset;
  std::vector<format::ElementRange> flat;
  uint64_t bytes = 0;
  uint64_t chunk_bytes = 0;
  std::vector<ChunkWhere> chunks;  // format::PieceChunks(bytes, chunk_bytes) of them
};

// A train-state blob of the base, and where its bytes are.
struct BlobWhere {
  uint64_t checksum = 0;
  uint64_t bytes = 0;
  uint64_t at = 0;
  uint32_t file = 0;  // index into RankBase::files
};

struct RankBase {
  uint64_t step = 0;
  uint64_t run = 0;
  uint32_t rank = 0;
  // Every file a chunk or blob of the base is in: the base step's own file first, then its
  // origins of this rank (step, run, rank, name and size: what a step referencing them lists).
  std::vector<format::Origin> files;
  std::map<std::string, PieceBase> pieces;      // by tensor name
  std::map<std::string, BlobWhere> train_state;  // by blob name
};

// The base that `manifest` (a committed step, as parsed) gives `rank`. FailedPrecondition
// for a manifest of version 1 to 4 (not referenceable: a save against it is full), an index
// (its ranks are in its parts); NotFound when it does not list the rank. A piece the base
// cannot describe (several pieces of one tensor on the rank, no chunk size) is left out, so
// that it is written whole.
absl::StatusOr<RankBase> BaseFromManifest(const format::Manifest& manifest, uint32_t rank);

}  // namespace ckpt::persist
