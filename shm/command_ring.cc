#include "shm/command_ring.h"

#include <poll.h>

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <type_traits>
#include <vector>
#include <new>

#include "common/status.h"
#include "shm/futex.h"

namespace ckpt::shm {

void InitializeControlBlock(void* memory, int32_t daemon_pid, int32_t trainer_pid) {
  std::memset(memory, 0, sizeof(ControlBlock));
  auto* block = new (memory) ControlBlock();
  block->magic = kControlMagic;
  block->abi_version = kControlAbiVersion;
  block->ring_slots = kRingSlots;
  block->ticket_slots = kTicketSlots;
  block->slot_payload_bytes = kSlotPayloadBytes;
  block->daemon_pid = daemon_pid;
  block->trainer_pid = trainer_pid;
  block->daemon_heartbeat_ns.store(MonotonicNanos(), std::memory_order_release);
}

absl::StatusOr<ControlBlock*> ValidateControlBlock(void* memory, size_t size) {
  if (size < sizeof(ControlBlock)) {
    return absl::FailedPreconditionError(
        fmt::format("control block is {} bytes, expected at least {}", size, sizeof(ControlBlock)));
  }
  auto* block = static_cast<ControlBlock*>(memory);
  if (block->magic != kControlMagic) {
    return absl::FailedPreconditionError("control block has a bad magic number");
  }
  if (block->abi_version != kControlAbiVersion || block->ring_slots != kRingSlots ||
      block->ticket_slots != kTicketSlots || block->slot_payload_bytes != kSlotPayloadBytes) {
    return absl::FailedPreconditionError(fmt::format(
        "control block ABI version {} does not match this client's {}; upgrade ckptd and the "
        "client together",
        block->abi_version, kControlAbiVersion));
  }
  return block;
}

bool CommandProducer::Full() const {
  return block_->tail.load(std::memory_order_relaxed) - block_->head.load(std::memory_order_acquire) >= kRingSlots;
}

absl::Status CommandProducer::CheckRoom() const {
  if (!Full()) return absl::OkStatus();
  return absl::ResourceExhaustedError(
      fmt::format("command ring full: ckptd has not picked up the last {} snapshots", kRingSlots));
}

uint64_t CommandProducer::NextTicket() const { return block_->tail.load(std::memory_order_relaxed) + 1; }

uint64_t CommandProducer::EventsTaken() const { return block_->events_taken.load(std::memory_order_acquire); }

template <typename Fill>
absl::StatusOr<uint64_t> CommandProducer::Publish(uint64_t step, uint32_t wait_client_copy,
                                                  const Fill& fill) {
  CKPT_RETURN_IF_ERROR(CheckRoom());
  uint64_t tail = block_->tail.load(std::memory_order_relaxed);
  CommandSlot& slot = block_->commands[tail % kRingSlots];
  CKPT_RETURN_IF_ERROR(fill(slot));
  uint64_t ticket = tail + 1;
  slot.ticket = ticket;
  slot.step = step;
  slot.wait_client_copy = wait_client_copy;

  TicketSlot& t = block_->tickets[ticket % kTicketSlots];
  t.state.store(kTicketPending, std::memory_order_relaxed);
  t.step = step;
  t.error[0] = '\0';
  t.ticket.store(ticket, std::memory_order_release);

  block_->tail.store(tail + 1, std::memory_order_release);
  block_->doorbell.fetch_add(1, std::memory_order_release);
  FutexWakeAll(&block_->doorbell);
  return ticket;
}

absl::StatusOr<uint64_t> CommandProducer::PublishSnapshot(uint64_t step,
                                                          const SnapshotPayload& payload,
                                                          uint32_t wait_client_copy) {
  return Publish(step, wait_client_copy, [&](CommandSlot& slot) -> absl::Status {
    CKPT_ASSIGN_OR_RETURN(size_t written, EncodePayload(payload, slot.payload, kSlotPayloadBytes));
    slot.kind = kCommandSnapshot;
    slot.payload_bytes = static_cast<uint32_t>(written);
    return absl::OkStatus();
  });
}

absl::StatusOr<uint64_t> CommandProducer::PublishDepositedSnapshot(uint64_t step,
                                                                   std::string_view deposit_token,
                                                                   uint32_t wait_client_copy) {
  if (deposit_token.empty() || deposit_token.size() > kMaxDepositTokenBytes) {
    return absl::InvalidArgumentError(
        fmt::format("a deposit token of {} bytes (1..{})", deposit_token.size(), kMaxDepositTokenBytes));
  }
  return Publish(step, wait_client_copy, [&](CommandSlot& slot) {
    std::memcpy(slot.payload, deposit_token.data(), deposit_token.size());
    slot.kind = kCommandSnapshotDeposited;
    slot.payload_bytes = static_cast<uint32_t>(deposit_token.size());
    return absl::OkStatus();
  });
}

void CommandProducer::MarkClientCopyDone(uint32_t seq) {
  block_->client_copy_done.store(seq, std::memory_order_release);
  FutexWakeAll(&block_->client_copy_done);
}

TicketResult CommandProducer::Poll(uint64_t ticket) const {
  const TicketSlot& t = block_->tickets[ticket % kTicketSlots];
  TicketResult result;
  if (t.ticket.load(std::memory_order_acquire) != ticket) {
    result.error = fmt::format("ticket {} is unknown or too old", ticket);
    return result;
  }
  result.state = static_cast<TicketStateValue>(t.state.load(std::memory_order_acquire));
  if (result.state == kTicketFailed || result.state == kTicketRejected) {
    result.error.assign(t.error, strnlen(t.error, kTicketErrorBytes));
  }
  return result;
}

absl::Status CommandProducer::CheckDaemonAlive(std::chrono::milliseconds dead_after) const {
  if (absl::Status running = CheckDaemonRunning(); !running.ok()) return running;
  uint64_t beat = block_->daemon_heartbeat_ns.load(std::memory_order_acquire);
  uint64_t now = MonotonicNanos();
  auto age = std::chrono::nanoseconds(now > beat ? now - beat : 0);
  if (age > dead_after) {
    return absl::UnavailableError(fmt::format(
        "ckptd is not responding: no heartbeat for {} ms",
        std::chrono::duration_cast<std::chrono::milliseconds>(age).count()));
  }
  return absl::OkStatus();
}

absl::Status CommandProducer::CheckDaemonRunning() const {
  if (block_->closed.load(std::memory_order_acquire)) {
    return absl::UnavailableError("ckptd closed this session (daemon shutting down?)");
  }
  if (daemon_liveness_ >= 0) {
    // Nothing is ever written to the pipe: readable means its write end, held by ckptd
    // alone, was closed by the kernel when ckptd exited.
    struct pollfd p = {daemon_liveness_, POLLIN, 0};
    if (::poll(&p, 1, 0) > 0) return absl::UnavailableError("ckptd exited");
  }
  return absl::OkStatus();
}

absl::StatusOr<TicketResult> CommandProducer::Wait(
    uint64_t ticket, bool until_committed, std::chrono::milliseconds timeout,
    std::chrono::milliseconds daemon_dead_after) const {
  auto done = [until_committed](TicketStateValue s) {
    if (s == kTicketUnknown) return true;
    return until_committed ? s >= kTicketCommitted : s != kTicketPending;
  };
  auto deadline = std::chrono::steady_clock::now() + timeout;
  TicketSlot& t = block_->tickets[ticket % kTicketSlots];
  while (true) {
    TicketResult result = Poll(ticket);
    if (done(result.state)) return result;
    if (absl::Status alive = CheckDaemonAlive(daemon_dead_after); !alive.ok()) {
      if (AbandonPending() == 0) {
        result = Poll(ticket);  // staged by ckptd just before it went
        if (done(result.state)) return result;
      }
      return alive;
    }
    auto now = std::chrono::steady_clock::now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(fmt::format(
          "ticket {} not {} after {} ms", ticket, until_committed ? "committed" : "staged",
          timeout.count()));
    }
    auto slice = std::min<std::chrono::nanoseconds>(deadline - now, kLivenessSlice);
    FutexWait(&t.state, static_cast<uint32_t>(result.state), slice);
  }
}

absl::Status CommandProducer::CheckDaemonAliveOrAbandon(std::chrono::milliseconds dead_after) const {
  absl::Status alive = CheckDaemonAlive(dead_after);
  if (!alive.ok()) AbandonPending();
  return alive;
}

int CommandProducer::AbandonPending() const {
  int abandoned = 0;
  for (TicketSlot& t : block_->tickets) {
    uint32_t expected = kTicketPending;
    if (t.state.compare_exchange_strong(expected, kTicketAbandoned, std::memory_order_acq_rel)) {
      ++abandoned;
      FutexWakeAll(&t.state);
    }
  }
  return abandoned;
}

std::optional<Command> CommandConsumer::Next(std::chrono::nanoseconds wait) {
  if (broken_) return std::nullopt;
  uint32_t bell = block_->doorbell.load(std::memory_order_acquire);
  const uint64_t head = head_;
  uint64_t tail = block_->tail.load(std::memory_order_acquire);
  if (tail == head) {
    FutexWait(&block_->doorbell, bell, wait);
    tail = block_->tail.load(std::memory_order_acquire);
    if (tail == head) return std::nullopt;
  }
  if (tail - head > kRingSlots) {  // also "behind": unsigned wrap-around
    broken_ = true;
    return std::nullopt;
  }
  // The trainer can rewrite the slot while it is read: every field is read exactly once,
  // and the payload is copied out before it is decoded, so a check always holds for the
  // value that is used.
  const CommandSlot& slot = block_->commands[head % kRingSlots];
  auto once = [](const auto& field) {
    return std::atomic_ref(const_cast<std::remove_cvref_t<decltype(field)>&>(field))
        .load(std::memory_order_relaxed);
  };
  Command command;
  command.ticket = once(slot.ticket);
  command.step = once(slot.step);
  const uint32_t kind = once(slot.kind);
  command.kind = static_cast<CommandKind>(kind);
  command.wait_client_copy = once(slot.wait_client_copy);
  const uint32_t payload_bytes = once(slot.payload_bytes);
  const bool deposited = kind == kCommandSnapshotDeposited;
  if (command.ticket != head + 1 || (kind != kCommandSnapshot && !deposited) ||
      payload_bytes > (deposited ? kMaxDepositTokenBytes : kSlotPayloadBytes) ||
      (deposited && payload_bytes == 0)) {
    command.ticket = head + 1;
    command.payload = absl::InvalidArgumentError("malformed command in the session ring");
  } else {
    // Copied out once: the trainer may rewrite the slot while it is decoded.
    std::vector<uint8_t> payload(payload_bytes);
    std::memcpy(payload.data(), slot.payload, payload_bytes);
    if (deposited) {
      command.deposit_token.assign(payload.begin(), payload.end());
      command.payload = SnapshotPayload{};
    } else {
      command.payload = DecodePayload(payload.data(), payload.size());
    }
  }
  head_ = head + 1;
  block_->head.store(head_, std::memory_order_release);
  return command;
}

bool CommandConsumer::SetTicketState(uint64_t ticket, TicketStateValue state,
                                     std::string_view error) {
  TicketSlot& t = block_->tickets[ticket % kTicketSlots];
  if (t.ticket.load(std::memory_order_acquire) != ticket) return true;
  uint32_t current = t.state.load(std::memory_order_acquire);
  if (!error.empty() && current < kTicketCommitted) {
    size_t n = std::min(error.size(), static_cast<size_t>(kTicketErrorBytes - 1));
    std::memcpy(t.error, error.data(), n);
    t.error[n] = '\0';
  }
  // Every move is a compare-and-swap, against the trainer's AbandonPending: exactly one of
  // the two wins. A decided ticket stays decided: the persist stage may commit (or fail) a
  // snapshot before the stager reports it staged, and the first error is the one that
  // explains; an abandoned one is the trainer's word and stays too.
  while (true) {
    if (current >= kTicketCommitted) return current != kTicketAbandoned;
    if (state == kTicketStaged && current == kTicketStaged) break;
    if (t.state.compare_exchange_weak(current, state, std::memory_order_acq_rel)) break;
  }
  // Every state past pending releases GPU waiters: committed implies staged, and failed or
  // rejected tickets must not leave a stream waiting.
  if (state != kTicketPending && ticket > block_->staged_ticket.load(std::memory_order_relaxed)) {
    block_->staged_ticket.store(ticket, std::memory_order_release);
  }
  FutexWakeAll(&t.state);
  return true;
}

bool CommandConsumer::Abandoned(uint64_t ticket) const {
  const TicketSlot& t = block_->tickets[ticket % kTicketSlots];
  return t.ticket.load(std::memory_order_acquire) == ticket &&
         t.state.load(std::memory_order_acquire) == kTicketAbandoned;
}

bool CommandConsumer::WaitClientCopy(uint32_t seq, std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    uint32_t done = block_->client_copy_done.load(std::memory_order_acquire);
    // Sequence numbers wrap: compare by signed distance.
    if (static_cast<int32_t>(done - seq) >= 0) return true;
    auto now = std::chrono::steady_clock::now();
    if (now >= deadline || block_->closed.load(std::memory_order_acquire)) return false;
    Heartbeat();
    FutexWait(&block_->client_copy_done, done,
              std::min<std::chrono::nanoseconds>(deadline - now, std::chrono::milliseconds(100)));
  }
}

void CommandConsumer::MarkTaken(uint64_t ticket) {
  if (ticket > block_->events_taken.load(std::memory_order_relaxed)) {
    block_->events_taken.store(ticket, std::memory_order_release);
  }
}

void CommandConsumer::Heartbeat() {
  block_->daemon_heartbeat_ns.store(MonotonicNanos(), std::memory_order_release);
}

void CommandConsumer::Close() {
  block_->closed.store(1, std::memory_order_release);
  for (auto& t : block_->tickets) FutexWakeAll(&t.state);
}

}  // namespace ckpt::shm
