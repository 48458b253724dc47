// RAII POSIX shared-memory segment (Boost.Interprocess), mapped read-write.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace ckpt::shm {

class Segment {
 public:
  // Creates a new segment of `size` bytes with permission bits `mode`; fails if it exists.
  // The segment is unlinked when this object dies if `unlink_on_destroy` is set.
  static absl::StatusOr<std::unique_ptr<Segment>> Create(const std::string& name, size_t size,
                                                         mode_t mode, bool unlink_on_destroy);
  // Maps an existing segment.
  static absl::StatusOr<std::unique_ptr<Segment>> Open(const std::string& name);
  // Removes the name; existing mappings stay valid. Missing names are not an error.
  static void Unlink(const std::string& name);

  ~Segment();
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  void* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }
  uid_t owner_uid() const { return owner_uid_; }
  // Drops the name now (the mapping stays) and forgets to unlink on destruction.
  void UnlinkNow();

 private:
  struct Impl;
  Segment(std::string name, std::unique_ptr<Impl> impl, bool unlink_on_destroy);

  std::string name_;
  std::unique_ptr<Impl> impl_;
  void* data_ = nullptr;
  size_t size_ = 0;
  uid_t owner_uid_ = 0;
  bool unlink_on_destroy_ = false;
};

using SegmentPtr = std::unique_ptr<Segment>;

}  // namespace ckpt::shm
