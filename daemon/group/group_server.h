// This node's group server. Every node runs one (Ping, so that peers and operators can
// probe it); node 0 also serves the coordinator: membership, the two-phase commit and the
// collectives. Handlers use gRPC's callback API, so a long poll (an outcome, a gather)
// holds no thread while it waits. A ticker thread expires heartbeats, step timeouts and
// gather deadlines.
#pragma once

#include <memory>
#include <string>

#include <grpcpp/impl/service_type.h>

#include "absl/status/statusor.h"
#include "daemon/group/commit_coordinator.h"
#include "daemon/group/decision_log.h"
#include "daemon/group/gather_table.h"
#include "daemon/group/group_options.h"
#include "daemon/group/membership.h"
#include "daemon/group/relay.h"
#include "daemon/group/upload_targets.h"

namespace ckpt::group {

class GroupServer {
 public:
  virtual ~GroupServer() = default;
  // The address it listens on, with the port it was given ("127.0.0.1:40123").
  virtual const std::string& address() const = 0;
  // Coordinator only (null elsewhere): what `ckptctl status` shows.
  virtual const Membership* membership() const = 0;
  virtual CommitCoordinator* coordinator() = 0;
  // Nodes other than 0, with a relay tree (options.relay_fanout): from now on this node
  // relays heartbeats, prepares and outcome polls for the nodes below it, through `upstream` (its own
  // group client), which must outlive Shutdown.
  virtual void StartRelay(RelayUpstream& upstream) = 0;
  // Relayed so far (zero without a relay).
  virtual Relay::Counters relayed() const = 0;
  virtual void Shutdown() = 0;
};

using GroupServerPtr = std::unique_ptr<GroupServer>;

// Binds options.listen_addr (port 0: an ephemeral port). `log`, `publish` and `uploading`
// (what node 0 uploads, handed out with heartbeats) are used by the coordinator role only;
// `log` and `uploading` must outlive the server. `also` (may be null): another service on the
// same port and credentials (the peer replicas' Replicas service), which must outlive it.
absl::StatusOr<GroupServerPtr> StartGroupServer(const GroupOptions& options, uint64_t incarnation,
                                                DecisionLog* log,
                                                CommitCoordinator::Publisher publish = {},
                                                const UploadTargets* uploading = nullptr,
                                                grpc::Service* also = nullptr);

}  // namespace ckpt::group
