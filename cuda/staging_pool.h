// The daemon's staging memory: one region of --staging-bytes allocated (and pre-faulted)
// up front, carved into blocks per snapshot. On a GPU host the same region is page-locked
// for the CUDA copy engine. Thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <atomic>
#include <mutex>
#include <thread>

#include "absl/status/statusor.h"

namespace ckpt::cuda {

class StagingPool;

// A block of staging memory; returns itself to the pool when destroyed.
class StagingBlock {
 public:
  StagingBlock(StagingPool* pool, size_t offset, size_t size, char* data)
      : pool_(pool), offset_(offset), size_(size), data_(data) {}
  ~StagingBlock();
  StagingBlock(const StagingBlock&) = delete;
  StagingBlock& operator=(const StagingBlock&) = delete;

  char* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  StagingPool* pool_;  // outlives every block (the daemon destroys blocks first)
  size_t offset_;
  size_t size_;
  char* data_;
};

using StagingBlockPtr = std::unique_ptr<StagingBlock>;

class StagingPool {
 public:
  static constexpr size_t kAlignment = 4096;

  // Maps `bytes` of anonymous memory. `prefault` populates every page so that snapshots do
  // not pay for page faults: in the background where the kernel allows it (the pool is
  // usable at once; see prefault_done()), else before returning.
  static absl::StatusOr<std::unique_ptr<StagingPool>> Create(size_t bytes, bool prefault);
  ~StagingPool();

  // First-fit allocation; ResourceExhausted when no free range is large enough.
  absl::StatusOr<StagingBlockPtr> Allocate(size_t bytes);

  // Page-locks the whole pool for CUDA (cudaHostRegister), so device copies into it run at
  // full DMA speed. Needs a usable device; unregistered again on destruction.
  absl::Status PinForCuda();
  bool pinned() const { return pinned_; }

  size_t capacity() const { return capacity_; }
  bool prefault_done() const { return prefault_done_.load(); }
  size_t used() const;
  char* base() const { return base_; }

 private:
  friend class StagingBlock;
  StagingPool(char* base, size_t capacity);
  void Release(size_t offset, size_t size);

  char* base_;
  size_t capacity_;
  bool pinned_ = false;
  std::atomic<bool> prefault_done_{true};
  std::atomic<bool> stop_prefault_{false};
  std::thread prefault_thread_;
  mutable std::mutex mu_;
  std::map<size_t, size_t> free_;  // offset -> size, coalesced
  size_t used_ = 0;
};

using StagingPoolPtr = std::unique_ptr<StagingPool>;

}  // namespace ckpt::cuda
