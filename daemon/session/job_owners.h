// Jobs belong to someone. The uid that registers the first rank of a job owns it (recorded
// in <root>/<job>/.owner, so a restart keeps it); afterwards only the owner, root, the
// daemon's own uid, and members of the job's group (one of --job-group that the creator was
// in) may register ranks into it, change its retention, restore it or delete its steps.
// Its directory is readable by the same people and nobody else (storage/private_dir.h).
#pragma once

#include <sys/types.h>

#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "storage/filesystem.h"
#include "storage/store.h"
#include "daemon/session/peer_identity.h"

namespace ckpt::daemon {

class JobOwners {
 public:
  struct Options {
    uid_t daemon_uid = 0;
    std::vector<uint32_t> job_gids;  // --job-group: members share the jobs they create
    // --remote: owner records are kept in the remote tier too (<job>/.owner), so that a
    // node with an empty disk knows whose job it is before it restores it from there.
    // A job the remote tier cannot be asked about is refused (root excepted): fail closed.
    storage::Store* remote = nullptr;
  };

  JobOwners(Filesystem& fs, std::string root, Options options);

  // May the caller register a rank of `job`? Yes for the owner (and the job's group, root,
  // the daemon's uid), and for anyone when the job is new. A job that already has steps
  // but no owner on record (made by an older ckptd), or whose record cannot be read, is
  // open to root and the daemon's uid only: ownership fails closed. Writes nothing.
  absl::Status MayClaim(const std::string& job, const PeerIdentity& caller);
  // MayClaim, and a new job becomes the caller's (recorded on disk). Called once the
  // registration has succeeded, so a refused one leaves nothing behind.
  absl::Status Claim(const std::string& job, const PeerIdentity& caller);

  // At start-up: closes every job directory under the root to all but its owner (jobs made
  // by an older ckptd, open to ckptd's group, that nobody uses again would otherwise stay
  // open); a job without an owner record is made ckptd's alone. Returns how many it closed;
  // problems are logged, never fatal.
  int CloseAll();

  // The directory of `job` was deleted under ckptd and had to be made again: writes its
  // owner record back and closes it to all but its owner, as it was (a job nobody owns on
  // record stays ckptd's alone). Logged: an operator should know.
  void Restore(const std::string& job);

  // Before a job's steps go to the remote tier: its owner record goes there first, or is
  // already there and names the same owner. PermissionDenied when the remote tier's job of
  // that name belongs to someone else (nothing of this job may be uploaded over it).
  absl::Status PublishRemote(const std::string& job);

  // May `caller` `what` (e.g. "delete steps of") `job`? A job without an owner record (made
  // by an older ckptd, or never registered) is open to root and the daemon's uid only.
  absl::Status Check(const std::string& job, const PeerIdentity& caller, std::string_view what);

  // Whether `caller` may see that `job` exists (a misspelt job name's neighbours): from what
  // this node knows alone, its memory and the job's local owner record, never the remote
  // tier (a lookup must cost no request, under a lock every registration takes). A job
  // without a readable record is visible to nobody.
  bool VisibleTo(const std::string& job, const PeerIdentity& caller);

  // The uid that owns `job` as this node knows it (memory, or its local owner record; never
  // the remote tier); nullopt when it has none or the record cannot be read.
  std::optional<uid_t> LocalOwner(const std::string& job);

 private:
  struct Owner {
    uid_t uid = 0;
    std::optional<gid_t> gid;  // the --job-group whose members share the job
  };

  bool Allowed(const Owner& owner, const PeerIdentity& caller) const;
  // LocalOwner's record, whole.
  std::optional<Owner> LocalOwnerLocked(const std::string& job);
  // The owner from memory or from the job's .owner file; nullopt when there is none; an
  // error when the record exists but cannot be read.
  absl::StatusOr<std::optional<Owner>> LoadLocked(const std::string& job);
  absl::Status MayClaimLocked(const std::string& job, const PeerIdentity& caller);
  // LoadLocked for `caller`: a remote tier that cannot be asked refuses all but root and
  // ckptd's uid, for whom the job is then one nobody owns on record.
  absl::StatusOr<std::optional<Owner>> OwnerOf(const std::string& job, const PeerIdentity& caller);
  // Makes the job's directory readable by `owner` alone (once per job and daemon run: jobs
  // made by an older ckptd, whose directories were open to ckptd's group, are closed the
  // first time they are used).
  absl::Status ProtectLocked(const std::string& job, const Owner& owner);
  // Writes <root>/<job>/.owner, the record LoadLocked reads.
  absl::Status WriteRecord(const std::string& job, const Owner& owner);
  // The remote tier's record of `job`: nullopt when it has none.
  absl::StatusOr<std::optional<Owner>> LoadRemote(const std::string& job);
  absl::Status Refuse(const std::string& job, const Owner& owner, const PeerIdentity& caller,
                      std::string_view what) const;

  Filesystem& fs_;
  const std::string root_;
  const Options options_;
  std::mutex mu_;
  std::map<std::string, Owner> owners_;
  std::set<std::string> protected_;  // jobs whose directory ProtectLocked has closed
  std::set<std::string> published_;  // jobs whose record the remote tier holds
  std::set<std::string> only_remote_;  // jobs whose owner only the remote tier recorded
};

}  // namespace ckpt::daemon
