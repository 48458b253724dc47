#include "daemon/session/job_owners.h"

#include <fmt/format.h>

#include <cstdint>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/log.h"
#include "common/names.h"
#include "storage/private_dir.h"
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

absl::StatusOr<std::optional<JobOwners::Owner>> JobOwners::LoadLocked(const std::string& job) {
  if (auto it = owners_.find(job); it != owners_.end()) return std::optional<Owner>(it->second);
  std::string path = root_ + "/" + job + "/" + kOwnerFile;
  if (!fs_.Exists(path)) return std::optional<Owner>();
  auto refuse = [&](std::string_view why) {
    return absl::PermissionDeniedError(fmt::format(
        "job {}: its owner record {} {}; only root or ckptd's own user may use the job until an "
        "operator fixes it",
        job, path, why));
  };
  auto text = ReadSmallFile(fs_, path);
  if (!text.ok()) return refuse(fmt::format("cannot be read ({})", Message(text.status())));
  auto j = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("uid") || !j["uid"].is_number_unsigned() ||
      j["uid"].get<uint64_t>() > UINT32_MAX) {
    return refuse("is damaged");
  }
  Owner owner{j["uid"].get<uid_t>(), std::nullopt};
  if (j.contains("gid")) {
    if (!j["gid"].is_number_unsigned() || j["gid"].get<uint64_t>() > UINT32_MAX) {
      return refuse("is damaged");
    }
    owner.gid = j["gid"].get<gid_t>();
  }
  CKPT_RETURN_IF_ERROR(ProtectLocked(job, owner));
  owners_[job] = owner;
  return std::optional<Owner>(owner);
}

absl::Status JobOwners::WriteRecord(const std::string& job, const Owner& owner) {
  nlohmann::json j = {{"uid", owner.uid}};
  if (owner.gid) j["gid"] = *owner.gid;
  // Written whole under a temporary name of its own, then renamed: a crash leaves the old
  // state, and two daemons on one shared root claiming the job at once both succeed.
  return WriteFileAtomically(fs_, root_ + "/" + job + "/" + kOwnerFile, j.dump() + "\n");
}

absl::Status JobOwners::ProtectLocked(const std::string& job, const Owner& owner) {
  if (protected_.count(job)) return absl::OkStatus();
  absl::Status closed = MakeDirectoryPrivate(root_ + "/" + job, {owner.uid, owner.gid});
  if (absl::IsUnimplemented(closed)) {
    log::Get(log::Component::kSession).warn("job {}: {}", job, Message(closed));
    closed = absl::OkStatus();
  }
  if (!closed.ok()) {
    // Fails closed: a directory that may still be open to others is not used.
    return absl::PermissionDeniedError(fmt::format(
        "job {}: its directory cannot be made readable by its owner alone: {}", job,
        Message(closed)));
  }
  protected_.insert(job);
  return absl::OkStatus();
}

absl::Status JobOwners::Refuse(const std::string& job, const Owner& owner,
                               const PeerIdentity& caller, std::string_view what) const {
  return absl::PermissionDeniedError(fmt::format(
      "job {} belongs to uid {}{}: {} may not {} it", job, owner.uid,
      owner.gid ? fmt::format(" (and group {})", *owner.gid) : "", caller.Describe(), what));
}

absl::Status JobOwners::MayClaimLocked(const std::string& job, const PeerIdentity& caller) {
  CKPT_RETURN_IF_ERROR(ValidateJobName(job));
  CKPT_ASSIGN_OR_RETURN(std::optional<Owner> owner, LoadLocked(job));
  if (owner) {
    if (!Allowed(*owner, caller)) return Refuse(job, *owner, caller, "register ranks into");
    return absl::OkStatus();
  }
  if (caller.uid == 0 || caller.uid == options_.daemon_uid) return absl::OkStatus();
  // No record: a new job is anyone's to create, but one that already holds checkpoints
  // (from a ckptd that kept no owners) is not the first comer's to take.
  std::string dir = root_ + "/" + job;
  if (fs_.Exists(dir)) {
    auto names = fs_.ListDir(dir);
    bool has_steps = !names.ok();
    for (const std::string& name : names.ok() ? *names : std::vector<std::string>{}) {
      has_steps = has_steps || name.rfind("step-", 0) == 0;
    }
    if (has_steps) {
      return absl::PermissionDeniedError(fmt::format(
          "job {} has checkpoints but no owner on record (made by an older ckptd): its first "
          "registration must come from root or ckptd's own user, or an operator writes {}/{}",
          job, dir, kOwnerFile));
    }
  }
  return absl::OkStatus();
}

absl::Status JobOwners::MayClaim(const std::string& job, const PeerIdentity& caller) {
  std::lock_guard lock(mu_);
  return MayClaimLocked(job, caller);
}

absl::Status JobOwners::Claim(const std::string& job, const PeerIdentity& caller) {
  std::lock_guard lock(mu_);
  CKPT_RETURN_IF_ERROR(MayClaimLocked(job, caller));
  if (owners_.count(job)) return absl::OkStatus();
  Owner owner{caller.uid, std::nullopt};
  for (uint32_t gid : options_.job_gids) {
    if (caller.InGroup(gid)) {
      owner.gid = gid;
      break;
    }
  }
  CKPT_RETURN_IF_ERROR(fs_.MakePrivateDir(root_ + "/" + job));
  CKPT_RETURN_IF_ERROR(ProtectLocked(job, owner));
  CKPT_RETURN_IF_ERROR(WriteRecord(job, owner));
  owners_[job] = owner;
  return absl::OkStatus();
}

void JobOwners::Restore(const std::string& job) {
  std::lock_guard lock(mu_);
  auto& log = log::Get(log::Component::kSession);
  protected_.erase(job);
  auto it = owners_.find(job);
  if (it == owners_.end()) {
    log.warn("job {}: its directory was deleted under ckptd and made again; no owner on record, "
             "so it is ckptd's alone",
             job);
    return;
  }
  const Owner owner = it->second;
  absl::Status written = WriteRecord(job, owner);
  absl::Status closed = ProtectLocked(job, owner);
  log.warn("job {}: its directory was deleted under ckptd (its earlier steps are gone) and made "
           "again for uid {}{}{}",
           job, owner.uid, written.ok() ? "" : fmt::format("; its owner record could not be written: {}", Message(written)),
           closed.ok() ? "" : fmt::format("; {}", Message(closed)));
}

int JobOwners::CloseAll() {
  std::lock_guard lock(mu_);
  auto names = fs_.ListDir(root_);
  if (!names.ok()) return 0;
  int closed = 0;
  for (const std::string& job : *names) {
    if (!ValidateJobName(job).ok() || !fs_.IsDirectory(root_ + "/" + job)) continue;
    absl::StatusOr<std::optional<Owner>> owner = LoadLocked(job);  // protects when recorded
    if (owner.ok() && !*owner) {
      absl::Status made = MakeDirectoryPrivate(root_ + "/" + job, {options_.daemon_uid, std::nullopt});
      if (!made.ok() && !absl::IsUnimplemented(made)) owner = made;
    }
    if (!owner.ok()) {
      log::Get(log::Component::kSession).warn("job {}: {}", job, Message(owner.status()));
      continue;
    }
    ++closed;
  }
  return closed;
}

absl::Status JobOwners::Check(const std::string& job, const PeerIdentity& caller,
                              std::string_view what) {
  CKPT_RETURN_IF_ERROR(ValidateJobName(job));
  std::lock_guard lock(mu_);
  CKPT_ASSIGN_OR_RETURN(std::optional<Owner> owner, LoadLocked(job));
  if (!owner) {
    if (caller.uid == 0 || caller.uid == options_.daemon_uid) return absl::OkStatus();
    return absl::PermissionDeniedError(fmt::format(
        "job {} has no owner on record: only root or ckptd's own user may {} it", job, what));
  }
  if (!Allowed(*owner, caller)) return Refuse(job, *owner, caller, what);
  return absl::OkStatus();
}

}  // namespace ckpt::daemon
