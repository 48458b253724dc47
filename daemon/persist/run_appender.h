// Appends runs of memory to a store object, merging each run that continues the last one in
// memory, and writes them kRunWriteBytes at a time (the full shard writer's write size).
// An incremental shard's pieces and chunks are appended one at a time, each hashed just
// before, but are mostly contiguous in staging as in the file: written a chunk (4 MiB) at a
// time, each O_DIRECT write waited for on its own and a 4 KiB write between two wherever a
// piece ended off a block, a full fine-tune's streamed save took longer to durable than the
// full writer's (docs/benchmarks.md, "Full fine-tune").
#pragma once

#include <cstdint>
#include <functional>

#include "absl/status/status.h"
#include "storage/store.h"

namespace ckpt::persist {

inline constexpr uint64_t kRunWriteBytes = 32u << 20;

class RunAppender {
 public:
  // `between_writes` (may be empty) runs before each write: the writer's pause point for
  // tests, as MakeShardWriter's `between_chunks`.
  RunAppender(storage::ObjectWriter& object, std::function<void()> between_writes = {});

  // Takes [from, from + bytes): written once kRunWriteBytes are pending, or by the next Add
  // that does not continue it, or by Flush(). The memory must stay as it is until then.
  absl::Status Add(const char* from, uint64_t bytes);
  // Writes what is pending: before the object is finished.
  absl::Status Flush();

 private:
  absl::Status Write(uint64_t bytes);

  storage::ObjectWriter& object_;
  std::function<void()> between_writes_;
  const char* start_ = nullptr;
  uint64_t pending_ = 0;
};

}  // namespace ckpt::persist
