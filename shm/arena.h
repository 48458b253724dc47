// A host tensor arena: one shared-memory segment that the trainer allocates tensors from
// and the daemon maps by name at registration. Bump allocation; tensors live as long as
// the arena.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "shm/segment.h"

namespace ckpt::shm {

class Arena {
 public:
  // Creates an arena of `capacity` bytes with a fresh unique name (pid + counter + random),
  // readable and writable by the owner and its group. `group` (when not -1) becomes the
  // segment's group: the daemon's, so that a daemon running as its own user can open the
  // arena of a trainer that is a member of that group only as a supplementary group.
  static absl::StatusOr<std::unique_ptr<Arena>> Create(size_t capacity,
                                                       gid_t group = static_cast<gid_t>(-1));

  // Returns the offset of a new zeroed block of `bytes`, aligned to `alignment`.
  absl::StatusOr<size_t> Allocate(size_t bytes, size_t alignment = 64);

  void* at(size_t offset) const { return static_cast<char*>(segment_->data()) + offset; }
  const std::string& name() const { return segment_->name(); }
  size_t capacity() const { return segment_->size(); }
  size_t used() const { return used_; }
  // The daemon maps the arena during registration; afterwards the name is no longer needed
  // and unlinking it means a crashed trainer leaks nothing in /dev/shm.
  void UnlinkName() { segment_->UnlinkNow(); }

 private:
  explicit Arena(SegmentPtr segment) : segment_(std::move(segment)) {}
  SegmentPtr segment_;
  size_t used_ = 0;
};

using ArenaPtr = std::unique_ptr<Arena>;

}  // namespace ckpt::shm
