#include "cuda/trainer_sync.h"

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <cstring>

#include "common/status.h"
#include "cuda/cuda_check.h"
#include "cuda/device_guard.h"
#include "cuda/driver_entry.h"

namespace ckpt::cuda {
namespace {

using StreamWaitValue64 = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);

absl::StatusOr<StreamWaitValue64> GetStreamWaitValue64() {
  static auto fn = reinterpret_cast<StreamWaitValue64>(DriverEntryPoint("cuStreamWaitValue64"));
  if (fn == nullptr) return absl::FailedPreconditionError("cuStreamWaitValue64 is not available");
  return fn;
}

}  // namespace

absl::StatusOr<std::unique_ptr<TrainerSync>> TrainerSync::Create(int device) {
  std::unique_ptr<TrainerSync> s(new TrainerSync());
  s->device_ = device;
  CKPT_RETURN_IF_ERROR(s->CreateEvents());
  return s;
}

absl::Status TrainerSync::CreateEvents() {
  DeviceGuard guard(device_);
  CKPT_CUDA_RETURN_IF_ERROR(guard.status(), "snapshot event");
  for (uint32_t i = 0; i < kSnapshotEvents; ++i) {
    cudaEvent_t event;
    CKPT_CUDA_RETURN_IF_ERROR(
        cudaEventCreateWithFlags(&event, cudaEventInterprocess | cudaEventDisableTiming),
        "snapshot event");
    events_.push_back(event);
    cudaIpcEventHandle_t handle;
    CKPT_CUDA_RETURN_IF_ERROR(cudaIpcGetEventHandle(&handle, event), "snapshot event");
    event_handles_.emplace_back(reinterpret_cast<const char*>(&handle), sizeof handle);
  }
  return absl::OkStatus();
}

void TrainerSync::DestroyEvents() {
  // An event still pending on a stream is released once the device completes it.
  for (void* event : events_) (void)cudaEventDestroy(static_cast<cudaEvent_t>(event));
  events_.clear();
  event_handles_.clear();
}

absl::Status TrainerSync::RenewEvents() {
  DestroyEvents();
  return CreateEvents();
}

TrainerSync::~TrainerSync() {
  if (word_ != nullptr) (void)cudaHostUnregister(word_);
  DestroyEvents();
}

absl::Status TrainerSync::RecordSnapshotPoint(void* stream, uint64_t ticket) {
  CKPT_CUDA_RETURN_IF_ERROR(
      cudaEventRecord(static_cast<cudaEvent_t>(event(ticket)), static_cast<cudaStream_t>(stream)),
      "snapshot event");
  return absl::OkStatus();
}

absl::Status TrainerSync::MapStagedWord(uint64_t* word) {
  CKPT_CUDA_RETURN_IF_ERROR(cudaHostRegister(word, 4096, cudaHostRegisterMapped), "staged word");
  void* device_ptr = nullptr;
  CKPT_CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(&device_ptr, word, 0), "staged word");
  word_ = word;
  word_device_ = reinterpret_cast<uint64_t>(device_ptr);
  return absl::OkStatus();
}

absl::Status TrainerSync::StreamWaitStaged(void* stream, uint64_t ticket) {
  if (word_ == nullptr) return absl::FailedPreconditionError("no GPU tensors registered");
  CKPT_ASSIGN_OR_RETURN(StreamWaitValue64 wait, GetStreamWaitValue64());
  CUresult r = wait(static_cast<CUstream>(stream), static_cast<CUdeviceptr>(word_device_), ticket,
                    CU_STREAM_WAIT_VALUE_GEQ);
  if (r != CUDA_SUCCESS) {
    return absl::InternalError(fmt::format("cuStreamWaitValue64 for ticket {} failed (CUresult {})",
                                           ticket, static_cast<int>(r)));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<IpcEvent>> IpcEvent::Open(const std::string& handle, int device) {
  if (handle.size() != sizeof(cudaIpcEventHandle_t)) {
    return absl::InvalidArgumentError(fmt::format("CUDA event handle of {} bytes, expected {}",
                                                  handle.size(), sizeof(cudaIpcEventHandle_t)));
  }
  std::unique_ptr<IpcEvent> e(new IpcEvent());
  e->device_ = device;
  cudaIpcEventHandle_t h;
  std::memcpy(&h, handle.data(), sizeof h);
  DeviceGuard guard(device);
  CKPT_CUDA_RETURN_IF_ERROR(guard.status(), "trainer snapshot event");
  cudaEvent_t event;
  CKPT_CUDA_RETURN_IF_ERROR(cudaIpcOpenEventHandle(&event, h), "trainer snapshot event");
  e->event_ = event;
  return e;
}

IpcEvent::~IpcEvent() {
  if (event_ != nullptr) (void)cudaEventDestroy(static_cast<cudaEvent_t>(event_));
}

}  // namespace ckpt::cuda
