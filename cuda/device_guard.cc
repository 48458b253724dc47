#include "cuda/device_guard.h"

#include <map>
#include <mutex>

namespace ckpt::cuda {

CUresult PrimaryContext(int ordinal, CUcontext* context) {
  static std::mutex mu;
  static std::map<int, CUcontext> retained;  // by ordinal; guarded by mu
  const DriverApi* d = Driver();
  if (d == nullptr) return CUDA_ERROR_NOT_INITIALIZED;
  std::lock_guard lock(mu);
  if (auto it = retained.find(ordinal); it != retained.end()) {
    *context = it->second;
    return CUDA_SUCCESS;
  }
  CUdevice device = 0;
  if (CUresult r = d->cuDeviceGet(&device, ordinal); r != CUDA_SUCCESS) return r;
  if (CUresult r = d->cuDevicePrimaryCtxRetain(context, device); r != CUDA_SUCCESS) return r;
  retained[ordinal] = *context;
  return CUDA_SUCCESS;
}

}  // namespace ckpt::cuda
