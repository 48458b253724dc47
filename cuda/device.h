// Run-time detection of CUDA devices. Binaries link nothing of CUDA (driver_api.h loads the
// driver); whether a usable GPU exists is decided once, at start-up, and logged.
#pragma once

#include <string>

namespace ckpt::cuda {

struct DeviceInfo {
  int device_count = 0;
  std::string reason;  // why there is no device (no driver, a driver too old, no device, ...)
  bool available() const { return device_count > 0; }
};

// Asks the CUDA driver once per process; later calls return the cached answer.
const DeviceInfo& DetectDevices();

}  // namespace ckpt::cuda
