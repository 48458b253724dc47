// The Store on a local (or shared, mounted) filesystem: an object is a file, a prefix a
// directory. Writes go out with O_DIRECT straight from the caller's memory where the
// filesystem takes it (no copy into the page cache, no eviction of the trainer's cached
// data), buffered and dropped from the cache after fsync where it does not (tmpfs, some
// FUSE mounts). Publish is today's commit: marker durable in the staging directory, rename,
// fsync of the parent.
#pragma once

#include <functional>
#include <string>

#include "storage/filesystem.h"
#include "storage/store.h"

namespace ckpt::storage {

struct LocalStoreOptions {
  // Directories made directly under the root (a checkpoint root's job directories) are
  // made mode 0700: one that has to be made again is never readable by others before its
  // owner's ACL is set (storage/private_dir.h).
  bool private_top_level = false;
  // Called with its name after such a directory had to be made (it was not there), before
  // anything is created in it: ckptd restores the job's owner record and access there.
  std::function<void(const std::string& name)> top_level_made;
};

// Keys are relative to `root`; with an empty root, keys are paths.
StorePtr MakeLocalStore(FilesystemPtr fs, std::string root, LocalStoreOptions options = {});

}  // namespace ckpt::storage
