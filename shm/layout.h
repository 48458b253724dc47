// Shared-memory ABI between a trainer (client library) and ckptd. Fixed layout, versioned,
// offsets not pointers, only lock-free atomics: a crashed peer can leave nothing locked.
//
// One control block per session, created by the daemon and mapped by the trainer:
//   - a single-producer (trainer) / single-consumer (daemon) ring of snapshot commands;
//   - a ticket table that the daemon updates as a snapshot is staged, committed or failed;
//   - liveness words for both sides.
// The trainer publishes a command with a release store of `tail` and a futex wake on
// `doorbell`; it waits for a ticket with a futex wait on that ticket's `state`.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace ckpt::shm {

inline constexpr uint64_t kControlMagic = 0x31544344'54504b43ULL;  // "CKPTDCT1"
inline constexpr uint32_t kControlAbiVersion = 6;  // 4: kTicketAbandoned; 5: kCommandSnapshotDeposited; 6: events_taken
inline constexpr uint32_t kRingSlots = 8;
inline constexpr uint32_t kTicketSlots = 64;
inline constexpr uint32_t kSlotPayloadBytes = 256 * 1024;  // metadata + train-state blobs
// A deposit token in a kCommandSnapshotDeposited slot is at most this long.
inline constexpr uint32_t kMaxDepositTokenBytes = 64;
inline constexpr uint32_t kTicketErrorBytes = 480;

// Values of TicketSlot::state; they match proto TicketState.
enum TicketStateValue : uint32_t {
  kTicketUnknown = 0,
  kTicketPending = 1,
  kTicketStaged = 2,
  kTicketCommitted = 3,
  kTicketFailed = 4,
  kTicketRejected = 5,
  // Set by the trainer, never by the daemon: it stopped waiting for a pending snapshot
  // (ckptd exited, or stalled past its heartbeat) and may change its tensors from now on.
  // The daemon's move to staged is a compare-and-swap from pending, so exactly one side
  // wins: a snapshot the trainer abandoned is never committed with torn tensors.
  kTicketAbandoned = 6,
};

enum CommandKind : uint32_t {
  kCommandSnapshot = 1,
  // A snapshot whose payload (metadata and train state) is larger than a slot: the trainer
  // handed it to ckptd as a sealed memfd on the descriptor socket, and the slot's payload
  // is the token ckptd answered (ArenaDeposits, kind kPayload). Train state of any size
  // travels in shared memory this way, bounded by the staging budget alone.
  kCommandSnapshotDeposited = 2,
};

struct alignas(64) CommandSlot {
  uint64_t ticket;
  uint64_t step;
  uint32_t kind;           // CommandKind
  uint32_t payload_bytes;  // encoded by shm/payload.h
  // Host-copy transport: the daemon stages this command only once `client_copy_done`
  // reaches this value (the trainer's GPU-to-mirror copies have landed). 0: no wait.
  uint32_t wait_client_copy;
  uint32_t reserved;
  uint8_t payload[kSlotPayloadBytes];
};

struct alignas(64) TicketSlot {
  std::atomic<uint64_t> ticket;  // which ticket this slot describes (ticket % kTicketSlots)
  std::atomic<uint32_t> state;   // TicketStateValue; futex word
  uint32_t reserved;
  uint64_t step;
  char error[kTicketErrorBytes];  // NUL-terminated, valid once state is failed/rejected
};

// Page-aligned: staged_ticket below needs a page of its own.
struct alignas(4096) ControlBlock {
  uint64_t magic;
  uint32_t abi_version;
  uint32_t ring_slots;
  uint32_t ticket_slots;
  uint32_t slot_payload_bytes;
  int32_t daemon_pid;
  int32_t trainer_pid;

  alignas(64) std::atomic<uint64_t> tail;        // written by the trainer
  alignas(64) std::atomic<uint64_t> head;        // written by the daemon
  alignas(64) std::atomic<uint32_t> doorbell;    // futex word: bumped on every publish
  std::atomic<uint32_t> closed;                  // daemon ended the session
  std::atomic<uint32_t> client_copy_done;        // futex word: last finished client copy
  std::atomic<uint64_t> daemon_heartbeat_ns;     // CLOCK_MONOTONIC, refreshed every 100 ms
  // The last ticket the daemon is done taking: its copy has waited on (and copied after)
  // the ticket's GPU snapshot event, or will never wait on it. A trainer records that event
  // again for a later ticket only after this (cuda/trainer_sync.h).
  alignas(64) std::atomic<uint64_t> events_taken;  // written by the daemon

  // The highest ticket staged so far (tickets are staged in order). Its own 4 KiB page so
  // that a trainer can map it into a GPU's address space and make a stream wait for it
  // (cuStreamWaitValue64 >= ticket) without the CPU waiting.
  alignas(4096) std::atomic<uint64_t> staged_ticket;
  char staged_page_padding[4096 - sizeof(std::atomic<uint64_t>)];

  CommandSlot commands[kRingSlots];
  TicketSlot tickets[kTicketSlots];
};

static_assert(std::is_standard_layout_v<ControlBlock>);
static_assert(std::atomic<uint64_t>::is_always_lock_free);
static_assert(std::atomic<uint32_t>::is_always_lock_free);
static_assert(sizeof(std::atomic<uint32_t>) == 4, "futex words must be 32-bit");
static_assert(offsetof(ControlBlock, tail) % 64 == 0);
static_assert(offsetof(ControlBlock, commands) % 64 == 0);
static_assert(offsetof(ControlBlock, staged_ticket) % 4096 == 0);

inline constexpr size_t kControlBlockBytes = sizeof(ControlBlock);

}  // namespace ckpt::shm
