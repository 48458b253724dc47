// What a trainer tells ckptd about a GPU buffer so that the daemon can map it: the CUDA IPC
// handle of the allocation that holds it (IPC exports whole allocations), the buffer's
// offset in that allocation, and the device's UUID (ordinals differ between processes
// with different CUDA_VISIBLE_DEVICES).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace ckpt::cuda {

inline constexpr size_t kIpcHandleBytes = 64;

struct DeviceBufferDescriptor {
  std::array<char, kIpcHandleBytes> ipc_handle{};
  uint64_t offset = 0;            // from the allocation base
  uint64_t allocation_bytes = 0;  // the whole allocation
  std::string device_uuid;        // "GPU-xxxxxxxx-xxxx-..."
  int device_ordinal = 0;         // in the describing process
};

// Describes `bytes` at device pointer `ptr` (trainer side). Clear errors for memory that
// cannot be shared through CUDA IPC: host memory, CUDA's virtual memory API (PyTorch's
// expandable_segments), stream-ordered pools (cudaMallocAsync), and no usable device.
absl::StatusOr<DeviceBufferDescriptor> DescribeDeviceBuffer(const std::string& name,
                                                            const void* ptr, size_t bytes);

// The device ordinal of device memory at `ptr` (any allocator). FailedPrecondition when
// CUDA is unusable in this process, InvalidArgument for host memory; both name the tensor.
absl::StatusOr<int> DeviceOfPointer(const std::string& name, const void* ptr);

// "GPU-..." for a device ordinal of this process.
absl::StatusOr<std::string> DeviceUuid(int device);

// The size of the allocation that device pointer `base` starts (cuPointerGetAttribute
// RANGE_SIZE): what the daemon checks a trainer's claimed allocation size against.
absl::StatusOr<size_t> AllocationBytes(const std::string& name, const void* base);

// The ordinal (in this process) of the device with `uuid`; NotFound if it is not visible.
absl::StatusOr<int> DeviceOrdinalByUuid(const std::string& uuid);

}  // namespace ckpt::cuda
