#include "shm/arena.h"

#include <unistd.h>

#include <atomic>
#include <fmt/format.h>

namespace ckpt::shm {

absl::StatusOr<ArenaPtr> Arena::Create(size_t capacity, bool huge_pages) {
  static std::atomic<uint64_t> counter{0};
  // The name shows in /proc/<pid>/fd and /proc/<pid>/maps ("memfd:ckpt-arena.…"), nowhere else.
  std::string name = fmt::format("ckpt-arena.{}.{}", ::getpid(), counter++);
  const size_t huge_page = HugePageSize();
  if (huge_pages && huge_page != 0 && capacity >= kMinHugeArena && huge_page <= capacity / 16) {
    // An empty or too small pool is normal (the operator reserves it): base pages then.
    auto huge = SealedSegment::CreateHuge(name, (capacity + huge_page - 1) / huge_page * huge_page);
    if (huge.ok()) return ArenaPtr(new Arena(std::move(name), std::move(*huge)));
  }
  auto segment = SealedSegment::Create(name, capacity);
  if (!segment.ok()) return segment.status();
  return ArenaPtr(new Arena(std::move(name), std::move(*segment)));
}

absl::StatusOr<size_t> Arena::Allocate(size_t bytes, size_t alignment) {
  size_t offset = (used_ + alignment - 1) / alignment * alignment;
  if (offset + bytes > capacity()) {
    return absl::ResourceExhaustedError(fmt::format(
        "arena {} is full: {} bytes asked, {} of {} used", name(), bytes, used_, capacity()));
  }
  used_ = offset + bytes;
  return offset;
}

}  // namespace ckpt::shm
