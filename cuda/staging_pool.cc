#include "cuda/staging_pool.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <fmt/format.h>

#include "common/status.h"
#include "cuda/cuda_check.h"
#include "cuda/device_guard.h"
#include "shm/prefault.h"

namespace ckpt::cuda {

using shm::PopulateWritable;
using shm::PrefaultWritable;

constexpr size_t kStep = 64u << 20;  // background prefault granularity

StagingBlock::~StagingBlock() { pool_->Release(offset_, size_); }

absl::StatusOr<StagingPoolPtr> StagingPool::Create(size_t bytes, bool prefault) {
  if (bytes == 0) return absl::InvalidArgumentError("staging budget must be positive");
  bytes = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    return ErrnoStatus(errno, fmt::format("map {} bytes of staging memory", bytes));
  }
  // Huge pages first, then populate: populating first would fix 4 KiB pages in place.
  ::madvise(p, bytes, MADV_HUGEPAGE);
  StagingPoolPtr pool(new StagingPool(static_cast<char*>(p), bytes));
  if (prefault) {
    if (shm::PopulateWritable(p, std::min(bytes, kStep))) {
      // Tens of GiB take seconds: serve meanwhile (populating skips pages in use).
      pool->prefault_done_ = false;
      pool->prefault_thread_ = std::thread([raw = pool.get()] {
        for (size_t off = kStep; off < raw->capacity_ && !raw->stop_prefault_; off += kStep) {
          shm::PopulateWritable(raw->base_ + off, std::min(kStep, raw->capacity_ - off));
        }
        raw->prefault_done_ = true;
      });
    } else {
      (void)PrefaultWritable(p, bytes);  // old kernel: touch every page (our own memory)
    }
  }
  return pool;
}

StagingPool::StagingPool(char* base, size_t capacity) : base_(base), capacity_(capacity) {
  free_[0] = capacity;
}

StagingPool::~StagingPool() {
  stop_prefault_ = true;
  if (prefault_thread_.joinable()) prefault_thread_.join();
  if (pinned_) {
    DeviceGuard guard(0);
    (void)Driver()->cuMemHostUnregister(base_);
  }
  ::munmap(base_, capacity_);
}

absl::Status StagingPool::PinForCuda() {
  if (pinned_) return absl::OkStatus();
  CKPT_CUDA_DRIVER_OR_RETURN(driver, "pinning the staging pool");
  // Portable: pinned for every device's context, from device 0's (a context must be current).
  DeviceGuard guard(0);
  CKPT_CUDA_RETURN_IF_ERROR(guard.status(), "staging pool");
  CKPT_CUDA_RETURN_IF_ERROR(driver->cuMemHostRegister(base_, capacity_, CU_MEMHOSTREGISTER_PORTABLE),
                            fmt::format("staging pool ({} bytes)", capacity_));
  pinned_ = true;
  return absl::OkStatus();
}

absl::StatusOr<StagingBlockPtr> StagingPool::Allocate(size_t bytes) {
  size_t size = std::max(kAlignment, (bytes + kAlignment - 1) / kAlignment * kAlignment);
  std::lock_guard lock(mu_);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < size) continue;
    size_t offset = it->first;
    size_t rest = it->second - size;
    free_.erase(it);
    if (rest > 0) free_[offset + size] = rest;
    used_ += size;
    return std::make_unique<StagingBlock>(this, offset, size, base_ + offset);
  }
  return absl::ResourceExhaustedError(fmt::format(
      "staging budget exhausted: {} bytes needed, {} of {} in use", size, used_, capacity_));
}

void StagingPool::Release(size_t offset, size_t size) {
  std::lock_guard lock(mu_);
  used_ -= size;
  auto [it, inserted] = free_.emplace(offset, size);
  auto next = std::next(it);
  if (next != free_.end() && it->first + it->second == next->first) {
    it->second += next->second;
    free_.erase(next);
  }
  if (it != free_.begin()) {
    auto prev = std::prev(it);
    if (prev->first + prev->second == it->first) {
      prev->second += it->second;
      free_.erase(it);
    }
  }
}

size_t StagingPool::used() const {
  std::lock_guard lock(mu_);
  return used_;
}

}  // namespace ckpt::cuda
