// Run-time detection of CUDA devices. Binaries always link the CUDA runtime; whether a
// usable GPU exists is decided once, at start-up, and logged.
#pragma once

#include <string>

namespace ckpt::cuda {

struct DeviceInfo {
  int device_count = 0;
  std::string reason;  // why there is no device ("cudaErrorNoDevice", driver missing, ...)
  bool available() const { return device_count > 0; }
};

// Asks the CUDA runtime once per process; later calls return the cached answer.
const DeviceInfo& DetectDevices();

}  // namespace ckpt::cuda
