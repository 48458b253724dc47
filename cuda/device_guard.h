// Selects a CUDA device for a scope and restores the caller's device on exit (STYLE.md: a
// device guard in each CUDA method), so that library calls never move a trainer's device.
#pragma once

#include <cuda_runtime_api.h>

namespace ckpt::cuda {

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    (void)cudaGetDevice(&previous_);
    status_ = cudaSetDevice(device);
    if (status_ != cudaSuccess) (void)cudaGetLastError();
  }
  ~DeviceGuard() { (void)cudaSetDevice(previous_); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

  // The result of selecting the device, for CKPT_CUDA_RETURN_IF_ERROR.
  cudaError_t status() const { return status_; }
  bool ok() const { return status_ == cudaSuccess; }

 private:
  int previous_ = 0;
  cudaError_t status_ = cudaSuccess;
};

}  // namespace ckpt::cuda
