// A snapshot's bytes as the persist stage writes them: its data region (every entry back to
// back, exactly a shard's), what the entries are, and how much has landed.
// Staging fills it; persist reads it through this header alone, so staging never includes
// persist.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/scattered_bytes.h"
#include "daemon/staging/staging_watermark.h"
#include "format/safetensors.h"

namespace ckpt::daemon {

// A staged snapshot: `region` reads as every entry back to back, exactly the shard's data
// region. Its bytes may lie in several places (a session's frozen tensors are held once, in a
// frozen block of their own), but each entry lies whole in one.
struct StagedShard {
  uint32_t rank = 0;
  ScatteredBytes region;  // in the caller's staging memory, alive for the call's duration
  uint64_t data_bytes = 0;
  std::vector<format::TensorEntry> entries;  // tensors and train-state blobs, contiguous, in order
  std::map<std::string, std::string> metadata;
  // Null when all of `data` is in place; otherwise the writer reads only what has landed.
  const StagingWatermark* landed = nullptr;

  // Where entry `e`'s bytes are (each entry lies in one span of `region`).
  const char* Data(const format::TensorEntry& e) const { return region.Contiguous(e.begin, e.end - e.begin); }
};

}  // namespace ckpt::daemon
