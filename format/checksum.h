// Per-tensor checksums: XXH3-64, written as "xxh3:<16 hex digits>".
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

namespace ckpt::format {

class Checksum {
 public:
  Checksum();
  ~Checksum();
  Checksum(const Checksum&) = delete;
  Checksum& operator=(const Checksum&) = delete;

  void Update(const void* data, size_t size);
  std::string Finish() const;  // "xxh3:..."
  void Reset();

 private:
  struct State;
  std::unique_ptr<State> state_;
};

std::string ChecksumOf(const void* data, size_t size);

// The same XXH3-64 as an integer (what an incremental step's base keeps per chunk: 8 bytes),
// and its text form "xxh3:<16 lowercase hex>" both ways (nullopt: not that form).
uint64_t Checksum64(const void* data, size_t size);
std::string ChecksumText(uint64_t xxh3);
std::optional<uint64_t> ParseChecksumText(std::string_view text);

}  // namespace ckpt::format
