// Test-only fault (CKPTD_FAULT=eio-reading:<path suffix>): the daemon's filesystem, except
// that reads of a file whose path ends with the suffix fail with EIO past its first 4 KiB
// (a shard's header reads, its data region does not: a disk that fails under the data).
// tests/integration/bad_input_test.cc restores from such a shard.
#pragma once

#include <string>

#include "storage/filesystem.h"

namespace ckpt::daemon {

FilesystemPtr MakeReadFaultFilesystem(FilesystemPtr real, std::string suffix);

}  // namespace ckpt::daemon
