// Who reaches ckptd's sockets through the file system. The socket files are mode 0660 for
// ckptd's user and group; each --allow-uid and --allow-gid also gets a POSIX ACL entry rw-
// on them, and --x (enter, not list) on the sockets' directory when that directory is
// ckptd's own (systemd's RuntimeDirectory=, mode 0750). So a trainer in an allowed group
// that is not ckptd's reaches the socket, and nobody else gets further than before. The
// kernel's peer credentials, checked at accept (unix_listener.h), still decide who is served:
// the ACL only lets an allowed user's connect() get that far. docs/security.md.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace ckpt::daemon {

struct SocketAccess {
  std::vector<uint32_t> uids;  // --allow-uid
  std::vector<uint32_t> gids;  // --allow-gid
  bool empty() const { return uids.empty() && gids.empty(); }
};

// Adds rw- entries for `access` to the socket file at `path` (its owner and group keep rw-,
// others nothing). Unimplemented, naming the consequence, where the filesystem has no ACLs.
absl::Status GrantSocketAccess(const std::string& path, const SocketAccess& access);

// Adds --x entries for `access` to the directory `dir` when this process owns it (the other
// entries and the owning group's access stay as they are); a directory that is not ours is
// left alone. Unimplemented, naming the consequence, where the filesystem has no ACLs.
absl::Status GrantDirectoryEntry(const std::string& dir, const SocketAccess& access);

}  // namespace ckpt::daemon
