// Pre-faults a mapping writable, so that copies on the data path never take page faults
// (a 2 GiB buffer is half a million 4 KiB faults).
#pragma once

#include <cstddef>

namespace ckpt::shm {

// MADV_POPULATE_WRITE (Linux 5.14+); on older kernels, touches every page.
// False when part of the range could not be had (it was truncated under us): the caller
// must not use that memory. Safe on memory another process can shrink.
bool PrefaultWritable(void* addr, size_t bytes);

// MADV_POPULATE_WRITE only; false where the kernel lacks it. It never changes pages that
// are already present, so it may run while others write to the memory.
bool PopulateWritable(void* addr, size_t bytes);

}  // namespace ckpt::shm
