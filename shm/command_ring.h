// The two ends of a session's control block (shm/layout.h).
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "shm/layout.h"
#include "shm/payload.h"

namespace ckpt::shm {

// Daemon side: formats a fresh block.
void InitializeControlBlock(void* memory, int32_t daemon_pid, int32_t trainer_pid);

// Trainer side: checks magic, ABI version and size before trusting the block.
absl::StatusOr<ControlBlock*> ValidateControlBlock(void* memory, size_t size);

struct TicketResult {
  TicketStateValue state = kTicketUnknown;
  std::string error;
};

// Trainer end: publishes snapshot commands and waits on tickets. One producer thread at a
// time (the client serialises calls).
class CommandProducer {
 public:
  // `daemon_liveness`: the read end of ckptd's liveness pipe (ControlFdServer hands it over
  // with the control block), which hangs up the instant ckptd exits, in any PID namespace;
  // -1 when there is none (the daemon's own RPC path), then only the heartbeat tells.
  explicit CommandProducer(ControlBlock* block, int daemon_liveness = -1)
      : block_(block), daemon_liveness_(daemon_liveness) {}

  // Returns the ticket, or ResourceExhausted when the ring is full (the daemon has not yet
  // picked up kRingSlots earlier commands). Never blocks.
  absl::StatusOr<uint64_t> PublishSnapshot(uint64_t step, const SnapshotPayload& payload,
                                           uint32_t wait_client_copy = 0);
  // Whether PublishSnapshot would find the ring full now (only this producer fills it).
  bool Full() const;
  // ResourceExhausted, saying so, when the ring is full now; Ok otherwise.
  absl::Status CheckRoom() const;
  // The ticket the next publish gets (tickets count 1, 2, 3... per control block).
  uint64_t NextTicket() const;
  // The last ticket whose command the daemon is done with (ControlBlock::events_taken).
  uint64_t EventsTaken() const;
  // The same for a payload handed over as a sealed memfd (kCommandSnapshotDeposited):
  // `deposit_token` is what ckptd answered for it.
  absl::StatusOr<uint64_t> PublishDepositedSnapshot(uint64_t step, std::string_view deposit_token,
                                                    uint32_t wait_client_copy = 0);

  // Host-copy transport, called when the trainer's copies for `seq` have landed (from a
  // CUDA host callback: no CUDA calls, no blocking).
  void MarkClientCopyDone(uint32_t seq);

  TicketResult Poll(uint64_t ticket) const;

  // Waits until the ticket leaves `pending` (until_committed=false) or reaches a final state
  // (committed, failed, rejected). DeadlineExceeded on timeout; Unavailable when the daemon
  // closed the session, exited (seen within kLivenessSlice) or stopped its heartbeat for
  // `daemon_dead_after`: every pending ticket is then abandoned (AbandonPending), so the
  // trainer may go on and change its tensors.
  absl::StatusOr<TicketResult> Wait(uint64_t ticket, bool until_committed,
                                    std::chrono::milliseconds timeout,
                                    std::chrono::milliseconds daemon_dead_after) const;

  // Unavailable if the daemon closed the session, exited, or its heartbeat is older than
  // `dead_after`.
  absl::Status CheckDaemonAlive(std::chrono::milliseconds dead_after) const;
  // Whether the daemon closed the session or exited (not merely stalled): why, or Ok.
  absl::Status CheckDaemonRunning() const;

  // Marks every pending ticket abandoned (kTicketAbandoned): the trainer goes on without
  // ckptd, and ckptd fails those snapshots instead of staging what it copied. A ticket the
  // daemon staged first stays staged. Returns how many were abandoned.
  int AbandonPending() const;

  // CheckDaemonAlive, and when ckptd is not, AbandonPending: what every caller that goes on
  // without ckptd (and may then change its tensors) must do.
  absl::Status CheckDaemonAliveOrAbandon(std::chrono::milliseconds dead_after) const;

  // How often a waiting trainer looks for a daemon that exited.
  static constexpr std::chrono::milliseconds kLivenessSlice{20};

 private:
  // Fills the next free slot (`fill` writes its kind and payload) and publishes it.
  template <typename Fill>
  absl::StatusOr<uint64_t> Publish(uint64_t step, uint32_t wait_client_copy, const Fill& fill);

  ControlBlock* block_;
  int daemon_liveness_ = -1;
};

struct Command {
  uint64_t ticket = 0;
  uint64_t step = 0;
  CommandKind kind = kCommandSnapshot;
  uint32_t wait_client_copy = 0;
  absl::StatusOr<SnapshotPayload> payload;  // decode errors fail the ticket, not the daemon
  // kCommandSnapshotDeposited: the payload is in the descriptor deposited under this token
  // (`payload` is then empty until the session redeems it).
  std::string deposit_token;
};

// Daemon end.
class CommandConsumer {
 public:
  explicit CommandConsumer(ControlBlock* block)
      : block_(block), head_(block->head.load(std::memory_order_relaxed)) {}

  // Takes the next command, sleeping up to `wait` for one to arrive.
  std::optional<Command> Next(std::chrono::nanoseconds wait);
  // The trainer moved the ring's indices to where no producer could have (tail more than a
  // ring ahead, or behind): nothing more is read from it; the session should end.
  bool broken() const { return broken_; }

  // Updates a ticket's state (ignored if the slot was reused by a newer ticket, or the
  // ticket is already committed, failed, rejected or abandoned) and wakes waiters. Callers
  // serialise calls for one ticket. Staged is set only from pending (a compare-and-swap
  // with the trainer's AbandonPending): false when the trainer abandoned the ticket first.
  bool SetTicketState(uint64_t ticket, TicketStateValue state, std::string_view error = {});

  // Whether the trainer abandoned `ticket` (it stopped waiting; AbandonPending).
  bool Abandoned(uint64_t ticket) const;

  // Waits until the trainer's copy `seq` has landed: false on timeout or a closed session.
  bool WaitClientCopy(uint32_t seq, std::chrono::milliseconds timeout);

  // The daemon is done with `ticket`'s command: nothing it does from now on waits on the
  // ticket's snapshot event (ControlBlock::events_taken).
  void MarkTaken(uint64_t ticket);

  void Heartbeat();
  void Close();
  ControlBlock* block() const { return block_; }

 private:
  ControlBlock* block_;
  // The daemon's own copy of `head`: the shared one is only published for the producer,
  // never read back, so a trainer rewriting it cannot make the daemon re-read old slots.
  uint64_t head_;
  bool broken_ = false;
};

}  // namespace ckpt::shm
