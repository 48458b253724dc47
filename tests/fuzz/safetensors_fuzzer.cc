// libFuzzer target: the safetensors header reader, on any bytes as a whole file.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>

#include "storage/filesystem.h"
#include "format/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static ckpt::FilesystemPtr fs = ckpt::MakePosixFilesystem();
  int fd = ::memfd_create("safetensors-fuzz", MFD_CLOEXEC);
  if (fd < 0) return 0;
  if (size > 0 && ::write(fd, data, size) != static_cast<ssize_t>(size)) {
    ::close(fd);
    return 0;
  }
  auto header = ckpt::format::ReadHeader(*fs, fd, size, "fuzz.safetensors");
  if (header.ok()) {
    // A valid header describes only bytes inside the file.
    for (const auto& t : header->tensors) {
      if (t.begin > t.end || t.end > header->data_bytes) __builtin_trap();
    }
  }
  ::close(fd);
  return 0;
}
