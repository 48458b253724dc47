// Reads a committed shard file for upload from the copy still in staging memory where it
// can, and from the local file where it cannot. A shard file is its header, then a data
// region that is byte for byte the staged snapshot (persist writes it straight from staging
// memory), so the data region need not be read back from the disk that persist is busy
// writing the next step to: an upload then costs a copy out of memory instead of a disk
// read (on the benchmark VM the disk read was what kept uploads below the gateway's limit).
//
// The memory is held weakly: the stager takes it back whenever it needs it for a new
// snapshot (the hot cache evicts it), and is never kept waiting by an upload longer than one
// read. Once it is gone, the rest comes from the file.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

#include "common/scattered_bytes.h"
#include "storage/store.h"

namespace ckpt::daemon::upload {

// A rank's staged snapshot of a step: its data region, `bytes` long, alive while the hot
// cache keeps it (an aliasing pointer into the snapshot).
struct InMemoryShard {
  std::weak_ptr<const ScatteredBytes> data;
  uint64_t bytes = 0;
};

// Wraps `file` (the local shard file) so that reads of its data region come from `memory`
// while it lasts; bytes served from memory are added to `*from_memory`. Returns `file`
// itself when its header does not place a data region of exactly `memory.bytes` at its end
// (never trusted blindly: what is uploaded must be the file).
std::unique_ptr<storage::ObjectReader> MemoryFirst(std::unique_ptr<storage::ObjectReader> file,
                                                   InMemoryShard memory,
                                                   std::atomic<uint64_t>* from_memory);

}  // namespace ckpt::daemon::upload
