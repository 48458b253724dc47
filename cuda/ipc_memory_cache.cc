#include "cuda/ipc_memory_cache.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <cstring>

#include "cuda/cuda_check.h"
#include "cuda/device_guard.h"

namespace ckpt::cuda {

IpcMapping::~IpcMapping() {
  DeviceGuard guard(device_);
  (void)cudaIpcCloseMemHandle(base_);
}

absl::StatusOr<std::shared_ptr<IpcMapping>> IpcMemoryCache::Acquire(
    const DeviceBufferDescriptor& d, const std::string& tensor) {
  std::string key = d.device_uuid + std::string(d.ipc_handle.data(), d.ipc_handle.size());
  std::lock_guard lock(mu_);
  if (auto it = open_.find(key); it != open_.end()) {
    if (auto live = it->second.lock()) {
      if (d.allocation_bytes > live->bytes()) {
        return absl::InvalidArgumentError(fmt::format(
            "tensor {}: the trainer says its CUDA allocation has {} bytes, but it has {}",
            tensor, d.allocation_bytes, live->bytes()));
      }
      return live;
    }
  }
  auto device = DeviceOrdinalByUuid(d.device_uuid);
  if (!device.ok()) {
    return absl::Status(device.status().code(),
                        fmt::format("tensor {}: {}", tensor, std::string(device.status().message())));
  }
  DeviceGuard guard(*device);
  CKPT_CUDA_RETURN_IF_ERROR(guard.status(), fmt::format("tensor {}", tensor));
  cudaIpcMemHandle_t handle;
  std::memcpy(&handle, d.ipc_handle.data(), sizeof handle);
  void* base = nullptr;
  CKPT_CUDA_RETURN_IF_ERROR(cudaIpcOpenMemHandle(&base, handle, cudaIpcMemLazyEnablePeerAccess),
                            fmt::format("tensor {} (cudaIpcOpenMemHandle on {})", tensor,
                                        d.device_uuid));
  // The size the trainer claims is checked against the allocation itself: copies are sized
  // by the claim, and a claim larger than the allocation would read or write past it.
  absl::StatusOr<size_t> real = AllocationBytes(tensor, base);
  if (!real.ok() || *real < d.allocation_bytes) {
    (void)cudaIpcCloseMemHandle(base);
    if (!real.ok()) return real.status();
    return absl::InvalidArgumentError(fmt::format(
        "tensor {}: the trainer says its CUDA allocation has {} bytes, but it has {}", tensor,
        d.allocation_bytes, *real));
  }
  std::shared_ptr<IpcMapping> mapping(new IpcMapping(static_cast<char*>(base), *device, *real));
  open_[key] = mapping;
  return mapping;
}

}  // namespace ckpt::cuda
