// Damages a safetensors file the way a bad disk would: one bit, in its data region.
#pragma once

#include <cstdint>
#include <fstream>
#include <stdexcept>
#include <string>

namespace ckpt::testing {

// Flips bit `mask` of the byte `offset` bytes into the data region of the safetensors file
// at `path` (past its 8-byte length and JSON header). Throws when the file or the byte is not
// there, so that a test damaging a file that does not exist fails instead of passing.
inline void FlipDataBit(const std::string& path, uint64_t offset, char mask = 0x04) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  uint64_t header = 0;
  f.read(reinterpret_cast<char*>(&header), 8);
  const auto at = static_cast<std::streamoff>(8 + header + offset);
  char byte = 0;
  f.seekg(at);
  f.read(&byte, 1);
  if (!f) throw std::runtime_error("cannot damage byte " + std::to_string(offset) + " of " + path);
  byte = static_cast<char>(byte ^ mask);
  f.seekp(at);
  f.write(&byte, 1);
  f.flush();
  if (!f) throw std::runtime_error("cannot damage byte " + std::to_string(offset) + " of " + path);
}

}  // namespace ckpt::testing
