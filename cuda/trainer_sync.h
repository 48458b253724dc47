// The trainer's side of ordering between its GPU work and ckptd, without host stalls:
//   - interprocess events, one recorded on the trainer's stream at each snapshot, in turn
//     (ticket % kSnapshotEvents); ckptd's copy streams wait on the ticket's, so the copy sees
//     exactly the state of that moment. One event would not do: cudaStreamWaitEvent waits
//     for the event's most recent record, and a CPU running ahead of its GPU records the
//     next snapshot's point, behind this snapshot's StreamWaitStaged, before ckptd takes the
//     command: ckptd's copy then waits for a point the stream reaches only after the copy
//     (seen on an H200: a snapshot every step hung the trainer's stream). A ticket's event
//     is recorded again only once ckptd is done taking the ticket kSnapshotEvents earlier
//     (ControlBlock::events_taken; Client::Snapshot waits for that, which only a CPU that
//     many snapshots ahead does);
//   - the control block's `staged_ticket` word mapped into the GPU's address space, so
//     that a stream can wait (cuStreamWaitValue64 >= ticket) for "staged" while the CPU
//     keeps launching kernels.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "cuda/driver_api.h"

namespace ckpt::cuda {

class TrainerSync {
 public:
  static constexpr uint32_t kSnapshotEvents = 8;

  // Creates the interprocess events on `device`.
  static absl::StatusOr<std::unique_ptr<TrainerSync>> Create(int device);
  ~TrainerSync();
  TrainerSync(const TrainerSync&) = delete;
  TrainerSync& operator=(const TrainerSync&) = delete;

  // Ticket `ticket`'s snapshot event itself (a CUevent, which is a cudaEvent_t), for the
  // host-copy transport.
  void* event(uint64_t ticket) const { return events_[ticket % events_.size()]; }
  // CUipcEventHandle bytes (those of a cudaIpcEventHandle_t) for the daemon, in ticket
  // order: ticket t's is t % size().
  const std::vector<std::string>& event_handles() const { return event_handles_; }
  // Replaces the events with new ones (a new session: its tickets start again at 1).
  absl::Status RenewEvents();
  // Records ticket `ticket`'s snapshot point on `stream` (a cudaStream_t; null: the legacy
  // default stream).
  absl::Status RecordSnapshotPoint(void* stream, uint64_t ticket);
  // Maps the 4 KiB page holding `word` (page-aligned) for device access.
  absl::Status MapStagedWord(uint64_t* word);
  // Enqueues on `stream` a wait until the staged word reaches `ticket`.
  absl::Status StreamWaitStaged(void* stream, uint64_t ticket);

 private:
  TrainerSync() = default;
  absl::Status CreateEvents();
  void DestroyEvents();
  int device_ = 0;
  const DriverApi* driver_ = nullptr;
  std::vector<void*> events_;  // CUevent (a cudaEvent_t to the trainer's runtime)
  std::vector<std::string> event_handles_;
  uint64_t* word_ = nullptr;  // host address, registered with CUDA while set
  uint64_t word_device_ = 0;  // its device address
};

// The daemon's handle on a trainer's interprocess event.
class IpcEvent {
 public:
  static absl::StatusOr<std::unique_ptr<IpcEvent>> Open(const std::string& handle, int device);
  ~IpcEvent();
  void* get() const { return event_; }  // CUevent

 private:
  IpcEvent() = default;
  void* event_ = nullptr;
  int device_ = 0;
};

}  // namespace ckpt::cuda
