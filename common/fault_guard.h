// Copies that survive the other side's memory going away. ckptd reads and writes trainers'
// shared memory; a trainer can truncate its segment after registering it, and touching a
// page beyond the new end raises SIGBUS, which would kill the daemon and every other job's
// checkpoint with it. GuardedMemcpy turns that SIGBUS into a `false` for this copy alone.
#pragma once

#include <cstddef>

namespace ckpt {

// memcpy(dst, src, n); false when a page of either side faulted (SIGBUS) part-way, in
// which case `dst` holds an unknown prefix. Thread-safe; installs the process's SIGBUS
// handler on first use (a SIGBUS outside a guarded copy still ends the process as before).
bool GuardedMemcpy(void* dst, const void* src, size_t n);

// Writes each page of [data, data + n) with its own value (faulting it in, writable);
// false when a page faulted (SIGBUS), as GuardedMemcpy.
bool GuardedTouch(void* data, size_t n);

}  // namespace ckpt
