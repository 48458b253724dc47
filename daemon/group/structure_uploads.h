// Parts too large for one gRPC message (a node whose ranks hold hundreds of thousands of
// tensor pieces: 64 MiB is about 290,000 of them) reach the coordinator in chunks before
// their prepare, which then names only the structure's digest. This table holds the
// uploads in progress: by node and structure (a node's jobs upload apart), chunks in
// order, bounded in bytes, in number per node and in age, so that a node that stops
// halfway costs nothing for long.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "absl/status/statusor.h"

namespace ckpt::group {

class StructureUploads {
 public:
  using Clock = std::chrono::steady_clock;

  struct Limits {
    size_t part_bytes = size_t{256} << 20;  // one part's text (about 1.1 million tensor pieces)
    size_t total_bytes = size_t{1} << 30;   // every upload in progress, in all
    size_t per_node = 2;                     // uploads in progress per node
    std::chrono::seconds idle{60};           // an upload with no chunk for this long is dropped
    std::chrono::seconds most{300};          // and one not done this long after it began
  };

  explicit StructureUploads(Limits limits) : limits_(limits) {}

  // A chunk of `node`'s part of structure `digest` whose text is `total` bytes: at `offset`
  // 0 it starts the upload (again); otherwise it continues it where it stopped. The whole
  // text once the last chunk came.
  absl::StatusOr<std::optional<std::string>> Add(uint32_t node, const std::string& digest, uint64_t total,
                                                  uint64_t offset, std::string_view data, Clock::time_point now);

  // Drops uploads idle or running too long (also done on every chunk).
  void DropStale(Clock::time_point now);

  size_t bytes() const;  // reserved by uploads in progress

 private:
  struct Upload {
    uint64_t total = 0;
    std::string text;
    Clock::time_point began, last;
  };
  void DropStaleLocked(Clock::time_point now);

  const Limits limits_;
  mutable std::mutex mu_;
  std::map<std::pair<uint32_t, std::string>, Upload> uploads_;  // by node and digest
  size_t reserved_ = 0;  // the totals of uploads_
};

}  // namespace ckpt::group
