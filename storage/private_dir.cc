#include "storage/private_dir.h"

#include <acl/libacl.h>
#include <fcntl.h>
#include <sys/acl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include <fmt/format.h>

#include "common/status.h"
#include "common/unique_fd.h"

namespace ckpt {
namespace {

struct AclDeleter {
  void operator()(void* acl) const { acl_free(acl); }
};

bool NoAclSupport(int err) { return err == ENOTSUP || err == EOPNOTSUPP || err == ENOSYS; }

}  // namespace

absl::Status MakeDirectoryPrivate(const std::string& dir, const DirectoryReaders& readers) {
  UniqueFd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (!fd.valid()) return ErrnoStatus(errno, fmt::format("open {}", dir));
  // First private, whatever follows: a failure below leaves the directory closed, not open.
  if (::fchmod(fd.get(), 0700) != 0) return ErrnoStatus(errno, fmt::format("chmod 0700 {}", dir));

  // u::rwx for ckptd, nothing for its group and others, r-x for the readers (the mask
  // caps named entries at r-x, so nothing inherited below is writable by them).
  std::string text = "u::rwx,g::---,o::---,m::r-x";
  const uid_t self = ::geteuid();
  if (readers.uid != 0 && readers.uid != self) text += fmt::format(",u:{}:r-x", readers.uid);
  if (readers.gid) text += fmt::format(",g:{}:r-x", *readers.gid);
  std::unique_ptr<void, AclDeleter> acl(acl_from_text(text.c_str()));
  if (!acl) return ErrnoStatus(errno, fmt::format("ACL \"{}\"", text));

  if (acl_set_fd(fd.get(), static_cast<acl_t>(acl.get())) != 0) {
    const int err = errno;
    if (NoAclSupport(err)) {
      return absl::UnimplementedError(fmt::format(
          "{} is private to ckptd (0700): its filesystem has no POSIX ACLs, so the job's owner "
          "cannot read its files directly (restore through ckptd, or export as root)",
          dir));
    }
    return ErrnoStatus(err, fmt::format("set the ACL of {}", dir));
  }
  // The default ACL can only be set by path: this descriptor's own path, so a directory
  // swapped in under the same name since the open is never the one changed.
  const std::string self_path = fmt::format("/proc/self/fd/{}", fd.get());
  if (acl_set_file(self_path.c_str(), ACL_TYPE_DEFAULT, static_cast<acl_t>(acl.get())) != 0) {
    return ErrnoStatus(errno, fmt::format("set the default ACL of {}", dir));
  }
  return absl::OkStatus();
}

}  // namespace ckpt
