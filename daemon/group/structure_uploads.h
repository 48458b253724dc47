// Parts too large for one gRPC message (a node whose ranks hold hundreds of thousands of
// tensor pieces: 64 MiB is about 290,000 of them) reach the coordinator in chunks before
// their prepare, which then names only the structure's digest. This table holds the
// uploads in progress: one per node, chunks in order, bounded in bytes and in age, so that
// a node that stops halfway costs nothing for long.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace ckpt::group {

class StructureUploads {
 public:
  using Clock = std::chrono::steady_clock;

  struct Limits {
    size_t part_bytes = size_t{1} << 30;   // one part's text
    size_t total_bytes = size_t{1} << 30;  // every upload in progress, in all
    std::chrono::seconds idle{60};         // an upload with no chunk for this long is dropped
  };

  explicit StructureUploads(Limits limits) : limits_(limits) {}

  // A chunk of `node`'s part whose text is `total` bytes: at `offset` 0 it starts a new
  // upload (replacing the node's unfinished one); otherwise it continues the node's upload
  // of the same digest and size where it stopped. The whole text once the last chunk came.
  absl::StatusOr<std::optional<std::string>> Add(uint32_t node, const std::string& digest, uint64_t total,
                                                  uint64_t offset, std::string_view data, Clock::time_point now);

  size_t bytes() const;  // reserved by uploads in progress

 private:
  struct Upload {
    std::string digest;
    uint64_t total = 0;
    std::string text;
    Clock::time_point last;
  };
  void DropIdleLocked(Clock::time_point now);

  const Limits limits_;
  mutable std::mutex mu_;
  std::map<uint32_t, Upload> uploads_;
  size_t reserved_ = 0;  // the totals of uploads_
};

}  // namespace ckpt::group
