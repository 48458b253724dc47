#include "daemon/group/structure_uploads.h"

#include <fmt/format.h>

#include <algorithm>

namespace ckpt::group {

void StructureUploads::DropStaleLocked(Clock::time_point now) {
  for (auto it = uploads_.begin(); it != uploads_.end();) {
    if (now - it->second.last > limits_.idle || now - it->second.began > limits_.most) {
      reserved_ -= it->second.total;
      it = uploads_.erase(it);
    } else {
      ++it;
    }
  }
}

void StructureUploads::DropStale(Clock::time_point now) {
  std::lock_guard lock(mu_);
  DropStaleLocked(now);
}

absl::StatusOr<std::optional<std::string>> StructureUploads::Add(uint32_t node, const std::string& digest,
                                                                 uint64_t total, uint64_t offset,
                                                                 std::string_view data, Clock::time_point now) {
  if (total == 0 || total > limits_.part_bytes) {
    return absl::InvalidArgumentError(
        fmt::format("total_bytes {} is not in 1..{} (a part's text)", total, limits_.part_bytes));
  }
  if (data.empty()) return absl::InvalidArgumentError("the chunk holds no data");
  if (offset > total || data.size() > total - offset) {
    return absl::InvalidArgumentError(fmt::format("a chunk of {} bytes at offset {} lies beyond total_bytes {}",
                                                  data.size(), offset, total));
  }
  const std::pair<uint32_t, std::string> key{node, digest};
  std::lock_guard lock(mu_);
  DropStaleLocked(now);
  auto it = uploads_.find(key);
  if (offset == 0) {
    if (it != uploads_.end()) {
      reserved_ -= it->second.total;
      uploads_.erase(it);
    }
    const size_t mine = static_cast<size_t>(std::count_if(
        uploads_.begin(), uploads_.end(), [&](const auto& u) { return u.first.first == node; }));
    if (mine >= limits_.per_node) {
      return absl::ResourceExhaustedError(
          fmt::format("node {} is uploading {} parts already (at most {})", node, mine, limits_.per_node));
    }
    if (reserved_ + total > limits_.total_bytes) {
      return absl::ResourceExhaustedError(fmt::format(
          "the coordinator is receiving {} bytes of parts already (at most {}); try again shortly", reserved_,
          limits_.total_bytes));
    }
    Upload started;
    started.total = total;
    started.text.reserve(total);  // may throw: nothing is counted yet
    started.began = now;
    it = uploads_.emplace(key, std::move(started)).first;
    reserved_ += total;
  } else if (it == uploads_.end() || it->second.total != total || it->second.text.size() != offset) {
    // Out of order, or an upload dropped as stale: the node starts again from offset 0.
    return absl::FailedPreconditionError(
        fmt::format("no upload of structure {} continues at offset {} (send it again from offset 0)", digest,
                    offset));
  }
  Upload& upload = it->second;
  upload.text.append(data);
  upload.last = now;
  if (upload.text.size() < upload.total) return std::optional<std::string>();
  std::string text = std::move(upload.text);
  reserved_ -= upload.total;
  uploads_.erase(it);
  return std::optional<std::string>(std::move(text));
}

size_t StructureUploads::bytes() const {
  std::lock_guard lock(mu_);
  return reserved_;
}

}  // namespace ckpt::group
