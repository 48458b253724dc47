// A buffer a trainer registered, as the daemon's stages see it: where its bytes are mapped in
// the daemon, what it is, and where it sits in its global tensor.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "daemon/staging/staged_snapshot.h"

namespace ckpt::daemon {

// A buffer a trainer registered, as the daemon sees it (mapped into the daemon).
struct RegisteredTensor {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  uint64_t nbytes = 0;
  char* data = nullptr;  // in a segment or CUDA allocation the owning session keeps mapped
  bool on_device = false;  // a GPU buffer: copied by its device's CUDA engine
  int device = -1;         // the daemon's ordinal of that device
  const void* allocation = nullptr;  // that buffer's CUDA allocation (its mapping's base)
  // Where the trainer sees `data`, when its arena is registered for write-protection
  // (copy-on-write snapshots); 0 otherwise.
  uint64_t trainer_address = 0;
  TensorPlacement placement;
  // Registered frozen (TensorSpec.frozen, UpdateRequest.freeze): the trainer does not change
  // it, so snapshots take its bytes from the last snapshot instead of from the trainer
  // (frozen_tensors.h).
  bool frozen = false;
  bool sparse = false;  // TensorSpec.sparse: small chunks in an incremental step
};

}  // namespace ckpt::daemon
