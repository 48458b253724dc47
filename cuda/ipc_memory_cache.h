// The daemon's side of CUDA IPC memory: each allocation is opened once (opening the same
// one twice fails in CUDA, and each open costs milliseconds), shared by every buffer on it,
// and closed when the last of them is released.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/statusor.h"
#include "cuda/device_buffer.h"

namespace ckpt::cuda {

class IpcMemoryCache;

// An open allocation; the base pointer is valid in the daemon while this lives.
class IpcMapping {
 public:
  ~IpcMapping();
  IpcMapping(const IpcMapping&) = delete;
  IpcMapping& operator=(const IpcMapping&) = delete;
  char* base() const { return base_; }
  int device() const { return device_; }
  uint64_t bytes() const { return bytes_; }

 private:
  friend class IpcMemoryCache;
  IpcMapping(char* base, int device, uint64_t bytes) : base_(base), device_(device), bytes_(bytes) {}
  char* base_;
  int device_;
  uint64_t bytes_;
};

class IpcMemoryCache {
 public:
  // Opens (or reuses) the allocation that `descriptor` names.
  absl::StatusOr<std::shared_ptr<IpcMapping>> Acquire(const DeviceBufferDescriptor& descriptor,
                                                      const std::string& tensor);

 private:
  std::mutex mu_;
  std::map<std::string, std::weak_ptr<IpcMapping>> open_;  // uuid + handle bytes -> mapping
};

}  // namespace ckpt::cuda
