// The CUDA twin of the host copy engine: device-to-host (staging) and host-to-device
// (restore) copies on the daemon's own streams, with unified addressing deciding the
// direction. Host memory should be page-locked (StagingPool::PinForCuda) for full speed.
#pragma once

#include <cstddef>

#include "absl/status/statusor.h"
#include "cuda/copy_engine.h"

namespace ckpt::cuda {

struct CudaCopyEngineOptions {
  int device = 0;
  int streams = 4;
  size_t chunk_bytes = 64u << 20;
};

// FailedPrecondition when the device cannot be used (no driver, no device, bad ordinal).
absl::StatusOr<CopyEnginePtr> MakeCudaCopyEngine(const CudaCopyEngineOptions& options);

}  // namespace ckpt::cuda
