// A data region as a staged snapshot with frozen tensors holds it: in two places, its own
// bytes and a frozen block (common/scattered_bytes.h). Tests hand it to what reads staging
// memory (the uploader, the replicator) to check that nothing assumes one contiguous range.
#pragma once

#include <memory>
#include <string>

#include "common/scattered_bytes.h"

namespace ckpt::testing {

// `data` split at `at` (its middle by default) into two separate buffers, alive while the
// returned pointer is.
inline std::shared_ptr<const ScatteredBytes> SplitRegion(const std::string& data, size_t at = std::string::npos) {
  struct Held {
    std::string head, tail;
    ScatteredBytes region;
  };
  auto held = std::make_shared<Held>();
  const size_t split = at == std::string::npos ? data.size() / 2 : at;
  held->head = data.substr(0, split);
  held->tail = data.substr(split);
  held->region.Append(held->head.data(), held->head.size());
  held->region.Append(held->tail.data(), held->tail.size());
  return std::shared_ptr<const ScatteredBytes>(held, &held->region);
}

}  // namespace ckpt::testing
