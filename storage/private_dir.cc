#include "storage/private_dir.h"

#include <acl/libacl.h>
#include <fcntl.h>
#include <sys/acl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>

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
  // The default ACL can only be read and set by path: this descriptor's own path, so a
  // directory swapped in under the same name since the open is never the one looked at.
  const std::string self_path = fmt::format("/proc/self/fd/{}", fd.get());

  // u::rwx for ckptd, nothing for its group and others, r-x for the readers (the mask
  // caps named entries at r-x, so nothing inherited below is writable by them).
  std::string text = "u::rwx,g::---,o::---,m::r-x";
  const uid_t self = ::geteuid();
  if (readers.uid != 0 && readers.uid != self) text += fmt::format(",u:{}:r-x", readers.uid);
  if (readers.gid) text += fmt::format(",g:{}:r-x", *readers.gid);
  std::unique_ptr<void, AclDeleter> acl(acl_from_text(text.c_str()));
  if (!acl) return ErrnoStatus(errno, fmt::format("ACL \"{}\"", text));

  // Closed this way already (every start after the first): everything made inside since has
  // inherited it, so the walk below, one call per file, is not needed again.
  auto same = [&](acl_t current) {
    std::unique_ptr<void, AclDeleter> held(current);
    return current != nullptr && acl_cmp(current, static_cast<acl_t>(acl.get())) == 0;
  };
  if (same(acl_get_fd(fd.get())) && same(acl_get_file(self_path.c_str(), ACL_TYPE_DEFAULT))) {
    return absl::OkStatus();
  }
  // First private, whatever follows: a failure below leaves the directory closed, not open.
  if (::fchmod(fd.get(), 0700) != 0) return ErrnoStatus(errno, fmt::format("chmod 0700 {}", dir));

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
  if (acl_set_file(self_path.c_str(), ACL_TYPE_DEFAULT, static_cast<acl_t>(acl.get())) != 0) {
    return ErrnoStatus(errno, fmt::format("set the default ACL of {}", dir));
  }
  // What is already inside (made by an older ckptd, 0640 in ckptd's group) gets the same
  // access the default ACL gives new entries: directories r-x, files r-- for the readers.
  // Nobody else can reach it any more (the directory above is closed), so paths are safe.
  std::string file_text = text;
  for (std::string_view from : {std::string_view("m::r-x"), std::string_view("u::rwx")}) {
    if (size_t at = file_text.find(from); at != std::string::npos) {
      file_text.replace(at, from.size(), from == "m::r-x" ? "m::r--" : "u::rw-");
    }
  }
  for (size_t at; (at = file_text.find(":r-x")) != std::string::npos;) file_text.replace(at, 4, ":r--");
  std::unique_ptr<void, AclDeleter> file_acl(acl_from_text(file_text.c_str()));
  if (!file_acl) return ErrnoStatus(errno, fmt::format("ACL \"{}\"", file_text));
  std::error_code ec;
  for (auto it = std::filesystem::recursive_directory_iterator(self_path, ec);
       !ec && it != std::filesystem::recursive_directory_iterator(); it.increment(ec)) {
    const auto type = it->symlink_status(ec).type();
    const std::string path = it->path().string();
    if (type == std::filesystem::file_type::directory) {
      if (acl_set_file(path.c_str(), ACL_TYPE_ACCESS, static_cast<acl_t>(acl.get())) != 0 ||
          acl_set_file(path.c_str(), ACL_TYPE_DEFAULT, static_cast<acl_t>(acl.get())) != 0) {
        return ErrnoStatus(errno, fmt::format("set the ACL of {}", path));
      }
    } else if (type == std::filesystem::file_type::regular) {
      if (acl_set_file(path.c_str(), ACL_TYPE_ACCESS, static_cast<acl_t>(file_acl.get())) != 0) {
        return ErrnoStatus(errno, fmt::format("set the ACL of {}", path));
      }
    }
  }
  if (ec) return ErrnoStatus(ec.value(), fmt::format("list {}", dir));
  return absl::OkStatus();
}

}  // namespace ckpt
