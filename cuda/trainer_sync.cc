#include "cuda/trainer_sync.h"

#include <cuda.h>
#include <fmt/format.h>

#include <cstring>

#include "common/status.h"
#include "cuda/cuda_check.h"
#include "cuda/device_guard.h"

namespace ckpt::cuda {

absl::StatusOr<std::unique_ptr<TrainerSync>> TrainerSync::Create(int device) {
  CKPT_CUDA_DRIVER_OR_RETURN(driver, "snapshot events");
  std::unique_ptr<TrainerSync> s(new TrainerSync());
  s->device_ = device;
  s->driver_ = driver;
  CKPT_RETURN_IF_ERROR(s->CreateEvents());
  return s;
}

absl::Status TrainerSync::CreateEvents() {
  DeviceGuard guard(device_);
  CKPT_CUDA_RETURN_IF_ERROR(guard.status(), "snapshot event");
  for (uint32_t i = 0; i < kSnapshotEvents; ++i) {
    CUevent event;
    CKPT_CUDA_RETURN_IF_ERROR(driver_->cuEventCreate(&event, CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING),
                              "snapshot event");
    events_.push_back(event);
    // The same 64 bytes as the runtime's cudaIpcEventHandle_t.
    CUipcEventHandle handle;
    CKPT_CUDA_RETURN_IF_ERROR(driver_->cuIpcGetEventHandle(&handle, event), "snapshot event");
    event_handles_.emplace_back(reinterpret_cast<const char*>(&handle), sizeof handle);
  }
  return absl::OkStatus();
}

void TrainerSync::DestroyEvents() {
  // An event still pending on a stream is released once the device completes it.
  DeviceGuard guard(device_);
  for (void* event : events_) (void)driver_->cuEventDestroy(static_cast<CUevent>(event));
  events_.clear();
  event_handles_.clear();
}

absl::Status TrainerSync::RenewEvents() {
  DestroyEvents();
  return CreateEvents();
}

TrainerSync::~TrainerSync() {
  if (word_ != nullptr) {
    DeviceGuard guard(device_);
    (void)driver_->cuMemHostUnregister(word_);
  }
  DestroyEvents();
}

absl::Status TrainerSync::RecordSnapshotPoint(void* stream, uint64_t ticket) {
  DeviceGuard guard(device_);
  CKPT_CUDA_RETURN_IF_ERROR(guard.status(), "snapshot event");
  CKPT_CUDA_RETURN_IF_ERROR(
      driver_->cuEventRecord(static_cast<CUevent>(event(ticket)), static_cast<CUstream>(stream)), "snapshot event");
  return absl::OkStatus();
}

absl::Status TrainerSync::MapStagedWord(uint64_t* word) {
  DeviceGuard guard(device_);
  CKPT_CUDA_RETURN_IF_ERROR(guard.status(), "staged word");
  CKPT_CUDA_RETURN_IF_ERROR(driver_->cuMemHostRegister(word, 4096, CU_MEMHOSTREGISTER_DEVICEMAP), "staged word");
  CUdeviceptr device_ptr = 0;
  CKPT_CUDA_RETURN_IF_ERROR(driver_->cuMemHostGetDevicePointer(&device_ptr, word, 0), "staged word");
  word_ = word;
  word_device_ = static_cast<uint64_t>(device_ptr);
  return absl::OkStatus();
}

absl::Status TrainerSync::StreamWaitStaged(void* stream, uint64_t ticket) {
  if (word_ == nullptr) return absl::FailedPreconditionError("no GPU tensors registered");
  DeviceGuard guard(device_);
  CKPT_CUDA_RETURN_IF_ERROR(guard.status(), "staged word");
  CKPT_CUDA_RETURN_IF_ERROR(driver_->cuStreamWaitValue64(static_cast<CUstream>(stream),
                                                         static_cast<CUdeviceptr>(word_device_), ticket,
                                                         CU_STREAM_WAIT_VALUE_GEQ),
                            fmt::format("the staged word for ticket {}", ticket));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<IpcEvent>> IpcEvent::Open(const std::string& handle, int device) {
  if (handle.size() != sizeof(CUipcEventHandle)) {
    return absl::InvalidArgumentError(fmt::format("CUDA event handle of {} bytes, expected {}",
                                                  handle.size(), sizeof(CUipcEventHandle)));
  }
  CKPT_CUDA_DRIVER_OR_RETURN(driver, "trainer snapshot event");
  std::unique_ptr<IpcEvent> e(new IpcEvent());
  e->device_ = device;
  CUipcEventHandle h;
  std::memcpy(&h, handle.data(), sizeof h);
  DeviceGuard guard(device);
  CKPT_CUDA_RETURN_IF_ERROR(guard.status(), "trainer snapshot event");
  CUevent event;
  CKPT_CUDA_RETURN_IF_ERROR(driver->cuIpcOpenEventHandle(&event, h), "trainer snapshot event");
  e->event_ = event;
  return e;
}

IpcEvent::~IpcEvent() {
  if (event_ == nullptr) return;
  DeviceGuard guard(device_);
  if (const DriverApi* d = Driver()) (void)d->cuEventDestroy(static_cast<CUevent>(event_));
}

}  // namespace ckpt::cuda
