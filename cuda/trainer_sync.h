// The trainer's side of ordering between its GPU work and ckptd, without host stalls:
//   - an interprocess event, recorded on the trainer's stream at each snapshot; ckptd's copy
//     streams wait on it, so the copy sees exactly the state of that moment;
//   - the control block's `staged_ticket` word mapped into the GPU's address space, so
//     that a stream can wait (cuStreamWaitValue64 >= ticket) for "staged" while the CPU
//     keeps launching kernels.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace ckpt::cuda {

class TrainerSync {
 public:
  // Creates the interprocess event on `device`.
  static absl::StatusOr<std::unique_ptr<TrainerSync>> Create(int device);
  ~TrainerSync();
  TrainerSync(const TrainerSync&) = delete;
  TrainerSync& operator=(const TrainerSync&) = delete;

  // The snapshot event itself (cudaEvent_t), for the host-copy transport.
  void* event() const { return event_; }
  // cudaIpcEventHandle_t bytes for the daemon.
  const std::string& event_handle() const { return event_handle_; }
  // Records the snapshot point on `stream` (a cudaStream_t; null: the legacy default stream).
  absl::Status RecordSnapshotPoint(void* stream);
  // Maps the 4 KiB page holding `word` (page-aligned) for device access.
  absl::Status MapStagedWord(uint64_t* word);
  // Enqueues on `stream` a wait until the staged word reaches `ticket`.
  absl::Status StreamWaitStaged(void* stream, uint64_t ticket);

 private:
  TrainerSync() = default;
  int device_ = 0;
  void* event_ = nullptr;  // cudaEvent_t
  std::string event_handle_;
  uint64_t* word_ = nullptr;  // host address, registered with CUDA while set
  uint64_t word_device_ = 0;  // its device address
};

// The daemon's handle on a trainer's interprocess event.
class IpcEvent {
 public:
  static absl::StatusOr<std::unique_ptr<IpcEvent>> Open(const std::string& handle, int device);
  ~IpcEvent();
  void* get() const { return event_; }  // cudaEvent_t

 private:
  IpcEvent() = default;
  void* event_ = nullptr;
  int device_ = 0;
};

}  // namespace ckpt::cuda
