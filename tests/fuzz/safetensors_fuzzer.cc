// libFuzzer target: the safetensors header reader, on any bytes as a whole file.
#include <cstddef>
#include <cstdint>
#include <string>

#include "format/safetensors.h"
#include "storage/memory_object.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto object = ckpt::storage::ReadFromMemory(
      "fuzz.safetensors", std::string(reinterpret_cast<const char*>(data), size));
  auto header = ckpt::format::ReadHeader(*object);
  if (header.ok()) {
    // A valid header describes only bytes inside the file.
    for (const auto& t : header->tensors) {
      if (t.begin > t.end || t.end > header->data_bytes) __builtin_trap();
    }
  }
  return 0;
}
