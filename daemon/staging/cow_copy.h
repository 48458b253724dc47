// One snapshot's copy-on-write copy of a trainer's write-protected arenas (write_protector.h).
//
// Protect() write-protects every chunk that holds snapshot bytes; from then on the trainer
// may run, and the trainer is released. Run() copies the chunks into the staging block and
// lifts each chunk's protection once it is copied. A chunk the trainer writes to before
// then is copied first, while the writing thread waits in the kernel; the background copy
// then carries on right after that chunk, where the trainer is likely to write next (an
// optimizer walks its tensors in order). Whatever happens, Run() leaves nothing protected.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "daemon/staging/write_protector.h"

namespace ckpt::daemon {

class CowCopy {
 public:
  // A tensor's bytes: where the trainer sees them, where ckptd reads them (its own mapping of
  // the same arena), and where they go.
  struct Region {
    uint64_t trainer_begin;
    uint64_t bytes;
    const char* source;
    char* destination;
  };
  // `regions` must lie in ranges registered with `protector`. `chunk_bytes` is a multiple of
  // the arenas' page size.
  CowCopy(WriteProtector& protector, std::vector<Region> regions, uint64_t chunk_bytes);

  // Write-protects every chunk. On error nothing stays protected (copy another way).
  absl::Status Protect();
  // Copies every chunk, then returns; nothing stays protected after it. An error (the
  // trainer's memory went away under the copy) leaves the destination incomplete.
  absl::Status Run();

  size_t chunks() const { return chunks_.size(); }
  // Chunks copied because the trainer wrote to them first (for the log and tests).
  size_t faulted() const { return faulted_.load(); }

 private:
  struct Part {
    const char* source;
    char* destination;
    uint64_t bytes;
  };
  struct Chunk {
    uint64_t begin;  // trainer address, page aligned
    uint64_t bytes;
    std::vector<Part> parts;
  };
  // Copies chunk `i` and releases it, unless another thread has it; false on a copy error.
  bool Take(size_t i);
  // The chunk holding trainer address `address`, or chunks_.size().
  size_t ChunkAt(uint64_t address) const;
  void ServeFaults();

  WriteProtector& protector_;
  std::vector<Chunk> chunks_;  // sorted by begin
  std::unique_ptr<std::atomic<uint8_t>[]> state_;  // per chunk: 0 to copy, 1 copying, 2 done
  std::atomic<size_t> next_{0};     // where the background copy looks next
  std::atomic<size_t> remaining_{0};
  std::atomic<size_t> faulted_{0};
  std::atomic<bool> failed_{false};
  std::atomic<bool> stop_{false};
  bool outside_ = false;  // a region outside every registered range (a caller's bug)
};

}  // namespace ckpt::daemon
