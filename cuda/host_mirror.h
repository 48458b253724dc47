// The host-copy transport, for machines where CUDA IPC is impossible (containers without a
// shared PID namespace): the trainer copies its GPU buffers into host mirrors in its
// shared-memory arenas on a side stream, after the snapshot point, and ckptd stages the
// mirrors. The CPU never waits: a CUDA host callback announces each finished copy.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "cuda/driver_api.h"

namespace ckpt::cuda {

class HostMirror {
 public:
  static absl::StatusOr<std::unique_ptr<HostMirror>> Create(int device);
  ~HostMirror();
  HostMirror(const HostMirror&) = delete;
  HostMirror& operator=(const HostMirror&) = delete;

  void Add(void* device_ptr, void* host_ptr, size_t bytes);
  // Page-locks host memory holding mirrors (cudaHostRegister), for full-speed copies.
  absl::Status PinHost(void* base, size_t bytes);
  // Once `after` (a cudaEvent_t on the trainer's stream) is reached, copies every buffer to
  // its mirror, then runs `done` on a CUDA callback thread (it must not call CUDA).
  absl::Status CopyToHostAsync(void* after, std::function<void()> done);
  // Makes `stream` wait until the last CopyToHostAsync has finished.
  absl::Status StreamWaitCopied(void* stream);
  // Restore: copies every mirror back to its buffer and waits.
  absl::Status CopyToDevice();
  // Waits for queued copies (before the mirrors or the callback's targets go away).
  void Synchronize();

 private:
  HostMirror() = default;
  struct Pair {
    void* device;
    void* host;
    size_t bytes;
  };
  int device_ = 0;
  const DriverApi* driver_ = nullptr;
  void* stream_ = nullptr;  // CUstream
  void* copied_ = nullptr;  // CUevent
  std::vector<Pair> pairs_;
  std::vector<void*> pinned_;
};

}  // namespace ckpt::cuda
