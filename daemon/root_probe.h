// ckptd's first question about its --root at start: can it write there? It creates the
// directory if needed, then creates, writes, fsyncs and removes a probe file (unnamed where
// the file system allows, so a crash leaves nothing). A root it
// cannot write fails the start with a message that says why and what to change; in
// particular systemd's ProtectSystem=strict (the shipped unit) leaves every path but
// ReadWritePaths= read-only, so a root on /mnt/nvme fails with EROFS, and the message names
// the drop-in that lets ckptd write there (docs/operators.md, "systemd").
#pragma once

#include <string>

#include "absl/status/status.h"

namespace ckpt::daemon {

// OK when `root` is a directory ckptd can write. FailedPrecondition (read-only file system)
// or PermissionDenied (not ckptd's to write) otherwise, each naming its remedy.
absl::Status CheckRootWritable(const std::string& root);

}  // namespace ckpt::daemon
