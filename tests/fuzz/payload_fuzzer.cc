// libFuzzer target: the command ring's snapshot payload decoder and the checks the stager
// runs on what it decoded (metadata that must be text, train-state names).
#include <cstddef>
#include <cstdint>

#include "common/names.h"
#include "shm/payload.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto payload = ckpt::shm::DecodePayload(data, size);
  if (!payload.ok()) return 0;
  (void)ckpt::ValidateMetadata(payload->metadata);
  for (const auto& blob : payload->train_state) (void)ckpt::ValidateTensorName(blob.name);
  return 0;
}
