#include "cuda/device_buffer.h"

#include <cuda.h>
#include <fmt/format.h>

#include <cstring>

#include "common/status.h"
#include "cuda/cuda_check.h"
#include "cuda/device.h"
#include "cuda/device_guard.h"

namespace ckpt::cuda {
namespace {

// One pointer attribute into `out`. Outside any CUDA context (a thread of the trainer's that
// never used CUDA) it is asked again from device 0's primary context: pointers are unified.
template <typename T>
absl::Status Attribute(const DriverApi& d, T* out, CUpointer_attribute what, const void* ptr, const std::string& name) {
  CUresult r = d.cuPointerGetAttribute(out, what, reinterpret_cast<CUdeviceptr>(ptr));
  if (r == CUDA_ERROR_INVALID_CONTEXT) {
    DeviceGuard guard(0);
    r = d.cuPointerGetAttribute(out, what, reinterpret_cast<CUdeviceptr>(ptr));
  }
  if (r != CUDA_SUCCESS) {
    return absl::InvalidArgumentError(fmt::format("tensor {}: cuPointerGetAttribute({}) failed: {}; is it CUDA memory?",
                                                  name, static_cast<int>(what), CudaErrorText(r)));
  }
  return absl::OkStatus();
}

std::string FormatUuid(const CUuuid& uuid) {
  const auto* b = reinterpret_cast<const unsigned char*>(uuid.bytes);
  return fmt::format("GPU-{:02x}{:02x}{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-"
                     "{:02x}{:02x}{:02x}{:02x}{:02x}{:02x}",
                     b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11],
                     b[12], b[13], b[14], b[15]);
}

}  // namespace

absl::StatusOr<size_t> AllocationBytes(const std::string& name, const void* base) {
  CKPT_CUDA_DRIVER_OR_RETURN(d, fmt::format("tensor {}", name));
  size_t range = 0;
  CKPT_RETURN_IF_ERROR(Attribute(*d, &range, CU_POINTER_ATTRIBUTE_RANGE_SIZE, base, name));
  return range;
}

absl::StatusOr<std::string> DeviceUuid(int device) {
  CKPT_CUDA_DRIVER_OR_RETURN(d, fmt::format("device {}", device));
  CUdevice handle = 0;
  CKPT_CUDA_RETURN_IF_ERROR(d->cuDeviceGet(&handle, device), fmt::format("device {}", device));
  CUuuid uuid;
  CKPT_CUDA_RETURN_IF_ERROR(d->cuDeviceGetUuid(&uuid, handle), fmt::format("device {}", device));
  return FormatUuid(uuid);
}

absl::StatusOr<int> DeviceOrdinalByUuid(const std::string& uuid) {
  const DeviceInfo& info = DetectDevices();
  if (!info.available()) {
    return absl::FailedPreconditionError(fmt::format("no usable CUDA device ({})", info.reason));
  }
  for (int d = 0; d < info.device_count; ++d) {
    auto mine = DeviceUuid(d);
    if (mine.ok() && *mine == uuid) return d;
  }
  return absl::NotFoundError(fmt::format("GPU {} is not visible to this process", uuid));
}

absl::StatusOr<int> DeviceOfPointer(const std::string& name, const void* ptr) {
  const DeviceInfo& info = DetectDevices();
  if (!info.available()) {
    return absl::FailedPreconditionError(
        fmt::format("tensor {}: CUDA is not usable in this process ({})", name, info.reason));
  }
  const DriverApi& d = *Driver();
  unsigned int type = 0;
  if (!Attribute(d, &type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr, name).ok() || type != CU_MEMORYTYPE_DEVICE) {
    return absl::InvalidArgumentError(fmt::format(
        "tensor {}: not device memory (register host tensors through a shared-memory arena)", name));
  }
  int ordinal = 0;
  CKPT_RETURN_IF_ERROR(Attribute(d, &ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr, name));
  return ordinal;
}

absl::StatusOr<DeviceBufferDescriptor> DescribeDeviceBuffer(const std::string& name,
                                                            const void* ptr, size_t bytes) {
  CKPT_ASSIGN_OR_RETURN(int device, DeviceOfPointer(name, ptr));
  const DriverApi& driver = *Driver();  // DeviceOfPointer found it
  void* pool = nullptr;
  CKPT_RETURN_IF_ERROR(Attribute(driver, &pool, CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE, ptr, name));
  if (pool != nullptr) {
    return absl::FailedPreconditionError(fmt::format(
        "tensor {}: allocated from a stream-ordered pool (cudaMallocAsync), which CUDA IPC "
        "cannot export; allocate checkpointed buffers with cudaMalloc",
        name));
  }
  int legacy_ipc = 0;
  CKPT_RETURN_IF_ERROR(
      Attribute(driver, &legacy_ipc, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, ptr, name));
  if (!legacy_ipc) {
    return absl::FailedPreconditionError(fmt::format(
        "tensor {}: allocated with CUDA's virtual memory API (PyTorch: "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), which CUDA IPC cannot export; "
        "set expandable_segments:False for this process",
        name));
  }
  CUdeviceptr base = 0;
  size_t range = 0;
  CKPT_RETURN_IF_ERROR(Attribute(driver, &base, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, ptr, name));
  CKPT_RETURN_IF_ERROR(Attribute(driver, &range, CU_POINTER_ATTRIBUTE_RANGE_SIZE, ptr, name));
  DeviceBufferDescriptor d;
  d.offset = reinterpret_cast<uintptr_t>(ptr) - static_cast<uintptr_t>(base);
  d.allocation_bytes = range;
  if (d.offset + bytes > range) {
    return absl::InvalidArgumentError(fmt::format(
        "tensor {}: {} bytes at offset {} run past the end of its allocation ({} bytes)", name,
        bytes, d.offset, range));
  }
  // The same 64 bytes the CUDA runtime's cudaIpcGetMemHandle gives (PyTorch's), which
  // cuIpcOpenMemHandle and cudaIpcOpenMemHandle both open.
  CUipcMemHandle handle;
  {
    DeviceGuard guard(device);
    CKPT_CUDA_RETURN_IF_ERROR(guard.status(), fmt::format("tensor {}", name));
    CKPT_CUDA_RETURN_IF_ERROR(driver.cuIpcGetMemHandle(&handle, base), fmt::format("tensor {}", name));
  }
  static_assert(sizeof(handle) == kIpcHandleBytes);
  std::memcpy(d.ipc_handle.data(), &handle, kIpcHandleBytes);
  CKPT_ASSIGN_OR_RETURN(d.device_uuid, DeviceUuid(device));
  d.device_ordinal = device;
  return d;
}

}  // namespace ckpt::cuda
