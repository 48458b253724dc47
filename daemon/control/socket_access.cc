#include "daemon/control/socket_access.h"

#include <acl/libacl.h>
#include <sys/acl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include <cerrno>
#include <memory>

#include "common/status.h"

namespace ckpt::daemon {
namespace {

struct AclDeleter {
  void operator()(void* acl) const { acl_free(acl); }
};
using AclPtr = std::unique_ptr<void, AclDeleter>;

bool NoAclSupport(int err) { return err == ENOTSUP || err == EOPNOTSUPP || err == ENOSYS; }

absl::Status NoAcls(const std::string& path) {
  return absl::UnimplementedError(fmt::format(
      "{}: its filesystem has no POSIX ACLs, so --allow-uid and --allow-gid users who are not in "
      "ckptd's group cannot reach it (put them in ckptd's group instead)",
      path));
}

// Adds `perm` to the entry of `tag` for `id` in `acl`, creating the entry if needed.
absl::Status AddPermission(acl_t* acl, acl_tag_t tag, uint32_t id, acl_perm_t perm) {
  acl_entry_t entry;
  for (int which = ACL_FIRST_ENTRY; acl_get_entry(*acl, which, &entry) == 1; which = ACL_NEXT_ENTRY) {
    acl_tag_t t;
    if (acl_get_tag_type(entry, &t) != 0 || t != tag) continue;
    void* qualifier = acl_get_qualifier(entry);
    const bool same = qualifier != nullptr && *static_cast<uint32_t*>(qualifier) == id;
    acl_free(qualifier);
    if (!same) continue;
    acl_permset_t perms;
    if (acl_get_permset(entry, &perms) != 0 || acl_add_perm(perms, perm) != 0) return ErrnoStatus(errno, "ACL entry");
    return absl::OkStatus();
  }
  acl_permset_t perms;
  if (acl_create_entry(acl, &entry) != 0 || acl_set_tag_type(entry, tag) != 0 ||
      acl_set_qualifier(entry, &id) != 0 || acl_get_permset(entry, &perms) != 0 || acl_clear_perms(perms) != 0 ||
      acl_add_perm(perms, perm) != 0) {
    return ErrnoStatus(errno, "ACL entry");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status GrantSocketAccess(const std::string& path, const SocketAccess& access) {
  if (access.empty()) return absl::OkStatus();
  std::string text = "u::rw-,g::rw-,o::---,m::rw-";
  for (uint32_t uid : access.uids) text += fmt::format(",u:{}:rw-", uid);
  for (uint32_t gid : access.gids) text += fmt::format(",g:{}:rw-", gid);
  AclPtr acl(acl_from_text(text.c_str()));
  if (!acl) return ErrnoStatus(errno, fmt::format("ACL \"{}\"", text));
  if (acl_set_file(path.c_str(), ACL_TYPE_ACCESS, static_cast<acl_t>(acl.get())) != 0) {
    const int err = errno;
    if (NoAclSupport(err)) return NoAcls(path);
    return ErrnoStatus(err, fmt::format("set the ACL of {}", path));
  }
  return absl::OkStatus();
}

absl::Status GrantDirectoryEntry(const std::string& dir, const SocketAccess& access) {
  if (access.empty()) return absl::OkStatus();
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0) return ErrnoStatus(errno, fmt::format("stat {}", dir));
  if (st.st_uid != ::geteuid()) return absl::OkStatus();  // not ours: its owner decides who enters
  acl_t current = acl_get_file(dir.c_str(), ACL_TYPE_ACCESS);
  if (current == nullptr) {
    const int err = errno;
    if (NoAclSupport(err)) return NoAcls(dir);
    return ErrnoStatus(err, fmt::format("read the ACL of {}", dir));
  }
  for (uint32_t uid : access.uids) {
    if (absl::Status s = AddPermission(&current, ACL_USER, uid, ACL_EXECUTE); !s.ok()) {
      acl_free(current);
      return s;
    }
  }
  for (uint32_t gid : access.gids) {
    if (absl::Status s = AddPermission(&current, ACL_GROUP, gid, ACL_EXECUTE); !s.ok()) {
      acl_free(current);
      return s;
    }
  }
  // The mask becomes the union of the group class's entries: the owning group keeps exactly
  // what it had, the new entries get --x.
  AclPtr acl(current);
  if (acl_calc_mask(&current) != 0) return ErrnoStatus(errno, fmt::format("ACL mask of {}", dir));
  acl.release();
  acl.reset(current);
  if (acl_set_file(dir.c_str(), ACL_TYPE_ACCESS, current) != 0) {
    const int err = errno;
    if (NoAclSupport(err)) return NoAcls(dir);
    return ErrnoStatus(err, fmt::format("set the ACL of {}", dir));
  }
  return absl::OkStatus();
}

}  // namespace ckpt::daemon
