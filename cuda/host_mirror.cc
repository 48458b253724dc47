#include "cuda/host_mirror.h"

#include <cuda_runtime_api.h>
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
  std::unique_ptr<HostMirror> m(new HostMirror());
  m->device_ = device;
  DeviceGuard guard(device);
  CKPT_CUDA_RETURN_IF_ERROR(guard.status(), "host mirror");
  cudaStream_t stream;
  CKPT_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "host mirror");
  m->stream_ = stream;
  cudaEvent_t copied;
  CKPT_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&copied, cudaEventDisableTiming), "host mirror");
  m->copied_ = copied;
  return m;
}

HostMirror::~HostMirror() {
  Synchronize();
  for (void* p : pinned_) (void)cudaHostUnregister(p);
  if (copied_) (void)cudaEventDestroy(static_cast<cudaEvent_t>(copied_));
  if (stream_) (void)cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
}

void HostMirror::Add(void* device_ptr, void* host_ptr, size_t bytes) {
  pairs_.push_back({device_ptr, host_ptr, bytes});
}

absl::Status HostMirror::PinHost(void* base, size_t bytes) {
  CKPT_CUDA_RETURN_IF_ERROR(cudaHostRegister(base, bytes, cudaHostRegisterPortable), "mirror arena");
  pinned_.push_back(base);
  return absl::OkStatus();
}

absl::Status HostMirror::CopyToHostAsync(void* after, std::function<void()> done) {
  auto stream = static_cast<cudaStream_t>(stream_);
  if (after != nullptr) {
    CKPT_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, static_cast<cudaEvent_t>(after), 0),
                              "snapshot point");
  }
  for (const Pair& p : pairs_) {
    CKPT_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(p.host, p.device, p.bytes, cudaMemcpyDeviceToHost, stream),
        fmt::format("mirror copy of {} bytes", p.bytes));
  }
  CKPT_CUDA_RETURN_IF_ERROR(cudaEventRecord(static_cast<cudaEvent_t>(copied_), stream), "mirror");
  auto* callback = new std::function<void()>(std::move(done));
  cudaError_t err = cudaLaunchHostFunc(stream, RunDone, callback);
  if (err != cudaSuccess) delete callback;
  CKPT_CUDA_RETURN_IF_ERROR(err, "mirror copy callback");
  return absl::OkStatus();
}

absl::Status HostMirror::StreamWaitCopied(void* stream) {
  CKPT_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream),
                                                static_cast<cudaEvent_t>(copied_), 0),
                            "mirror copies");
  return absl::OkStatus();
}

absl::Status HostMirror::CopyToDevice() {
  auto stream = static_cast<cudaStream_t>(stream_);
  for (const Pair& p : pairs_) {
    CKPT_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(p.device, p.host, p.bytes, cudaMemcpyHostToDevice, stream),
        fmt::format("restore of {} bytes", p.bytes));
  }
  CKPT_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream), "restore");
  return absl::OkStatus();
}

void HostMirror::Synchronize() {
  if (stream_) (void)cudaStreamSynchronize(static_cast<cudaStream_t>(stream_));
}

}  // namespace ckpt::cuda
