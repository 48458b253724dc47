// Jobs belong to someone. The uid that registers the first rank of a job owns it (recorded
// in <root>/<job>/.owner, so a restart keeps it); afterwards only the owner, root, the
// daemon's own uid, and members of the job's group (one of --job-group that the creator was
// in) may register ranks into it, change its retention, restore it or delete its steps.
// Its directory is readable by the same people and nobody else (storage/private_dir.h).
//
// A node whose root does not know a job (a replacement with an empty disk) asks who owns it
// before anyone claims the name: its group's peers (--replication: their owner records, the
// owner uid of the fragments they hold) and the remote tier (--remote: <job>/.owner there),
// all at once, on threads of their own (owner_queries.h), waiting a few seconds at most and
// never under the lock registrations and admin calls take:
// - an owner named decides: another uid is refused, the message naming the owner and who
//   said so; the owner's record is written here when it registers;
// - peers that cannot be asked in time refuse the name to all but root and ckptd's uid (the
//   group's steps cannot commit without them either);
// - a remote tier that cannot be asked in time (hung, wrong credentials) leaves a new name to
//   its first comer here, whose steps commit locally; the job's uploads wait for the remote
//   tier's answer (PublishRemote), and its restores ask it again (CheckRemote). With
//   --remote-mode direct, where every step is written there, the name is refused instead.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "storage/filesystem.h"
#include "storage/store.h"
#include "daemon/session/owner_queries.h"
#include "daemon/session/owner_source.h"
#include "daemon/session/peer_identity.h"

namespace ckpt::daemon {

class JobOwners {
 public:
  struct Options {
    uid_t daemon_uid = 0;
    std::vector<uint32_t> job_gids;  // --job-group: members share the jobs they create
    // --remote: owner records are kept in the remote tier too (<job>/.owner), so that a
    // node with an empty disk knows whose job it is before it restores it from there.
    storage::StorePtr remote;
    // --remote-mode direct: the remote tier is the only one, so a job it cannot be asked
    // about is refused (root excepted): fail closed.
    bool remote_only = false;
    // How long a registration, an admin call or a restore waits for the peers' or the remote
    // tier's answer about a job this node has no record of.
    std::chrono::milliseconds ask_wait{5000};
    // How long an upload waits for the remote tier's owner record before it says what it
    // waits on (and tries again).
    std::chrono::milliseconds publish_wait{2000};
  };

  JobOwners(Filesystem& fs, std::string root, Options options);
  ~JobOwners();  // Stop()
  JobOwners(const JobOwners&) = delete;
  JobOwners& operator=(const JobOwners&) = delete;

  // --replication: the group's peers are asked about jobs this node has no record of (before
  // the remote tier). Called once, before trainers are served.
  void AskPeers(std::unique_ptr<OwnerSource> peers);
  // Ends the questions in flight (the remote tier's and the peers' calls are cancelled) and
  // asks no more: before the stores go.
  void Stop();

  // May the caller register a rank of `job`? Yes for the owner (and the job's group, root,
  // the daemon's uid), and for anyone when the job is new. A job that already has steps
  // but no owner on record (made by an older ckptd), or whose record cannot be read, is
  // open to root and the daemon's uid only: ownership fails closed. A job this node has no
  // record of is asked about first (peers, remote tier: see above), waiting Options::ask_wait
  // at most, never under a lock. Writes nothing.
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
  // that name belongs to someone else (nothing of this job may be uploaded over it);
  // DeadlineExceeded, naming the request and how long it has waited, while the remote tier
  // has not answered within Options::publish_wait (the request goes on: ask again);
  // Unavailable naming why the remote tier could not be asked.
  absl::Status PublishRemote(const std::string& job);

  // Before `caller` restores `job` (whose steps the remote tier may hold): PermissionDenied
  // when the remote tier's job of that name belongs to another uid than this node's record
  // says (a name taken here while the remote tier could not be asked). Waits for it
  // Options::ask_wait at most; a remote tier that cannot say cannot serve the restore either,
  // and the restore goes on. Root and ckptd's uid always may.
  absl::Status CheckRemote(const std::string& job, const PeerIdentity& caller);

  // This node's own record of `job` (memory, or its root), for a peer that asks whose it is;
  // nullopt when it has none.
  std::optional<KnownOwner> Recorded(const std::string& job);

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

  // What the peers and the remote tier said of a job this node has no record of.
  struct Outside {
    std::optional<Owner> owner;
    std::string where;          // who named the owner
    bool from_remote = false;   // the remote tier's record named it
    absl::Status refused;       // a damaged record, or ckptd stopping: refused to all
    std::string peers_unknown;  // why the peers could not say (empty: they could)
    std::string remote_unknown; // why the remote tier could not say (empty: it could)
  };

  bool Allowed(const Owner& owner, const PeerIdentity& caller) const;
  bool Privileged(const PeerIdentity& caller) const;
  // LocalOwner's record, whole.
  std::optional<Owner> LocalOwnerLocked(const std::string& job);
  // The owner from memory or from the job's .owner file; nullopt when there is none; an
  // error when the record exists but cannot be read. This node alone: no request.
  absl::StatusOr<std::optional<Owner>> LoadLocked(const std::string& job);
  // Whether anyone besides this node's root is asked about jobs.
  bool AsksOutsideLocked() const { return peers_ != nullptr || options_.remote != nullptr; }
  // The peers and the remote tier asked about `job` at once, waiting until `deadline`; off
  // the lock.
  Outside AskOutside(const std::string& job, std::chrono::steady_clock::time_point deadline);
  // The remote tier's record of `job` (on the remote queries' thread).
  OwnerQueries::Answer FindRemote(const std::string& job) const;
  // The remote tier's record of `job`, written for `here` first when it has none.
  OwnerQueries::Answer PublishTo(const std::string& job, const Owner& here) const;
  // May `caller` claim `job`, which this node has no record of? Asks outside; remembers an
  // owner it names.
  absl::Status MayClaimOutside(const std::string& job, const PeerIdentity& caller);
  // A job nobody owns on record: new, anyone's to create, unless its directory already
  // holds checkpoints (made by an older ckptd).
  absl::Status MayCreateLocked(const std::string& job, const PeerIdentity& caller);
  // MayClaimOutside found nothing against `caller` claiming `job` a moment ago.
  bool ClearedLocked(const std::string& job, const PeerIdentity& caller) const;
  // Makes the job's directory readable by `owner` alone (once per job and daemon run: jobs
  // made by an older ckptd, whose directories were open to ckptd's group, are closed the
  // first time they are used).
  absl::Status ProtectLocked(const std::string& job, const Owner& owner);
  // Writes <root>/<job>/.owner, the record LoadLocked reads.
  absl::Status WriteRecord(const std::string& job, const Owner& owner);
  absl::Status Refuse(const std::string& job, const Owner& owner, const PeerIdentity& caller,
                      std::string_view what) const;
  // Refuse, saying who named the owner when this node learned it from its peers or the
  // remote tier.
  absl::Status RefuseLocked(const std::string& job, const Owner& owner, const PeerIdentity& caller,
                            std::string_view what) const;

  Filesystem& fs_;
  const std::string root_;
  const Options options_;
  std::mutex mu_;  // never held across a request to a peer or a store
  std::map<std::string, Owner> owners_;
  std::set<std::string> protected_;  // jobs whose directory ProtectLocked has closed
  std::set<std::string> published_;  // jobs whose record the remote tier holds
  // Owners the peers or the remote tier named, not yet on disk: who named each.
  std::map<std::string, std::string> learned_;
  // Jobs MayClaimOutside let a uid create, and when: its Claim does not ask again.
  std::map<std::string, std::pair<uid_t, std::chrono::steady_clock::time_point>> cleared_;
  std::set<std::string> told_unknown_;  // jobs whose unanswered remote tier has been logged
  std::unique_ptr<OwnerSource> peers_;  // set once, before trainers are served
  // Questions to the remote tier and to the peers, each on a thread of its own.
  std::unique_ptr<OwnerQueries> remote_queries_;
  std::unique_ptr<OwnerQueries> peer_queries_;
};

}  // namespace ckpt::daemon
