#include "shm/arena.h"

#include <unistd.h>

#include <cerrno>

#include <atomic>
#include <fmt/format.h>
#include <random>

namespace ckpt::shm {

absl::StatusOr<ArenaPtr> Arena::Create(size_t capacity, gid_t group) {
  static std::atomic<uint64_t> counter{0};
  std::string name = fmt::format("/ckpt-arena.{}.{}.{:08x}", ::getpid(), counter++,
                                 std::random_device{}());
  auto segment = Segment::Create(name, capacity, 0660, /*unlink_on_destroy=*/true);
  if (!segment.ok()) return segment.status();
  if (group != static_cast<gid_t>(-1)) {
    // Allowed only for a group this process is in; where it is not, the arena keeps the
    // process's own group (the daemon then needs to share that one): not an error here.
    if (::chown(("/dev/shm" + name).c_str(), static_cast<uid_t>(-1), group) != 0) {
      errno = 0;
    }
  }
  return ArenaPtr(new Arena(std::move(*segment)));
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
