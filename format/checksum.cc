#include "format/checksum.h"

#include <fmt/format.h>
#include <xxhash.h>

namespace ckpt::format {

struct Checksum::State {
  XXH3_state_t* xxh = XXH3_createState();
  ~State() { XXH3_freeState(xxh); }
};

Checksum::Checksum() : state_(std::make_unique<State>()) { XXH3_64bits_reset(state_->xxh); }
Checksum::~Checksum() = default;

void Checksum::Update(const void* data, size_t size) { XXH3_64bits_update(state_->xxh, data, size); }

void Checksum::Reset() { XXH3_64bits_reset(state_->xxh); }

std::string Checksum::Finish() const {
  return fmt::format("xxh3:{:016x}", XXH3_64bits_digest(state_->xxh));
}

std::string ChecksumOf(const void* data, size_t size) {
  return fmt::format("xxh3:{:016x}", XXH3_64bits(data, size));
}

}  // namespace ckpt::format
