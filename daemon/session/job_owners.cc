#include "daemon/session/job_owners.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "common/names.h"
#include "common/status.h"

namespace ckpt::daemon {
namespace {

constexpr char kOwnerFile[] = ".owner";

}  // namespace

JobOwners::JobOwners(Filesystem& fs, std::string root, Options options)
    : fs_(fs), root_(std::move(root)), options_(std::move(options)) {}

bool JobOwners::Allowed(const Owner& owner, const PeerIdentity& caller) const {
  return caller.uid == 0 || caller.uid == options_.daemon_uid || caller.uid == owner.uid ||
         (owner.gid && caller.InGroup(*owner.gid));
}

std::optional<JobOwners::Owner> JobOwners::LoadLocked(const std::string& job) {
  if (auto it = owners_.find(job); it != owners_.end()) return it->second;
  std::string path = root_ + "/" + job + "/" + kOwnerFile;
  if (!fs_.Exists(path)) return std::nullopt;
  auto text = ReadSmallFile(fs_, path);
  if (!text.ok()) return std::nullopt;
  auto j = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("uid") || !j["uid"].is_number_unsigned()) return std::nullopt;
  Owner owner{j["uid"].get<uid_t>(), std::nullopt};
  if (j.contains("gid") && j["gid"].is_number_unsigned()) owner.gid = j["gid"].get<gid_t>();
  owners_[job] = owner;
  return owner;
}

absl::Status JobOwners::Refuse(const std::string& job, const Owner& owner,
                               const PeerIdentity& caller, std::string_view what) const {
  return absl::PermissionDeniedError(fmt::format(
      "job {} belongs to uid {}{}: {} may not {} it", job, owner.uid,
      owner.gid ? fmt::format(" (and group {})", *owner.gid) : "", caller.Describe(), what));
}

absl::Status JobOwners::Claim(const std::string& job, const PeerIdentity& caller) {
  CKPT_RETURN_IF_ERROR(ValidateJobName(job));
  std::lock_guard lock(mu_);
  if (std::optional<Owner> owner = LoadLocked(job)) {
    if (!Allowed(*owner, caller)) return Refuse(job, *owner, caller, "register ranks into");
    return absl::OkStatus();
  }
  Owner owner{caller.uid, std::nullopt};
  for (uint32_t gid : options_.job_gids) {
    if (caller.InGroup(gid)) {
      owner.gid = gid;
      break;
    }
  }
  nlohmann::json j = {{"uid", owner.uid}};
  if (owner.gid) j["gid"] = *owner.gid;
  std::string dir = root_ + "/" + job;
  std::string path = dir + "/" + kOwnerFile;
  CKPT_RETURN_IF_ERROR(fs_.MakeDir(dir));
  // Written whole under a temporary name, then renamed: a crash leaves the old state.
  std::string text = j.dump() + "\n";
  CKPT_ASSIGN_OR_RETURN(UniqueFd fd, fs_.CreateFile(path + ".tmp"));
  CKPT_RETURN_IF_ERROR(fs_.WriteAt(fd.get(), text.data(), text.size(), 0));
  CKPT_RETURN_IF_ERROR(fs_.SyncFile(fd.get()));
  CKPT_RETURN_IF_ERROR(fs_.Rename(path + ".tmp", path));
  CKPT_RETURN_IF_ERROR(fs_.SyncDir(dir));
  owners_[job] = owner;
  return absl::OkStatus();
}

absl::Status JobOwners::Check(const std::string& job, const PeerIdentity& caller,
                              std::string_view what) {
  CKPT_RETURN_IF_ERROR(ValidateJobName(job));
  std::lock_guard lock(mu_);
  std::optional<Owner> owner = LoadLocked(job);
  if (!owner) {
    if (caller.uid == 0 || caller.uid == options_.daemon_uid) return absl::OkStatus();
    return absl::PermissionDeniedError(fmt::format(
        "job {} has no owner on record: only root or ckptd's own user may {} it", job, what));
  }
  if (!Allowed(*owner, caller)) return Refuse(job, *owner, caller, what);
  return absl::OkStatus();
}

}  // namespace ckpt::daemon
