// Directories that only their owner may read. A job's checkpoints live under <root>/<job>,
// written by ckptd's own user; the uid that owns the job (and its --job-group, if any)
// must read them (ckptctl export, verify, DCP readers) and nobody else may, not even other
// members of ckptd's group (which every trainer user is in, to reach the socket).
//
// The gate is the job directory: mode 0700 for ckptd, and a POSIX ACL that lets the job's
// owner (and group) list and traverse it. The same ACL is the directory's default ACL, so
// every step directory and file created below inherits it: the owner reads them through
// the ACL, other users cannot even reach them. Renames keep the ACL a file was made with.
#pragma once

#include <sys/types.h>

#include <optional>
#include <string>

#include "absl/status/status.h"

namespace ckpt {

struct DirectoryReaders {
  uid_t uid = 0;                 // root and ckptd's own uid need no entry, and get none
  std::optional<gid_t> gid;      // a group whose members read too
};

// Makes `dir` (an existing directory, not followed through a symlink) ckptd's alone, with
// read access for `readers` by ACL, inherited by what is created below it from now on.
// When the filesystem has no POSIX ACLs the directory is still made 0700 (private to ckptd:
// owners then read through ckptd, or as root) and the answer is Unimplemented, saying so.
absl::Status MakeDirectoryPrivate(const std::string& dir, const DirectoryReaders& readers);

}  // namespace ckpt
