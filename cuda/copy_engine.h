// Copies registered buffers into staging memory and back. One interface, several
// same-shaped implementations: the host twin (memcpy on a thread pool) here, the CUDA
// engine (D2H/H2D on the daemon's own streams) beside it.
#pragma once

#include <cstddef>
#include <memory>
#include <span>
#include <string_view>

#include "absl/status/status.h"

namespace ckpt::cuda {

struct CopyRegion {
  void* dst;
  const void* src;
  size_t bytes;
  // The device allocation (an identity, never dereferenced) the region's GPU side lies in:
  // adjacent regions of one allocation are copied as one (CoalesceRegions). Null: never
  // merged (a copy may not span two allocations, even adjacent ones).
  const void* allocation = nullptr;
};

class CopyEngine {
 public:
  virtual ~CopyEngine() = default;
  virtual std::string_view name() const = 0;
  // Copies every region and returns when all bytes have landed. `after`, when not null, is
  // a cudaEvent_t the copy must wait for on the device (the trainer's snapshot point);
  // engines without a device ignore it.
  virtual absl::Status Copy(std::span<const CopyRegion> regions, void* after = nullptr) = 0;
};

using CopyEnginePtr = std::unique_ptr<CopyEngine>;

// memcpy on `threads` threads (the caller is one of them), each copying one contiguous
// share of the job.
CopyEnginePtr MakeHostCopyEngine(int threads);

}  // namespace ckpt::cuda
