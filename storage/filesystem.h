// The filesystem calls the persist path makes, behind an interface so that tests can make
// write, fsync or rename fail with ENOSPC or EIO on demand (STYLE.md #11).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/unique_fd.h"

namespace ckpt {

class Filesystem {
 public:
  virtual ~Filesystem() = default;

  // Creates (truncating) a file for writing with mode 0640.
  virtual absl::StatusOr<UniqueFd> CreateFile(const std::string& path) = 0;
  // The same with O_DIRECT: writes then need 4 KiB-aligned buffers, offsets and sizes.
  // InvalidArgument where the filesystem does not support it (tmpfs, some FUSE mounts).
  virtual absl::StatusOr<UniqueFd> CreateFileDirect(const std::string& path) = 0;
  virtual absl::Status Truncate(int fd, uint64_t size) = 0;
  virtual absl::StatusOr<UniqueFd> OpenForRead(const std::string& path) = 0;
  // The same with O_DIRECT: reads then need 4 KiB-aligned buffers, offsets and sizes.
  // InvalidArgument where the filesystem does not support it.
  virtual absl::StatusOr<UniqueFd> OpenForDirectRead(const std::string& path) = 0;
  // Writes all of [data, data + size) at `offset`, retrying short writes.
  virtual absl::Status WriteAt(int fd, const void* data, size_t size, uint64_t offset) = 0;
  // Reads exactly `size` bytes at `offset`; a short file is an error (OutOfRange).
  virtual absl::Status ReadAt(int fd, void* data, size_t size, uint64_t offset) = 0;
  virtual absl::Status SyncFile(int fd) = 0;
  // Drops a durable file's pages from the page cache (best effort).
  virtual void DropFromCache(int fd) = 0;
  virtual absl::Status SyncDir(const std::string& path) = 0;
  virtual absl::Status Rename(const std::string& from, const std::string& to) = 0;
  virtual absl::Status MakeDir(const std::string& path) = 0;          // ok if it exists
  // MakeDir, the last component made mode 0700 when it is new (a job's directory: nothing
  // of it is readable by others before its owner's ACL is set, storage/private_dir.h).
  virtual absl::Status MakePrivateDir(const std::string& path) = 0;
  virtual absl::Status RemoveTree(const std::string& path) = 0;       // ok if missing
  virtual absl::StatusOr<std::vector<std::string>> ListDir(const std::string& path) = 0;
  virtual absl::StatusOr<uint64_t> FileSize(const std::string& path) = 0;
  virtual bool Exists(const std::string& path) = 0;
  // A directory, not followed through a symlink.
  virtual bool IsDirectory(const std::string& path) = 0;
};

using FilesystemPtr = std::shared_ptr<Filesystem>;

// The real thing: POSIX calls, EINTR retried.
FilesystemPtr MakePosixFilesystem();

// Reads a whole small file (manifests).
absl::StatusOr<std::string> ReadSmallFile(Filesystem& fs, const std::string& path);

// Writes a small file durably: tmp name, fsync, rename, fsync of the directory.
absl::Status WriteFileAtomically(Filesystem& fs, const std::string& path,
                                 const std::string& contents);

}  // namespace ckpt
