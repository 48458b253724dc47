#include "cuda/ipc_memory_cache.h"

#include <cuda.h>
#include <fmt/format.h>

#include <cstring>

#include "cuda/cuda_check.h"
#include "cuda/device_guard.h"

namespace ckpt::cuda {

IpcMapping::~IpcMapping() {
  DeviceGuard guard(device_);
  if (const DriverApi* d = Driver()) (void)d->cuIpcCloseMemHandle(reinterpret_cast<CUdeviceptr>(base_));
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
  CKPT_CUDA_DRIVER_OR_RETURN(driver, fmt::format("tensor {}", tensor));
  DeviceGuard guard(*device);
  CKPT_CUDA_RETURN_IF_ERROR(guard.status(), fmt::format("tensor {}", tensor));
  CUipcMemHandle handle;
  static_assert(sizeof handle == kIpcHandleBytes);
  std::memcpy(&handle, d.ipc_handle.data(), sizeof handle);
  CUdeviceptr opened = 0;
  CKPT_CUDA_RETURN_IF_ERROR(driver->cuIpcOpenMemHandle(&opened, handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
                            fmt::format("tensor {} (cuIpcOpenMemHandle on {})", tensor, d.device_uuid));
  void* base = reinterpret_cast<void*>(opened);
  // The size the trainer claims is checked against the allocation itself: copies are sized
  // by the claim, and a claim larger than the allocation would read or write past it.
  absl::StatusOr<size_t> real = AllocationBytes(tensor, base);
  if (!real.ok() || *real < d.allocation_bytes) {
    (void)driver->cuIpcCloseMemHandle(opened);
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
