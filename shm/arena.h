// A host tensor arena: one sealed memfd (shm/sealed_segment.h) that the trainer allocates
// tensors from and hands to ckptd as a descriptor at registration. It has no name: no other
// process can open it, and neither side can shrink it under the other. Bump allocation;
// tensors live as long as the arena.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "shm/sealed_segment.h"

namespace ckpt::shm {

class Arena {
 public:
  // Creates an arena of at least `capacity` bytes, every page reserved. With `huge_pages`,
  // an arena of 32 MiB or more is made of huge pages when the pool has room (its capacity
  // then rounds up to a whole huge page, wasting at most 1/16), and of base pages otherwise.
  static absl::StatusOr<std::unique_ptr<Arena>> Create(size_t capacity, bool huge_pages = false);
  // The smallest arena worth huge pages.
  static constexpr size_t kMinHugeArena = size_t{32} << 20;

  // Returns the offset of a new zeroed block of `bytes`, aligned to `alignment`.
  absl::StatusOr<size_t> Allocate(size_t bytes, size_t alignment = 64);

  void* at(size_t offset) const { return static_cast<char*>(segment_->data()) + offset; }
  bool Contains(const void* p) const {
    auto* c = static_cast<const char*>(p);
    return c >= static_cast<const char*>(at(0)) && c < static_cast<const char*>(at(0)) + capacity();
  }
  const std::string& name() const { return name_; }  // for messages only
  size_t capacity() const { return segment_->size(); }
  size_t used() const { return used_; }
  int fd() const { return segment_->fd(); }  // what the trainer hands to ckptd
  bool huge() const { return segment_->huge(); }

 private:
  Arena(std::string name, SealedSegmentPtr segment)
      : name_(std::move(name)), segment_(std::move(segment)) {}
  std::string name_;
  SealedSegmentPtr segment_;
  size_t used_ = 0;
};

using ArenaPtr = std::unique_ptr<Arena>;

}  // namespace ckpt::shm
