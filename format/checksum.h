// Per-tensor checksums: XXH3-64, written as "xxh3:<16 hex digits>".
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

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

}  // namespace ckpt::format
