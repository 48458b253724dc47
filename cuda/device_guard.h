// Makes a CUDA device's primary context current for a scope and restores the caller's
// context on exit (STYLE.md: a device guard in each CUDA method), so that library calls
// never move a trainer's device. The primary context is the one the CUDA runtime (and so
// PyTorch) uses on the device: what ckptd creates there, the trainer's runtime sees.
#pragma once

#include <cuda.h>

#include "cuda/driver_api.h"

namespace ckpt::cuda {

// The primary context of device `ordinal`, retained once per process (never released: the
// runtime a trainer links shares it).
CUresult PrimaryContext(int ordinal, CUcontext* context);

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) : driver_(Driver()) {
    if (driver_ == nullptr) {
      status_ = CUDA_ERROR_NOT_INITIALIZED;
      return;
    }
    (void)driver_->cuCtxGetCurrent(&previous_);
    CUcontext context = nullptr;
    status_ = PrimaryContext(device, &context);
    if (status_ == CUDA_SUCCESS) status_ = driver_->cuCtxSetCurrent(context);
    restore_ = true;
  }
  ~DeviceGuard() {
    if (restore_) (void)driver_->cuCtxSetCurrent(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

  // The result of selecting the device, for CKPT_CUDA_RETURN_IF_ERROR.
  CUresult status() const { return status_; }
  bool ok() const { return status_ == CUDA_SUCCESS; }

 private:
  const DriverApi* driver_;
  CUcontext previous_ = nullptr;
  CUresult status_ = CUDA_SUCCESS;
  bool restore_ = false;
};

}  // namespace ckpt::cuda
