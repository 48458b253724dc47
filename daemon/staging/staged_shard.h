// A snapshot's bytes as the persist stage writes them: one region holding every entry back
// to back (exactly a shard's data region), what the entries are, and how much has landed.
// Staging fills it; persist reads it through this header alone, so staging never includes
// persist.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "daemon/staging/staging_watermark.h"
#include "format/safetensors.h"

namespace ckpt::daemon {

// A staged snapshot: `data` holds every entry back to back, exactly the shard's data region.
struct StagedShard {
  uint32_t rank = 0;
  const char* data = nullptr;  // owned by the caller's staging block for the call's duration
  uint64_t data_bytes = 0;
  std::vector<format::TensorEntry> entries;  // tensors and train-state blobs, contiguous, in order
  std::map<std::string, std::string> metadata;
  // Null when all of `data` is in place; otherwise the writer reads only what has landed.
  const StagingWatermark* landed = nullptr;
};

}  // namespace ckpt::daemon
