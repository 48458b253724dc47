// Heap memory 4 KiB-aligned, so that a local file reads into it with O_DIRECT (no copy out
// of the page cache), freed when it goes.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <memory>

namespace ckpt::storage {

struct FreeAligned {
  void operator()(char* p) const { std::free(p); }
};
using AlignedBuffer = std::unique_ptr<char, FreeAligned>;

// Null when no memory is to be had.
inline AlignedBuffer AllocateAligned(size_t bytes) {
  constexpr size_t kAlign = 4096;
  return AlignedBuffer(static_cast<char*>(std::aligned_alloc(kAlign, (bytes + kAlign - 1) / kAlign * kAlign)));
}

}  // namespace ckpt::storage
