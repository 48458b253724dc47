// Arenas handed to ckptd ahead of a registration. A trainer's arenas are sealed memfds with
// no name (shm/arena.h): the only way to give the daemon one is its descriptor, over the
// descriptor socket (SCM_RIGHTS), because gRPC cannot carry descriptors. The descriptor
// server puts each batch here under a fresh random token and the depositor's identity, as
// the kernel gave it; Register names the tokens, and only the same process may take them.
// Unclaimed batches expire, and each user can hold only so many descriptors here.
// A trainer hands over its userfaultfd the same way (copy-on-write snapshots), and a
// snapshot's payload too large for a ring slot (a sealed memfd: shm/layout.h,
// kCommandSnapshotDeposited), each as a batch of its own kind: a token redeems only the
// kind it was given for.
#pragma once

#include <chrono>
#include <cstddef>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "common/unique_fd.h"
#include "daemon/session/peer_identity.h"

namespace ckpt::daemon {

class ArenaDeposits {
 public:
  struct Options {
    std::chrono::milliseconds expire_after{std::chrono::seconds(60)};
    size_t max_fds_per_uid = 4096;
    size_t max_fds = 16384;
  };
  // kArenas: sealed shared memory (shm/sealed_segment.h), up to kMaxPassedFds a batch.
  // kWriteProtect: one userfaultfd (daemon/staging/write_protector.h).
  // kPayload: one sealed memfd holding a snapshot's encoded payload (shm/payload.h).
  enum class Kind { kArenas, kWriteProtect, kPayload };

  ArenaDeposits() : ArenaDeposits(Options{}) {}
  explicit ArenaDeposits(Options options) : options_(options) {}

  // OK when `fds` are what `kind` says; a line naming the first that is not otherwise.
  static absl::Status Check(const std::vector<UniqueFd>& fds, Kind kind);
  // Keeps `fds` for `depositor` once Check passes; returns the token.
  absl::StatusOr<std::string> Put(const PeerIdentity& depositor, std::vector<UniqueFd> fds,
                                  Kind kind = Kind::kArenas);

  // The batch behind `token`, removed from the table, if `caller` is the process that
  // deposited it and it is of `kind`. Another process (another uid, or root) gets
  // PermissionDenied and the batch stays for its owner.
  absl::StatusOr<std::vector<UniqueFd>> Take(const std::string& token, const PeerIdentity& caller,
                                             Kind kind = Kind::kArenas);

  size_t held_fds() const;

 private:
  struct Batch {
    pid_t pid;
    uid_t uid;
    Kind kind;
    std::vector<UniqueFd> fds;
    std::chrono::steady_clock::time_point expires;
  };
  void ExpireLocked(std::chrono::steady_clock::time_point now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  mutable std::mutex mu_;
  std::map<std::string, Batch> batches_ ABSL_GUARDED_BY(mu_);
  std::map<uid_t, size_t> fds_of_uid_ ABSL_GUARDED_BY(mu_);
  size_t fds_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace ckpt::daemon
