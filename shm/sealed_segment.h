// Shared memory that its other users cannot shrink: a memfd with its size sealed. The
// daemon's control blocks are these, handed to the trainer as a file descriptor (SCM_RIGHTS),
// so a trainer that maps one read-write still cannot truncate it under the daemon, whose
// next read would otherwise die with SIGBUS.
//
// A segment may live in huge pages (hugetlbfs, the pool an operator reserves with
// vm.nr_hugepages): every page fault, page-table walk and protection change then covers
// 2 MiB instead of 4 KiB, which is what makes moving gigabytes of tensors into shared memory,
// mapping them in ckptd and write-protecting them for a snapshot cheap (docs/benchmarks.md).
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/unique_fd.h"

namespace ckpt::shm {

class SealedSegment {
 public:
  // A new memfd of `size` bytes, every page reserved (a full tmpfs is ResourceExhausted
  // here, not SIGBUS later), sealed against shrinking, growing and further sealing, mapped.
  static absl::StatusOr<std::unique_ptr<SealedSegment>> Create(const std::string& debug_name,
                                                               size_t size);
  // The same in huge pages; `size` must be a multiple of HugePageSize(). ResourceExhausted
  // when the huge-page pool cannot hold it (the caller then falls back to Create).
  static absl::StatusOr<std::unique_ptr<SealedSegment>> CreateHuge(const std::string& debug_name,
                                                                   size_t size);
  // Maps a segment received from its creator, if CheckReceivable() says it may.
  static absl::StatusOr<std::unique_ptr<SealedSegment>> Map(UniqueFd fd);
  // OK when `fd` is what Map() takes: shared memory sealed against shrinking (its creator
  // could otherwise truncate it and fault us), not empty, with every page allocated (a
  // page that cannot be had on first touch would fault us too). A line saying why not
  // otherwise. Cheap: no mapping. Holes can still be punched later (F_SEAL_SHRINK does not
  // forbid FALLOC_FL_PUNCH_HOLE); copies then fault the pages in again, at the mapper's
  // cost, but never fail or fault.
  static absl::Status CheckReceivable(int fd);

  ~SealedSegment();
  SealedSegment(const SealedSegment&) = delete;
  SealedSegment& operator=(const SealedSegment&) = delete;

  void* data() const { return data_; }
  size_t size() const { return size_; }
  bool huge() const { return huge_; }
  int fd() const { return fd_.get(); }  // to pass to the other side
  // Closes the descriptor; the mapping stays. A daemon that holds thousands of trainers'
  // arenas keeps one mapping each, not one descriptor each.
  void DropFd() { fd_.reset(); }

 private:
  SealedSegment(UniqueFd fd, void* data, size_t size, bool huge)
      : fd_(std::move(fd)), data_(data), size_(size), huge_(huge) {}
  static absl::StatusOr<std::unique_ptr<SealedSegment>> CreateWith(const std::string& debug_name,
                                                                   size_t size, bool huge);

  UniqueFd fd_;
  void* data_;
  size_t size_;
  bool huge_;
};

using SealedSegmentPtr = std::unique_ptr<SealedSegment>;

// The default huge page size (/proc/meminfo "Hugepagesize"); 0 where the kernel has none.
size_t HugePageSize();

// True when `fd` is a file in huge pages (hugetlbfs).
bool IsHugeTlb(int fd);

}  // namespace ckpt::shm
