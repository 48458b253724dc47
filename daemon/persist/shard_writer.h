// Writes one rank's staged snapshot as a safetensors shard. The interface is what the
// persist stage depends on; MakeShardWriter implements it over any storage::Store.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "storage/store.h"
#include "daemon/staging/staged_shard.h"
#include "format/manifest.h"  // ShardFileName

namespace ckpt::persist {

using daemon::StagedShard;
struct RankWritePlan;  // increment_plan.h

struct WrittenShard {
  std::string file;  // name within the step directory
  uint64_t bytes = 0;
  std::map<std::string, std::string> checksums;  // entry name -> "xxh3:..."
  // Entry name -> the checksum of each kChecksumChunkBytes (entries longer than one chunk).
  std::map<std::string, std::vector<std::string>> chunk_checksums;
  // Written in format version 5 (--increments on: increment_writer.h): the plan it was laid
  // out by, which gives the manifest its pieces, train state and increment; and what keeps
  // the step it references from retention until this one ends.
  std::shared_ptr<const RankWritePlan> plan;
  std::shared_ptr<void> base_pin;
};

class ShardWriter {
 public:
  virtual ~ShardWriter() = default;
  // Writes `shard` into `dir` and makes it durable (fsync) before returning. Streams the
  // data region in order as it lands (see StagedShard::landed).
  virtual absl::StatusOr<WrittenShard> Write(const StagedShard& shard, const std::string& dir) = 0;
};

using ShardWriterPtr = std::unique_ptr<ShardWriter>;

// `between_chunks`, if set, runs between the writer's large writes (ckptd passes a wait for
// staging copies to finish, so persisting never slows what trainers wait for).
ShardWriterPtr MakeShardWriter(storage::StorePtr store, std::function<void()> between_chunks = {});

}  // namespace ckpt::persist
