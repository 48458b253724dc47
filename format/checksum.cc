#include "format/checksum.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <charconv>

namespace ckpt::format {

struct Checksum::State {
  XXH3_state_t* xxh = XXH3_createState();
  ~State() { XXH3_freeState(xxh); }
};

Checksum::Checksum() : state_(std::make_unique<State>()) { XXH3_64bits_reset(state_->xxh); }
Checksum::~Checksum() = default;

void Checksum::Update(const void* data, size_t size) { XXH3_64bits_update(state_->xxh, data, size); }

void Checksum::Reset() { XXH3_64bits_reset(state_->xxh); }

std::string Checksum::Finish() const { return ChecksumText(XXH3_64bits_digest(state_->xxh)); }

std::string ChecksumOf(const void* data, size_t size) { return ChecksumText(XXH3_64bits(data, size)); }

uint64_t Checksum64(const void* data, size_t size) { return XXH3_64bits(data, size); }

std::string ChecksumText(uint64_t xxh3) { return fmt::format("xxh3:{:016x}", xxh3); }

std::optional<uint64_t> ParseChecksumText(std::string_view text) {
  constexpr std::string_view kPrefix = "xxh3:";
  if (text.size() != kPrefix.size() + 16 || text.substr(0, kPrefix.size()) != kPrefix) return std::nullopt;
  uint64_t value = 0;
  const char* begin = text.data() + kPrefix.size();
  const char* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(begin, end, value, 16);
  if (ec != std::errc() || ptr != end) return std::nullopt;
  return value;
}

}  // namespace ckpt::format
