#include "cuda/host_mirror.h"

#include <cuda.h>
#include <fmt/format.h>

#include "common/status.h"
#include "cuda/cuda_check.h"
#include "cuda/device_guard.h"

namespace ckpt::cuda {
namespace {

void RunDone(void* data) {
  auto* done = static_cast<std::function<void()>*>(data);
  (*done)();
  delete done;
}

}  // namespace

absl::StatusOr<std::unique_ptr<HostMirror>> HostMirror::Create(int device) {
  CKPT_CUDA_DRIVER_OR_RETURN(driver, "host mirror");
  std::unique_ptr<HostMirror> m(new HostMirror());
  m->device_ = device;
  m->driver_ = driver;
  DeviceGuard guard(device);
  CKPT_CUDA_RETURN_IF_ERROR(guard.status(), "host mirror");
  CUstream stream;
  CKPT_CUDA_RETURN_IF_ERROR(driver->cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING), "host mirror");
  m->stream_ = stream;
  CUevent copied;
  CKPT_CUDA_RETURN_IF_ERROR(driver->cuEventCreate(&copied, CU_EVENT_DISABLE_TIMING), "host mirror");
  m->copied_ = copied;
  return m;
}

HostMirror::~HostMirror() {
  if (driver_ == nullptr) return;
  Synchronize();
  DeviceGuard guard(device_);
  for (void* p : pinned_) (void)driver_->cuMemHostUnregister(p);
  if (copied_) (void)driver_->cuEventDestroy(static_cast<CUevent>(copied_));
  if (stream_) (void)driver_->cuStreamDestroy(static_cast<CUstream>(stream_));
}

void HostMirror::Add(void* device_ptr, void* host_ptr, size_t bytes) {
  pairs_.push_back({device_ptr, host_ptr, bytes});
}

absl::Status HostMirror::PinHost(void* base, size_t bytes) {
  DeviceGuard guard(device_);
  CKPT_CUDA_RETURN_IF_ERROR(guard.status(), "mirror arena");
  CKPT_CUDA_RETURN_IF_ERROR(driver_->cuMemHostRegister(base, bytes, CU_MEMHOSTREGISTER_PORTABLE), "mirror arena");
  pinned_.push_back(base);
  return absl::OkStatus();
}

absl::Status HostMirror::CopyToHostAsync(void* after, std::function<void()> done) {
  DeviceGuard guard(device_);
  CKPT_CUDA_RETURN_IF_ERROR(guard.status(), "mirror");
  auto stream = static_cast<CUstream>(stream_);
  if (after != nullptr) {
    CKPT_CUDA_RETURN_IF_ERROR(driver_->cuStreamWaitEvent(stream, static_cast<CUevent>(after), 0), "snapshot point");
  }
  for (const Pair& p : pairs_) {
    CKPT_CUDA_RETURN_IF_ERROR(driver_->cuMemcpyAsync(reinterpret_cast<CUdeviceptr>(p.host),
                                                     reinterpret_cast<CUdeviceptr>(p.device), p.bytes, stream),
                              fmt::format("mirror copy of {} bytes", p.bytes));
  }
  CKPT_CUDA_RETURN_IF_ERROR(driver_->cuEventRecord(static_cast<CUevent>(copied_), stream), "mirror");
  auto* callback = new std::function<void()>(std::move(done));
  CUresult err = driver_->cuLaunchHostFunc(stream, RunDone, callback);
  if (err != CUDA_SUCCESS) delete callback;
  CKPT_CUDA_RETURN_IF_ERROR(err, "mirror copy callback");
  return absl::OkStatus();
}

absl::Status HostMirror::StreamWaitCopied(void* stream) {
  DeviceGuard guard(device_);
  CKPT_CUDA_RETURN_IF_ERROR(guard.status(), "mirror copies");
  CKPT_CUDA_RETURN_IF_ERROR(
      driver_->cuStreamWaitEvent(static_cast<CUstream>(stream), static_cast<CUevent>(copied_), 0), "mirror copies");
  return absl::OkStatus();
}

absl::Status HostMirror::CopyToDevice() {
  DeviceGuard guard(device_);
  CKPT_CUDA_RETURN_IF_ERROR(guard.status(), "restore");
  auto stream = static_cast<CUstream>(stream_);
  for (const Pair& p : pairs_) {
    CKPT_CUDA_RETURN_IF_ERROR(driver_->cuMemcpyAsync(reinterpret_cast<CUdeviceptr>(p.device),
                                                     reinterpret_cast<CUdeviceptr>(p.host), p.bytes, stream),
                              fmt::format("restore of {} bytes", p.bytes));
  }
  CKPT_CUDA_RETURN_IF_ERROR(driver_->cuStreamSynchronize(stream), "restore");
  return absl::OkStatus();
}

void HostMirror::Synchronize() {
  if (stream_ == nullptr || driver_ == nullptr) return;
  DeviceGuard guard(device_);
  (void)driver_->cuStreamSynchronize(static_cast<CUstream>(stream_));
}

}  // namespace ckpt::cuda
