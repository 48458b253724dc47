// CUDA driver functions fetched through the runtime (cudaGetDriverEntryPointByVersion), so
// that binaries link only libcudart and still start on machines without a driver.
#pragma once

namespace ckpt::cuda {

// The driver function `symbol` (as of CUDA 12.0's ABI), or null where it is unavailable.
void* DriverEntryPoint(const char* symbol);

}  // namespace ckpt::cuda
