#include "shm/prefault.h"

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace ckpt::shm {

bool PopulateWritable(void* addr, size_t bytes) {
  return bytes == 0 || ::madvise(addr, bytes, MADV_POPULATE_WRITE) == 0;
}

void PrefaultWritable(void* addr, size_t bytes) {
  if (bytes == 0 || ::madvise(addr, bytes, MADV_POPULATE_WRITE) == 0) return;
  // Fallback: a write that changes nothing, once per page.
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  auto* p = static_cast<volatile char*>(addr);
  for (size_t off = 0; off < bytes; off += page) p[off] = p[off];
}

}  // namespace ckpt::shm
