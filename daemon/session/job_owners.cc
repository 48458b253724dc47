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

// {"uid": U, "gid": G}; nullopt when it is not one.
std::optional<std::pair<uid_t, std::optional<gid_t>>> ParseOwner(const std::string& text) {
  auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("uid") || !j["uid"].is_number_unsigned() ||
      j["uid"].get<uint64_t>() > UINT32_MAX) {
    return std::nullopt;
  }
  std::pair<uid_t, std::optional<gid_t>> owner{j["uid"].get<uid_t>(), std::nullopt};
  if (j.contains("gid")) {
    if (!j["gid"].is_number_unsigned() || j["gid"].get<uint64_t>() > UINT32_MAX) return std::nullopt;
    owner.second = j["gid"].get<gid_t>();
  }
  return owner;
}

std::string OwnerRecord(uid_t uid, std::optional<gid_t> gid) {
  nlohmann::json j = {{"uid", uid}};
  if (gid) j["gid"] = *gid;
  return j.dump() + "\n";
}

}  // namespace

JobOwners::JobOwners(Filesystem& fs, std::string root, Options options)
    : fs_(fs), root_(std::move(root)), options_(std::move(options)) {}

bool JobOwners::Allowed(const Owner& owner, const PeerIdentity& caller) const {
  return caller.uid == 0 || caller.uid == options_.daemon_uid || caller.uid == owner.uid ||
         (owner.gid && caller.InGroup(*owner.gid));
}

absl::StatusOr<std::optional<JobOwners::Owner>> JobOwners::LoadRemote(const std::string& job) {
  absl::StatusOr<std::string> text = options_.remote->Get(job + "/" + kOwnerFile, 4096);
  if (absl::IsNotFound(text.status())) return std::optional<Owner>();
  if (!text.ok()) {
    // Unavailable: Privileged callers go on (see OwnerOf); everyone else is refused.
    return absl::UnavailableError(fmt::format(
        "job {}: cannot ask the remote tier who owns it ({}); only root or ckptd's own user may "
        "use it until the remote tier answers",
        job, Message(text.status())));
  }
  auto parsed = ParseOwner(*text);
  if (!parsed) {
    return absl::PermissionDeniedError(fmt::format(
        "job {}: its owner record {} is damaged; only root or ckptd's own user may use the job "
        "until an operator fixes it",
        job, options_.remote->Describe(job + "/" + kOwnerFile)));
  }
  return std::optional<Owner>(Owner{parsed->first, parsed->second});
}

absl::StatusOr<std::optional<JobOwners::Owner>> JobOwners::LoadLocked(const std::string& job) {
  if (auto it = owners_.find(job); it != owners_.end()) return std::optional<Owner>(it->second);
  std::string path = root_ + "/" + job + "/" + kOwnerFile;
  if (!fs_.Exists(path)) {
    if (options_.remote == nullptr) return std::optional<Owner>();
    // A node with an empty disk (a replacement, direct mode): the remote tier may hold the
    // job's steps, and then says whose they are.
    CKPT_ASSIGN_OR_RETURN(std::optional<Owner> remote, LoadRemote(job));
    if (remote) {
      owners_[job] = *remote;
      only_remote_.insert(job);
      published_.insert(job);  // the remote tier's record is this job's owner here
    }
    return remote;
  }
  auto refuse = [&](std::string_view why) {
    return absl::PermissionDeniedError(fmt::format(
        "job {}: its owner record {} {}; only root or ckptd's own user may use the job until an "
        "operator fixes it",
        job, path, why));
  };
  auto text = ReadSmallFile(fs_, path);
  if (!text.ok()) return refuse(fmt::format("cannot be read ({})", Message(text.status())));
  auto parsed = ParseOwner(*text);
  if (!parsed) return refuse("is damaged");
  Owner owner{parsed->first, parsed->second};
  CKPT_RETURN_IF_ERROR(ProtectLocked(job, owner));
  owners_[job] = owner;
  return std::optional<Owner>(owner);
}

absl::Status JobOwners::WriteRecord(const std::string& job, const Owner& owner) {
  // Written whole under a temporary name of its own, then renamed: a crash leaves the old
  // state, and two daemons on one shared root claiming the job at once both succeed.
  return WriteFileAtomically(fs_, root_ + "/" + job + "/" + kOwnerFile, OwnerRecord(owner.uid, owner.gid));
}

absl::Status JobOwners::PublishRemote(const std::string& job) {
  if (options_.remote == nullptr) return absl::OkStatus();
  std::lock_guard lock(mu_);
  if (published_.count(job)) return absl::OkStatus();
  CKPT_ASSIGN_OR_RETURN(std::optional<Owner> here, LoadLocked(job));
  if (!here) {
    return absl::PermissionDeniedError(fmt::format(
        "job {} has no owner on record here: its steps are not uploaded (an operator writes its "
        "{} first)", job, kOwnerFile));
  }
  // LoadLocked asked the remote tier already when this node had no record of its own.
  if (published_.count(job)) return absl::OkStatus();
  CKPT_ASSIGN_OR_RETURN(std::optional<Owner> there, LoadRemote(job));
  if (there) {
    if (there->uid != here->uid || there->gid != here->gid) {
      return absl::PermissionDeniedError(fmt::format(
          "job {} in the remote tier belongs to uid {}, here to uid {}: nothing of it is uploaded "
          "over another user's job (rename the job, or an operator resolves it)",
          job, there->uid, here->uid));
    }
    published_.insert(job);
    return absl::OkStatus();
  }
  CKPT_RETURN_IF_ERROR(options_.remote->Put(job + "/" + kOwnerFile, OwnerRecord(here->uid, here->gid)));
  published_.insert(job);
  return absl::OkStatus();
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

absl::StatusOr<std::optional<JobOwners::Owner>> JobOwners::OwnerOf(const std::string& job,
                                                                    const PeerIdentity& caller) {
  absl::StatusOr<std::optional<Owner>> owner = LoadLocked(job);
  if (absl::IsUnavailable(owner.status())) {
    // The remote tier cannot say whose the job is: root and ckptd's user go on as with a
    // job nobody owns on record; anyone else is refused (never a trainer's "unavailable").
    if (caller.uid == 0 || caller.uid == options_.daemon_uid) return std::optional<Owner>();
    return absl::PermissionDeniedError(Message(owner.status()));
  }
  return owner;
}

absl::Status JobOwners::MayClaimLocked(const std::string& job, const PeerIdentity& caller) {
  CKPT_RETURN_IF_ERROR(ValidateJobName(job));
  CKPT_ASSIGN_OR_RETURN(std::optional<Owner> owner, OwnerOf(job, caller));
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
  Owner owner{caller.uid, std::nullopt};
  if (auto it = owners_.find(job); it != owners_.end()) {
    // Known here; or only to the remote tier (a node with an empty disk), and then the
    // local record is written now, for that owner.
    if (!only_remote_.count(job)) return absl::OkStatus();
    owner = it->second;
  } else {
    for (uint32_t gid : options_.job_gids) {
      if (caller.InGroup(gid)) {
        owner.gid = gid;
        break;
      }
    }
  }
  CKPT_RETURN_IF_ERROR(fs_.MakePrivateDir(root_ + "/" + job));
  CKPT_RETURN_IF_ERROR(ProtectLocked(job, owner));
  CKPT_RETURN_IF_ERROR(WriteRecord(job, owner));
  owners_[job] = owner;
  only_remote_.erase(job);
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

std::optional<JobOwners::Owner> JobOwners::LocalOwnerLocked(const std::string& job) {
  if (auto it = owners_.find(job); it != owners_.end()) return it->second;
  absl::StatusOr<std::string> text = ReadSmallFile(fs_, root_ + "/" + job + "/" + kOwnerFile);
  if (!text.ok()) return std::nullopt;
  auto parsed = ParseOwner(*text);
  if (!parsed) return std::nullopt;
  return Owner{parsed->first, parsed->second};
}

bool JobOwners::VisibleTo(const std::string& job, const PeerIdentity& caller) {
  if (!ValidateJobName(job).ok()) return false;
  std::lock_guard lock(mu_);
  std::optional<Owner> owner = LocalOwnerLocked(job);
  return owner && Allowed(*owner, caller);
}

std::optional<uid_t> JobOwners::LocalOwner(const std::string& job) {
  if (!ValidateJobName(job).ok()) return std::nullopt;
  std::lock_guard lock(mu_);
  std::optional<Owner> owner = LocalOwnerLocked(job);
  if (!owner) return std::nullopt;
  return owner->uid;
}

absl::Status JobOwners::Check(const std::string& job, const PeerIdentity& caller,
                              std::string_view what) {
  CKPT_RETURN_IF_ERROR(ValidateJobName(job));
  std::lock_guard lock(mu_);
  CKPT_ASSIGN_OR_RETURN(std::optional<Owner> owner, OwnerOf(job, caller));
  if (!owner) {
    if (caller.uid == 0 || caller.uid == options_.daemon_uid) return absl::OkStatus();
    return absl::PermissionDeniedError(fmt::format(
        "job {} has no owner on record: only root or ckptd's own user may {} it", job, what));
  }
  if (!Allowed(*owner, caller)) return Refuse(job, *owner, caller, what);
  return absl::OkStatus();
}

}  // namespace ckpt::daemon
