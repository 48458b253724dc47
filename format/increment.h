// Incremental steps (format version 5; docs/format.md, "Incremental steps"): a step whose
// unchanged chunks are not written again but referenced where an earlier step wrote them.
// What a version 5 manifest adds to the others: each piece's chunk size and, for a piece not
// written whole in this step's file, its extents; the step's origins (the earlier steps'
// files it reads from); tagged shard file names. The types, their JSON and their checks.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "format/json_text.h"

namespace ckpt::format {

// Written for every step of a job with increments on, full ones too, node-scoped manifests
// and indexes included (a scope or an index says which kind; versions 3 and 4 are those
// kinds without increments).
inline constexpr int kManifestIncrementFormatVersion = 5;

// ckptd cuts a piece into at most this many chunks (its chunk grows to fit), so that its
// checksums and extents stay a bounded part of a manifest; a sparse table's piece may have
// more, its share of a node's budget for them (daemon/persist/increment_chunks.h).
inline constexpr uint64_t kMaxPieceChunks = 65536;
// What a reader takes: no piece has more chunks (or extents).
inline constexpr uint64_t kMaxReadPieceChunks = uint64_t{1} << 20;

// A run of a piece's chunks [chunk_begin, chunk_end), stored one after another from byte `at`
// of a file's data region: the piece's rank's own file in this step (no `step`: a
// "__delta__" entry there), or the file Increment::origins lists for step `step` and that rank.
struct Extent {
  uint32_t chunk_begin = 0;
  uint32_t chunk_end = 0;
  std::optional<uint64_t> step;
  uint64_t at = 0;
  bool operator==(const Extent&) const = default;
};

// A step of a job as one run saved it: a step number saved again by a new run is another.
struct StepRun {
  uint64_t step = 0;
  uint64_t run = 0;
  auto operator<=>(const StepRun&) const = default;
};

// One rank's file of an earlier step that this step reads from.
struct Origin {
  uint64_t step = 0;
  uint64_t run = 0;
  uint32_t rank = 0;
  std::string file;    // TaggedShardFileName(rank, ...)
  uint64_t bytes = 0;  // the file's size: checked when it is opened
  bool operator==(const Origin&) const = default;
};

struct Increment {
  // Of the whole step, in every kind of manifest (as StepBytes): bytes in this step's own
  // files, and bytes its pieces and train state read from origins.
  uint64_t own_bytes = 0;
  uint64_t referenced_bytes = 0;
  // Every step whose files this manifest's ranks reference: what keeps them on the store
  // (retention). Ascending, each once; in an index, the union of its parts'.
  std::vector<StepRun> origin_steps;
  // One per (step, rank) referenced, ascending by (step, rank). Empty in an index (its parts
  // list theirs): an index of 80,000 ranks would otherwise carry millions.
  std::vector<Origin> origins;

  const Origin* Find(uint64_t step, uint32_t rank) const;
};

// "rank-00003.18f3a9c2d4e5b6a7.safetensors": a version 5 shard file, tagged with 16 hex
// digits of the writing session's registration time, so that no two runs' files of a job
// ever have one name (a step number saved again, a retired step still read).
std::string TaggedShardFileName(uint32_t rank, uint64_t tag);
// Whether `name` is exactly such a name of `rank`.
bool IsTaggedShardFileName(std::string_view name, uint32_t rank);

// "step-00001000.held-18f3a9c2d4e5b6a7": where a retired step that later steps still
// reference keeps its files on a local disk (docs/format.md, "Retention of referenced steps").
std::string HeldStepDirName(uint64_t step, uint64_t run);
// The step and run of such a name; false for anything else.
bool ParseHeldStepDirName(std::string_view name, StepRun* held);
// Where a reader looks for an origin's file, in order, relative to the job's directory:
// the step's own directory (as CheckpointStore::StepKey names it), then the held one.
std::vector<std::string> OriginFileKeys(const Origin& origin);

// How many chunks of `chunk_bytes` a piece of `bytes` has (one at least).
uint64_t PieceChunks(uint64_t bytes, uint64_t chunk_bytes);
// The bytes [first, second) of the piece that its chunks [chunk_begin, chunk_end) cover.
std::pair<uint64_t, uint64_t> ChunkSpan(uint64_t piece_bytes, uint64_t chunk_bytes, uint64_t chunk_begin,
                                        uint64_t chunk_end);

// "__delta__.<c0>-<c1>.<name>": the entry of a rank's own file holding chunks [c0, c1) of
// its piece of `tensor`.
std::string DeltaEntryName(const std::string& tensor, uint32_t chunk_begin, uint32_t chunk_end);
// Whether a file's entry `entry` may hold bytes of `tensor`: its own name, or a delta of it.
bool EntryHoldsTensor(std::string_view entry, std::string_view tensor);

// Why `extents` are not a cover of a piece of `chunks` chunks (ascending, contiguous, each
// non-empty, from 0 to `chunks`), or why one names an origin `increment` lacks for `rank`;
// empty when they are.
std::string ExtentsProblem(const std::vector<Extent>& extents, uint64_t chunks, uint32_t rank,
                           const Increment& increment, uint64_t step);
// Why `increment` does not hold together for step `step` (origins sorted, each once, tagged
// and named for their rank, none of this step; origin_steps their set, or in an index any
// ascending set); empty when it does.
std::string IncrementProblem(const Increment& increment, uint64_t step, bool is_index);

// Adds `more` (the increment of other ranks of the same step) to `into`: origins and
// origin_steps their unions, own and referenced bytes summed.
void AddIncrement(Increment& into, const Increment& more);
// Removes the origins of the ranks `remove` names; origin_steps become those left's.
void RemoveOrigins(Increment& increment, const std::function<bool(uint32_t rank)>& remove);

// The JSON of a manifest's "increment" and a piece's "extents"; the parsers throw
// json_fields::BadField (format/json_fields.h) for a field of a wrong type.
Increment ParseIncrement(const nlohmann::json& j);
std::vector<Extent> ParseExtents(const nlohmann::json& j);
void WriteIncrement(JsonText& w, const Increment& increment);
void WriteExtents(JsonText& w, const std::vector<Extent>& extents);

}  // namespace ckpt::format
