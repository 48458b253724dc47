#include "cuda/device.h"

#include <fmt/format.h>

#include "cuda/driver_api.h"

namespace ckpt::cuda {

const DeviceInfo& DetectDevices() {
  static const DeviceInfo info = [] {
    DeviceInfo d;
    const DriverApi* driver = Driver();
    if (driver == nullptr) {
      d.reason = DriverProblem();
      return d;
    }
    int count = 0;
    if (CUresult r = driver->cuDeviceGetCount(&count); r != CUDA_SUCCESS) {
      d.reason = CudaErrorText(r);
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
