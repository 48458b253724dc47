#include "cuda/device.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

namespace ckpt::cuda {

const DeviceInfo& DetectDevices() {
  static const DeviceInfo info = [] {
    DeviceInfo d;
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      d.reason = fmt::format("{}: {}", cudaGetErrorName(err), cudaGetErrorString(err));
    } else if (count == 0) {
      d.reason = "no CUDA device";
    } else {
      d.device_count = count;
    }
    return d;
  }();
  return info;
}

}  // namespace ckpt::cuda
