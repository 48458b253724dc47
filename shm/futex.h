// Cross-process futex wait/wake on a 32-bit word in shared memory.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

namespace ckpt::shm {

// Sleeps while *word == expected, for at most `timeout`. Returns on wake, timeout, signal
// or a changed value; callers re-check their condition.
void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::nanoseconds timeout);

// Wakes every waiter on `word`.
void FutexWakeAll(std::atomic<uint32_t>* word);

// CLOCK_MONOTONIC in nanoseconds (the clock of ControlBlock::daemon_heartbeat_ns).
uint64_t MonotonicNanos();

}  // namespace ckpt::shm
