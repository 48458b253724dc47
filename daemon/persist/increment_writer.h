// Writes one rank's staged snapshot as a format version 5 shard (--increments on,
// docs/design/incremental.md, section 5): every piece hashed in chunks once it has landed,
// the write planned against the rank's base (increment_plan.h), then the file laid out as
// planned, straight from staging memory: the pieces written whole, the changed runs of the
// others as "__delta__" entries, the unchanged ones left where an earlier step wrote them.
// The base step is pinned against retention from the plan until the step ends.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/persist/increment_bases.h"
#include "daemon/persist/retention_keeper.h"
#include "daemon/persist/shard_writer.h"
#include "daemon/staging/staged_snapshot.h"
#include "format/checkpoint_store.h"
#include "format/safetensors.h"
#include "storage/store.h"

namespace ckpt::persist {

// Snapshot metadata asking for a full save: every piece written whole, nothing referenced
// (CheckpointManager.save(full=True)).
inline constexpr char kFullSaveKey[] = "ckptd.full";

class RunAppender;  // run_appender.h

struct IncrementOptions {
  uint64_t chunk_bytes = kDefaultIncrementChunkBytes;  // --increment-chunk-bytes
  uint32_t full_every = 20;                            // --full-every (0: never a rebase)
  // The largest safetensors header a file may have (tests lower it: CKPTD_FAULT=header-limit:N).
  uint64_t max_header_bytes = format::kMaxWrittenHeaderBytes;
};

class IncrementWriter {
 public:
  // `between_chunks` as MakeShardWriter's.
  IncrementWriter(format::CheckpointStore& store, IncrementBases& bases, RetentionKeeper& retention,
                  IncrementOptions options, std::function<void()> between_chunks = {});

  // Writes the snapshot into `dir` (fsynced before it returns). The WrittenShard carries the
  // plan, from which the manifest's pieces, train state and increment are made
  // (commit/manifest_builder.h), and the base's pin.
  absl::StatusOr<WrittenShard> Write(const daemon::StagedSnapshot& snapshot, const std::string& dir);

 private:
  // Every piece whole, each chunk hashed as it is appended, in one pass as a full shard is:
  // for a rank with no base, or whose last write found most of its bytes changed (a full
  // fine-tune), where planning first would only delay the write.
  absl::StatusOr<WrittenShard> Stream(const daemon::StagedSnapshot& snap, const std::string& dir,
                                      const RankBase* base, RankWrite write);
  // The header, then `body`; the file's bytes. Errors name the file.
  // `body` appends the data region through a RunAppender, which writes contiguous runs of
  // staging memory in large pieces.
  absl::StatusOr<uint64_t> WriteFile(const std::string& key, const std::string& header,
                                     const std::function<absl::Status(RunAppender&)>& body);
  static bool MostlyChanged(const RankWritePlan& plan, const RankWrite& write);

  format::CheckpointStore& store_;
  IncrementBases& bases_;
  RetentionKeeper& retention_;
  const IncrementOptions options_;
  std::function<void()> between_chunks_;
};

}  // namespace ckpt::persist
