// Who, besides this node's own root, may know whose a job is: the remote tier's owner record
// (<job>/.owner in the bucket), or the group's peers (their owner records, the owner uid of
// the fragments they hold). A node whose root does not know a job (a replacement with an
// empty disk) asks them before it lets anyone claim the job's name (job_owners.h).
#pragma once

#include <sys/types.h>

#include <optional>
#include <string>

#include "absl/status/statusor.h"

namespace ckpt::daemon {

struct KnownOwner {
  uid_t uid = 0;
  std::optional<gid_t> gid;  // the --job-group whose members share the job
  std::string where;         // who said so, for messages: "node 1's owner record"
};

class OwnerSource {
 public:
  virtual ~OwnerSource() = default;
  // For messages: "the remote tier s3://b/p", "the group's peers".
  virtual std::string Describe() const = 0;
  // Who owns `job` as this source knows it: nullopt when it knows no owner; an error when it
  // cannot be asked (Unavailable, naming why) or its record is damaged (PermissionDenied).
  // May block for long (a store that stopped answering): JobOwners calls it on a thread of
  // its own, never under a lock (owner_queries.h).
  virtual absl::StatusOr<std::optional<KnownOwner>> Find(const std::string& job) = 0;
  // Ends calls in flight at once (the daemon is stopping); later ones fail.
  virtual void Cancel() {}
};

}  // namespace ckpt::daemon
