#include "shm/prefault.h"

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>

#include "common/fault_guard.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace ckpt::shm {

bool PopulateWritable(void* addr, size_t bytes) {
  return bytes == 0 || ::madvise(addr, bytes, MADV_POPULATE_WRITE) == 0;
}

bool PrefaultWritable(void* addr, size_t bytes) {
  if (bytes == 0 || ::madvise(addr, bytes, MADV_POPULATE_WRITE) == 0) return true;
  // EFAULT: part of the range is gone (a segment truncated under us): never touch it.
  if (errno == EFAULT) return false;
  // Older kernels: a write that changes nothing, once per page, guarded against SIGBUS
  // from memory another process can shrink.
  return GuardedTouch(addr, bytes);
}

}  // namespace ckpt::shm
