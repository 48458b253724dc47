#include "daemon/session/job_owners.h"

#include <fmt/format.h>

#include <chrono>
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
// How long a MayClaim's look outside stands for the Claim that follows it.
constexpr auto kClearedFor = std::chrono::seconds(30);

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
    : fs_(fs), root_(std::move(root)), options_(std::move(options)) {
  if (options_.remote != nullptr) remote_queries_ = std::make_unique<OwnerQueries>();
}

JobOwners::~JobOwners() { Stop(); }

void JobOwners::AskPeers(std::unique_ptr<OwnerSource> peers) {
  std::lock_guard lock(mu_);
  peers_ = std::move(peers);
  peer_queries_ = std::make_unique<OwnerQueries>();
}

void JobOwners::Stop() {
  // A question in flight ends once its calls do: cancelled first, then joined.
  if (options_.remote != nullptr) options_.remote->Cancel();
  OwnerSource* peers = nullptr;
  OwnerQueries* peer_queries = nullptr;
  {
    std::lock_guard lock(mu_);
    peers = peers_.get();
    peer_queries = peer_queries_.get();
  }
  if (peers != nullptr) peers->Cancel();
  if (peer_queries != nullptr) peer_queries->Stop();
  if (remote_queries_) remote_queries_->Stop();
}

bool JobOwners::Allowed(const Owner& owner, const PeerIdentity& caller) const {
  return caller.uid == 0 || caller.uid == options_.daemon_uid || caller.uid == owner.uid ||
         (owner.gid && caller.InGroup(*owner.gid));
}

bool JobOwners::Privileged(const PeerIdentity& caller) const {
  return caller.uid == 0 || caller.uid == options_.daemon_uid;
}

OwnerQueries::Answer JobOwners::FindRemote(const std::string& job) const {
  const std::string key = job + "/" + kOwnerFile;
  absl::StatusOr<std::string> text = options_.remote->Get(key, 4096);
  if (absl::IsNotFound(text.status())) return std::optional<KnownOwner>();
  if (!text.ok()) {
    return absl::UnavailableError(fmt::format("cannot ask the remote tier who owns job {}: {}", job,
                                              Message(text.status())));
  }
  auto parsed = ParseOwner(*text);
  if (!parsed) {
    return absl::PermissionDeniedError(fmt::format(
        "job {}: its owner record {} is damaged; only root or ckptd's own user may use the job "
        "until an operator fixes it",
        job, options_.remote->Describe(key)));
  }
  return std::optional<KnownOwner>(KnownOwner{parsed->first, parsed->second,
                                              "the remote tier's owner record " + options_.remote->Describe(key)});
}

OwnerQueries::Answer JobOwners::PublishTo(const std::string& job, const Owner& here) const {
  OwnerQueries::Answer there = FindRemote(job);
  if (!there.ok() || there->has_value()) return there;
  const std::string key = job + "/" + kOwnerFile;
  if (absl::Status put = options_.remote->Put(key, OwnerRecord(here.uid, here.gid)); !put.ok()) {
    return absl::UnavailableError(fmt::format("cannot write job {}'s owner record to the remote tier: {}", job,
                                              Message(put)));
  }
  return std::optional<KnownOwner>(KnownOwner{here.uid, here.gid, "this node's record, now in the remote tier"});
}

JobOwners::Outside JobOwners::AskOutside(const std::string& job, std::chrono::steady_clock::time_point deadline) {
  Outside out;
  OwnerSource* peers = nullptr;
  OwnerQueries* peer_queries = nullptr;
  {
    std::lock_guard lock(mu_);
    peers = peers_.get();
    peer_queries = peer_queries_.get();
  }
  auto wait_s = [](std::chrono::steady_clock::duration d) {
    return std::chrono::duration_cast<std::chrono::seconds>(d).count();
  };
  // Both asked at once: the slower one costs its own time only.
  auto find_remote = [this, job] { return FindRemote(job); };
  if (remote_queries_) remote_queries_->Start("find/" + job, find_remote);
  if (peer_queries != nullptr) {
    OwnerQueries::Outcome asked = peer_queries->Ask(job, [peers, job] { return peers->Find(job); }, deadline);
    if (!asked.answer) {
      out.peers_unknown = fmt::format("{} have not answered in {} s", peers->Describe(), wait_s(asked.waited));
    } else if (absl::IsCancelled(asked.answer->status())) {
      out.refused = asked.answer->status();
      return out;
    } else if (!asked.answer->ok()) {
      out.peers_unknown = Message(asked.answer->status());
    } else if (asked.answer->value()) {
      const KnownOwner& known = ***asked.answer;
      out.owner = Owner{known.uid, known.gid};
      out.where = known.where;
      return out;
    }
  }
  if (remote_queries_) {
    OwnerQueries::Outcome asked = remote_queries_->Ask("find/" + job, find_remote, deadline);
    if (!asked.answer) {
      out.remote_unknown = fmt::format("GET {} has had no answer for {} s",
                                       options_.remote->Describe(job + "/" + kOwnerFile), wait_s(asked.waited));
    } else if (absl::IsPermissionDenied(asked.answer->status()) || absl::IsCancelled(asked.answer->status())) {
      out.refused = asked.answer->status();
    } else if (!asked.answer->ok()) {
      out.remote_unknown = Message(asked.answer->status());
    } else if (asked.answer->value()) {
      const KnownOwner& known = ***asked.answer;
      out.owner = Owner{known.uid, known.gid};
      out.where = known.where;
      out.from_remote = true;
    }
  }
  return out;
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
  Owner here;
  {
    std::lock_guard lock(mu_);
    if (published_.count(job)) return absl::OkStatus();
    CKPT_ASSIGN_OR_RETURN(std::optional<Owner> recorded, LoadLocked(job));
    if (!recorded) {
      return absl::PermissionDeniedError(fmt::format(
          "job {} has no owner on record here: its steps are not uploaded (an operator writes its "
          "{} first)", job, kOwnerFile));
    }
    here = *recorded;
  }
  // The request runs on the remote queries' thread: an upload that waits on a remote tier
  // that stopped answering says so after publish_wait, and asks again later.
  OwnerQueries::Outcome asked = remote_queries_->Ask(
      "publish/" + job, [this, job, here] { return PublishTo(job, here); },
      std::chrono::steady_clock::now() + options_.publish_wait);
  if (!asked.answer) {
    return absl::DeadlineExceededError(fmt::format(
        "waiting for the remote tier to say who owns job {}: GET {} has had no answer for {} s (the "
        "job's steps go up once it answers)",
        job, options_.remote->Describe(job + "/" + kOwnerFile),
        std::chrono::duration_cast<std::chrono::seconds>(asked.waited).count()));
  }
  CKPT_ASSIGN_OR_RETURN(std::optional<KnownOwner> there, *std::move(asked.answer));
  if (!there || there->uid != here.uid || there->gid != here.gid) {
    return absl::PermissionDeniedError(fmt::format(
        "job {} in the remote tier belongs to uid {}, here to uid {}: nothing of it is uploaded "
        "over another user's job (rename the job, or an operator resolves it)",
        job, there ? there->uid : 0, here.uid));
  }
  std::lock_guard lock(mu_);
  published_.insert(job);
  return absl::OkStatus();
}

absl::Status JobOwners::CheckRemote(const std::string& job, const PeerIdentity& caller) {
  if (options_.remote == nullptr || Privileged(caller)) return absl::OkStatus();
  Owner here;
  {
    std::lock_guard lock(mu_);
    if (published_.count(job)) return absl::OkStatus();
    CKPT_ASSIGN_OR_RETURN(std::optional<Owner> recorded, LoadLocked(job));
    if (!recorded) return absl::OkStatus();  // no session of a job without a record
    here = *recorded;
  }
  OwnerQueries::Outcome asked = remote_queries_->Ask(
      "find/" + job, [this, job] { return FindRemote(job); },
      std::chrono::steady_clock::now() + options_.ask_wait);
  if (!asked.answer || absl::IsUnavailable(asked.answer->status()) || absl::IsCancelled(asked.answer->status())) {
    // A remote tier that cannot say whose the job is cannot serve its steps either.
    return absl::OkStatus();
  }
  CKPT_ASSIGN_OR_RETURN(std::optional<KnownOwner> there, *std::move(asked.answer));
  if (!there) return absl::OkStatus();
  if (there->uid != here.uid || there->gid != here.gid) {
    return absl::PermissionDeniedError(fmt::format(
        "job {} belongs to uid {} in the remote tier ({}), here to uid {}: {} may not restore it here "
        "(the name was taken on this node while the remote tier could not be asked; rename the job, or an "
        "operator resolves it)",
        job, there->uid, there->where, here.uid, caller.Describe()));
  }
  std::lock_guard lock(mu_);
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

absl::Status JobOwners::RefuseLocked(const std::string& job, const Owner& owner, const PeerIdentity& caller,
                                     std::string_view what) const {
  absl::Status refused = Refuse(job, owner, caller, what);
  auto learned = learned_.find(job);
  if (learned == learned_.end()) return refused;
  return absl::PermissionDeniedError(fmt::format(
      "{} ({} says so: this node has no record of the job, and its checkpoints elsewhere are its owner's to "
      "recover)",
      Message(refused), learned->second));
}

absl::Status JobOwners::MayCreateLocked(const std::string& job, const PeerIdentity& caller) {
  if (Privileged(caller)) return absl::OkStatus();
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

bool JobOwners::ClearedLocked(const std::string& job, const PeerIdentity& caller) const {
  auto it = cleared_.find(job);
  return it != cleared_.end() && it->second.first == caller.uid &&
         std::chrono::steady_clock::now() - it->second.second < kClearedFor;
}

absl::Status JobOwners::MayClaimOutside(const std::string& job, const PeerIdentity& caller) {
  Outside outside = AskOutside(job, std::chrono::steady_clock::now() + options_.ask_wait);
  std::lock_guard lock(mu_);
  // A record made meanwhile (another registration of the job) decides.
  CKPT_ASSIGN_OR_RETURN(std::optional<Owner> here, LoadLocked(job));
  if (here) return Allowed(*here, caller) ? absl::OkStatus() : RefuseLocked(job, *here, caller, "register ranks into");
  CKPT_RETURN_IF_ERROR(outside.refused);
  auto& log = log::Get(log::Component::kSession);
  if (outside.owner) {
    owners_[job] = *outside.owner;
    learned_[job] = outside.where;
    if (outside.from_remote) published_.insert(job);  // the remote tier's record is this job's owner here
    log.info("job {}: this node has no record of it; {} says it belongs to uid {}", job, outside.where,
             outside.owner->uid);
    if (Allowed(*outside.owner, caller)) return absl::OkStatus();
    return RefuseLocked(job, *outside.owner, caller, "register ranks into");
  }
  if (!outside.peers_unknown.empty() && !Privileged(caller)) {
    return absl::PermissionDeniedError(fmt::format(
        "job {}: this node has no record of it, and its group's peers could not say who owns it ({}); only "
        "root or ckptd's own user may register it until they answer (try again)",
        job, outside.peers_unknown));
  }
  if (!outside.remote_unknown.empty() && options_.remote_only && !Privileged(caller)) {
    return absl::PermissionDeniedError(fmt::format(
        "job {}: cannot ask the remote tier who owns it ({}); only root or ckptd's own user may use it until "
        "the remote tier answers",
        job, outside.remote_unknown));
  }
  CKPT_RETURN_IF_ERROR(MayCreateLocked(job, caller));
  if (!outside.remote_unknown.empty() && told_unknown_.insert(job).second) {
    log.warn("job {}: registered by {} although the remote tier cannot say who owns it ({}): its steps "
             "commit locally, and its uploads wait for the remote tier's answer",
             job, caller.Describe(), outside.remote_unknown);
  }
  const auto now = std::chrono::steady_clock::now();
  for (auto it = cleared_.begin(); it != cleared_.end();) {
    it = now - it->second.second >= kClearedFor ? cleared_.erase(it) : std::next(it);
  }
  cleared_[job] = {caller.uid, now};
  return absl::OkStatus();
}

absl::Status JobOwners::MayClaim(const std::string& job, const PeerIdentity& caller) {
  CKPT_RETURN_IF_ERROR(ValidateJobName(job));
  {
    std::lock_guard lock(mu_);
    CKPT_ASSIGN_OR_RETURN(std::optional<Owner> here, LoadLocked(job));
    if (here) return Allowed(*here, caller) ? absl::OkStatus() : RefuseLocked(job, *here, caller, "register ranks into");
    if (!AsksOutsideLocked()) return MayCreateLocked(job, caller);
  }
  return MayClaimOutside(job, caller);
}

absl::Status JobOwners::Claim(const std::string& job, const PeerIdentity& caller) {
  CKPT_RETURN_IF_ERROR(ValidateJobName(job));
  bool ask = false;
  {
    std::lock_guard lock(mu_);
    CKPT_ASSIGN_OR_RETURN(std::optional<Owner> here, LoadLocked(job));
    ask = !here && AsksOutsideLocked() && !ClearedLocked(job, caller);
  }
  // Not asked by a MayClaim a moment ago: asked now, off the lock.
  if (ask) CKPT_RETURN_IF_ERROR(MayClaimOutside(job, caller));
  std::lock_guard lock(mu_);
  CKPT_ASSIGN_OR_RETURN(std::optional<Owner> here, LoadLocked(job));
  Owner owner{caller.uid, std::nullopt};
  if (here) {
    if (!Allowed(*here, caller)) return RefuseLocked(job, *here, caller, "register ranks into");
    // Known here; or only to the peers or the remote tier (a node with an empty disk), and
    // then the local record is written now, for that owner.
    if (!learned_.count(job)) return absl::OkStatus();
    owner = *here;
  } else {
    CKPT_RETURN_IF_ERROR(MayCreateLocked(job, caller));
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
  learned_.erase(job);
  cleared_.erase(job);
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
  {
    std::lock_guard lock(mu_);
    CKPT_ASSIGN_OR_RETURN(std::optional<Owner> here, LoadLocked(job));
    if (here) return Allowed(*here, caller) ? absl::OkStatus() : Refuse(job, *here, caller, what);
    // Root and ckptd's uid may whoever owns it: nobody is asked.
    if (Privileged(caller)) return absl::OkStatus();
    if (!AsksOutsideLocked()) {
      return absl::PermissionDeniedError(fmt::format(
          "job {} has no owner on record: only root or ckptd's own user may {} it", job, what));
    }
  }
  Outside outside = AskOutside(job, std::chrono::steady_clock::now() + options_.ask_wait);
  CKPT_RETURN_IF_ERROR(outside.refused);
  if (outside.owner) {
    if (!Allowed(*outside.owner, caller)) return Refuse(job, *outside.owner, caller, what);
    return absl::OkStatus();
  }
  const std::string& unknown = !outside.peers_unknown.empty() ? outside.peers_unknown : outside.remote_unknown;
  if (!unknown.empty()) {
    return absl::PermissionDeniedError(fmt::format(
        "job {}: this node has no record of it, and who owns it cannot be asked ({}): only root or ckptd's "
        "own user may {} it until that answers",
        job, unknown, what));
  }
  return absl::PermissionDeniedError(fmt::format(
      "job {} has no owner on record: only root or ckptd's own user may {} it", job, what));
}

std::optional<KnownOwner> JobOwners::Recorded(const std::string& job) {
  if (!ValidateJobName(job).ok()) return std::nullopt;
  std::lock_guard lock(mu_);
  std::optional<Owner> owner = LocalOwnerLocked(job);
  if (!owner) return std::nullopt;
  return KnownOwner{owner->uid, owner->gid, "owner record"};
}

}  // namespace ckpt::daemon
