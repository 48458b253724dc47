#include "daemon/server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <unistd.h>

#include "common/fd_passing.h"
#include "storage/filesystem.h"
#include "common/log.h"
#include "storage/secret.h"
#include "common/status.h"
#include "cuda/copy_engine.h"
#include "cuda/copy_priority.h"
#include "cuda/cuda_copy_engine.h"
#include "cuda/ipc_memory_cache.h"
#include "cuda/device.h"
#include "cuda/driver_api.h"
#include "cuda/staging_pool.h"
#include "daemon/commit/group_committer.h"
#include "daemon/commit/single_node_committer.h"
#include "daemon/control/admin_service.h"
#include "daemon/control/health_reporter.h"
#include "daemon/control/node_figures.h"
#include "daemon/control/status_board.h"
#include "daemon/metrics/daemon_metrics.h"
#include "daemon/metrics/http_exporter.h"
#include "daemon/metrics/last_commits.h"
#include "daemon/control/trainer_service.h"
#include "daemon/control/unix_listener.h"
#include "daemon/group/decision_log.h"
#include "daemon/group/group_client.h"
#include "daemon/group/group_member.h"
#include "daemon/group/group_server.h"
#include "daemon/group/relay_tree.h"
#include "format/checkpoint_store.h"
#include "daemon/persist/increment_bases.h"
#include "daemon/persist/increment_writer.h"
#include "daemon/persist/retention_keeper.h"
#include "daemon/persist/shard_writer.h"
#include "storage/local_store.h"
#include "storage/open_store.h"
#include "daemon/upload/uploader.h"
#include "daemon/persist/disk_quota.h"
#include "daemon/persist/write_queue.h"
#include "daemon/restore/snapshot_manifest.h"
#include "daemon/restore/step_agreement.h"
#include "daemon/schedule/save_clock.h"
#include "daemon/control/control_fd_server.h"
#include "daemon/replicate/fetch_channel.h"
#include "daemon/replicate/fragment_store.h"
#include "daemon/replicate/peer_directory.h"
#include "daemon/replicate/peer_owners.h"
#include "daemon/replicate/peer_shards.h"
#include "daemon/replicate/replica_service.h"
#include "daemon/replicate/replicator.h"
#include "daemon/group/committed_step.h"
#include "format/checksum.h"
#include "daemon/read_fault_filesystem.h"
#include "daemon/restorer.h"
#include "daemon/root_lock.h"
#include "daemon/root_probe.h"
#include "daemon/session/arena_budget.h"
#include "daemon/session/arena_deposits.h"
#include "daemon/session/session_registry.h"
#include "proto/health.grpc.pb.h"
#include "daemon/staging/hot_cache.h"
#include "daemon/staging/progress_signal.h"
#include "daemon/staging/stager.h"

#include <fmt/format.h>

#include <cstdlib>
#include <random>
#include <set>
#include <thread>

namespace ckpt::daemon {

// The tiered mode's look at the remote tier at start, off the start path: a gateway that
// stopped answering takes each request's stall timeout and retries (minutes), and the node's
// trainers must not wait that long to connect. Gone: the look ends (Cancel) and is joined.
class RemoteCheck {
 public:
  RemoteCheck(storage::StorePtr store, std::function<void(const absl::Status&)> on_error)
      : store_(std::move(store)), thread_([this, on_error = std::move(on_error)] {
          absl::Status listed = store_->List("").status();
          if (!listed.ok() && !absl::IsCancelled(listed)) on_error(listed);
        }) {}
  ~RemoteCheck() {
    store_->Cancel();
    thread_.join();
  }

 private:
  storage::StorePtr store_;
  std::thread thread_;  // last: started once store_ is there
};

// Test-only fault (CKPTD_FAULT=wedge-sessions-while:FILE; tests/integration/
// systemd_unit_test.cc): while FILE exists the session registry's lock is held, as by a
// thread deadlocked while holding it, so that a test sees the watchdog withhold its pings
// from a daemon whose process lives but whose data path is wedged.
class WedgeFault {
 public:
  WedgeFault(SessionRegistry& sessions, std::string file)
      : file_(std::move(file)), thread_([this, &sessions] {
          auto wedged = [this] { return !stop_ && ::access(file_.c_str(), F_OK) == 0; };
          while (!stop_) {
            if (wedged()) {
              log::Get(log::Component::kMain).warn("CKPTD_FAULT: {} exists: the sessions are wedged until it goes", file_);
              sessions.HoldLockWhile(wedged);
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
          }
        }) {}
  ~WedgeFault() {
    stop_ = true;
    thread_.join();
  }

 private:
  const std::string file_;
  std::atomic<bool> stop_{false};
  std::thread thread_;  // last: started once the members above exist
};

constexpr int kUnixServerThreads = 2 * TrainerService::kMaxLongCalls;
constexpr size_t kUnixServerMemoryBytes = size_t{2} << 30;  // 32 messages of the 64 MiB maximum

// Declared in dependency order: destroyed in reverse (the root's lock last of all, the
// ledger after every snapshot that holds a share).
struct Server::Parts {
  Config config;
  std::unique_ptr<RootLock> root_lock;
  StatusBoard board;
  FilesystemPtr fs;
  std::unique_ptr<format::CheckpointStore> store;
  // Every node of the group writes into `store` (--shared-root, or --remote-mode direct):
  // the coordinator publishes each step and owns its retention.
  bool shared_store = false;
  // Whose each job is; outlives every stage that asks (the uploader's thread included).
  std::unique_ptr<JobOwners> owners;
  // --user-quota-bytes, --job-quota-bytes: after `owners` (it asks them whose a job is), and
  // before every stage that writes or removes through `store` (whose hook tells it).
  std::unique_ptr<persist::DiskQuota> quota;
  // --remote: the remote tier (tiered mode; in direct mode `store` is on it instead).
  std::unique_ptr<format::CheckpointStore> remote;
  cuda::StagingPoolPtr pool;
  std::unique_ptr<StagingLedger> ledger;  // fair shares of staging memory between jobs
  cuda::CopyEnginePtr engine;
  std::vector<cuda::CopyEnginePtr> device_engines;  // one per GPU; empty without one
  std::unique_ptr<cuda::IpcMemoryCache> gpu_memory;
  cuda::CopyPriority copy_priority;
  persist::ShardWriterPtr writer;
  ProgressSignal progress;
  std::unique_ptr<HotCache> hot;
  std::unique_ptr<persist::RetentionKeeper> retention;
  // --increments on: each rank's base (set by commits) and the writer of version 5 shards,
  // which pins bases in `retention`.
  std::unique_ptr<persist::IncrementBases> increment_bases;
  std::unique_ptr<persist::IncrementWriter> increment_writer;
  std::unique_ptr<persist::RetentionKeeper> remote_retention;  // the publisher's
  // Each job's upload policy (its trainers' own, or the node's); set by the trainer service.
  std::shared_ptr<upload::UploadPolicies> upload_policies;
  // In a group with node-local disks and a remote tier: the step of each job node 0 uploads,
  // as node 0 announces it and as the others hear it with heartbeats (upload_targets.h).
  group::UploadTargets announced_uploads;
  group::UploadTargets heard_uploads;
  std::unique_ptr<upload::Uploader> uploader;
  group::GroupOptions group_options;
  group::DecisionLogPtr decision_log;
  // --replication: what this node holds of its peers' shards, and the service on the group
  // server that fills and serves it (so declared before the group server, gone after it).
  std::unique_ptr<replicate::FragmentStore> fragments;
  std::unique_ptr<replicate::ReplicaService> replica_service;
  std::unique_ptr<replicate::FetchServer> fetch_server;  // the restores' TCP channel (no TLS)
  // The client before the server: the server's relay forwards through the client, so the
  // client must be destroyed after it, whatever path (a failed start too) destroys them.
  group::GroupClientPtr group_client;
  group::GroupServerPtr group_server;
  // --replication: the coding group as the group's view has it, this node's shards sent to
  // it (told by the committer's hooks, so destroyed after the committer), and the restore's
  // way back.
  std::unique_ptr<replicate::PeerDirectory> peer_directory;
  std::unique_ptr<replicate::Replicator> replicator;
  std::unique_ptr<replicate::PeerShards> peer_shards;
  std::unique_ptr<commit::Committer> committer;
  std::unique_ptr<persist::WriteQueue> writes;
  std::unique_ptr<group::GroupMember> group_member;
  StepAgreementPtr agreement;
  SaveClockPtr save_clock;  // which steps jobs that save by time save at
  std::unique_ptr<Stager> stager;
  std::unique_ptr<Restorer> restorer;
  // Before `sessions`, so destroyed after them: a session that ends as the registry's ticker
  // stops gives its arenas back (TSan saw the budget freed first, at shutdown).
  std::unique_ptr<ArenaBudget> arena_budget;  // what mapped arenas may cost, per user
  SessionRegistry sessions;
  ArenaDeposits arenas;  // trainers' arenas handed over before they register
  std::unique_ptr<TrainerService> trainer_service;
  PeerTable peers;  // who is at the other end of each accepted socket connection
  std::unique_ptr<AdminService> admin_service;
  std::unique_ptr<AdminService> tcp_admin_service;  // --admin-addr
  std::unique_ptr<grpc::Server> grpc_server;
  std::unique_ptr<grpc::Server> tcp_admin_server;  // --admin-addr: the admin service only
  std::unique_ptr<HealthReporter> health;  // what both servers' health services answer
  std::unique_ptr<ControlFdServer> control_fds;  // hands trainers their control blocks
  std::unique_ptr<UnixListener> listener;
  std::unique_ptr<RemoteCheck> remote_check;  // writes to `board`: gone before it
  metrics::LastCommits last_commits;  // each job's last commit, for the per-job gauges
  // --metrics-addr: reads every part above at each scrape, so it goes first.
  std::unique_ptr<metrics::HttpExporter> metrics_http;
  // Test-only fault (CKPTD_FAULT=wedge-sessions-while:FILE): holds `sessions` wedged.
  std::unique_ptr<WedgeFault> wedge;
  // systemd's WatchdogSec=: its probes ask the parts above.
  std::unique_ptr<Watchdog> watchdog;
  bool shut_down = false;

  // A start that failed half way has no Shutdown: what runs threads that read other parts
  // (peers' calls into the fragment store read `sessions`; the replicator reads the group's
  // view) stops before any part is destroyed.
  ~Parts() {
    watchdog.reset();
    wedge.reset();
    metrics_http.reset();
    // Their questions use the stores and the peers' directory (the remote tier cancelled first).
    if (owners) owners->Stop();
    if (admin_service) admin_service->Stop();
    if (tcp_admin_service) tcp_admin_service->Stop();
    if (replicator) replicator->Stop();
    if (group_server) group_server->Shutdown();
  }
};

namespace {

// Test-only fault: the coordinator exits right after recording a commit decision, before
// anyone hears it (tests/integration/group_test.cc kills it "between decision and rename").
class ExitAfterRecord : public group::DecisionLog {
 public:
  explicit ExitAfterRecord(group::DecisionLogPtr inner) : inner_(std::move(inner)) {}
  absl::Status RecordCommit(const std::string& job, uint64_t step,
                            const std::string& record_json) override {
    absl::Status s = inner_->RecordCommit(job, step, record_json);
    if (s.ok()) {
      log::Get(log::Component::kGroup)
          .warn("[{} s{}] CKPTD_FAULT=exit-after-commit-record: exiting", job, step);
      spdlog::shutdown();
      ::_exit(99);
    }
    return s;
  }
  absl::StatusOr<std::optional<std::string>> FindCommit(const std::string& job,
                                                        uint64_t step) override {
    return inner_->FindCommit(job, step);
  }
  absl::Status RecordManifest(const std::string& job, uint64_t step, const std::string& manifest_json) override {
    return inner_->RecordManifest(job, step, manifest_json);
  }
  absl::StatusOr<std::optional<std::string>> FindManifest(const std::string& job, uint64_t step,
                                                          size_t max_bytes) override {
    return inner_->FindManifest(job, step, max_bytes);
  }
  absl::Status ForgetManifest(const std::string& job, uint64_t step) override {
    return inner_->ForgetManifest(job, step);
  }

 private:
  group::DecisionLogPtr inner_;
};

// Who has live sessions, by user and job: who shares staging memory and the replica memory.
StagingLedger::ActiveUsers ActiveUsers(const SessionRegistry& sessions) {
  StagingLedger::ActiveUsers active;
  for (const SessionPtr& s : sessions.All()) active[s->uid()].insert(s->job());
  return active;
}

// The group's server (every node), coordinator role on node 0, and the client to it.
absl::Status StartGroup(Server::Parts& p) {
  const Config& c = p.config;
  auto& log = log::Get(log::Component::kGroup);
  group::GroupOptions& o = p.group_options;
  o.node_rank = c.node_rank;
  o.num_nodes = c.num_nodes;
  o.coordinator = c.coordinator;
  o.listen_addr = !c.group_addr.empty() ? c.group_addr
                  : c.node_rank == 0    ? c.coordinator
                                        : "0.0.0.0:0";
  o.group_timeout = std::chrono::milliseconds(c.group_timeout_ms);
  o.step_timeout = std::chrono::milliseconds(c.step_timeout_ms);
  // Tests only: small steps published as an index and parts, as large ones are.
  if (const char* most = std::getenv("CKPTD_TEST_MAX_WHOLE_MANIFEST_BYTES"); most != nullptr) {
    o.max_whole_manifest_bytes = std::strtoull(most, nullptr, 10);
  }
  o.relay_fanout = c.group_relay_fanout;
  o.failure_domain = c.failure_domain;
  CKPT_ASSIGN_OR_RETURN(o.token,
                        ReadToken(c.group_token_file, "--group-token-file"));
  if (!c.group_tls_cert.empty()) {
    CKPT_ASSIGN_OR_RETURN(o.tls_cert_pem, ReadOperatorFile(c.group_tls_cert, "--group-tls-cert"));
    CKPT_ASSIGN_OR_RETURN(o.tls_key_pem, ReadOperatorFile(c.group_tls_key, "--group-tls-key"));
    CKPT_ASSIGN_OR_RETURN(o.tls_ca_pem, ReadOperatorFile(c.group_tls_ca, "--group-tls-ca"));
  } else {
    log.warn("group traffic is not encrypted (no --group-tls-*): acceptable only on a private, "
             "trusted network; calls are still authenticated by the token");
  }
  uint64_t incarnation = 0;
  std::random_device random;
  while (incarnation == 0) incarnation = (uint64_t{random()} << 32) | random();
  if (o.coordinator_role()) {
    p.decision_log = group::MakeFileDecisionLog(p.fs, c.root + "/.group/decisions");
    if (const char* fault = std::getenv("CKPTD_FAULT");
        fault != nullptr && std::string(fault) == "exit-after-commit-record") {
      p.decision_log = std::make_unique<ExitAfterRecord>(std::move(p.decision_log));
    }
  }
  group::CommitCoordinator::Publisher publish;
  if (p.shared_store) {
    publish.commit = [store = p.store.get()](const format::Manifest& m) { return store->Commit(m); };
    publish.write_part = [store = p.store.get()](const format::Manifest& part, format::Manifest& index) {
      return store->WriteManifestPart(part, index);
    };
    publish.discard = [store = p.store.get()](const std::string& job, uint64_t step) {
      (void)store->AbortStep(job, step);
    };
    publish.hold_origins = [retention = p.retention.get()](const format::Manifest& m) {
      return retention->HoldSteps(m.job, m.increment->origin_steps);
    };
  }
  if (c.replication_k != 0) {
    p.fragments = std::make_unique<replicate::FragmentStore>(c.replica_bytes != 0 ? c.replica_bytes : c.staging_bytes,
                                                             [parts = &p] { return ActiveUsers(parts->sessions); });
    // Test-only faults: fragments served damaged; fragments sent here never answered while
    // a file exists.
    replicate::ReplicaFaults faults;
    const std::string fault = std::getenv("CKPTD_FAULT") != nullptr ? std::getenv("CKPTD_FAULT") : "";
    faults.corrupt_served = fault == "corrupt-served-fragments";
    if (fault.rfind("stall-replicas-while:", 0) == 0) faults.stall_while = fault.substr(21);
    p.replica_service = std::make_unique<replicate::ReplicaService>(*p.fragments, o.token, faults);
    // A replacement node asks its peers whose a job is before anyone may claim its name.
    p.replica_service->set_owner_records(
        [owners = p.owners.get()](const std::string& job) -> std::optional<replicate::ReplicaService::RecordedOwner> {
          std::optional<KnownOwner> known = owners->Recorded(job);
          if (!known) return std::nullopt;
          return replicate::ReplicaService::RecordedOwner{known->uid, known->gid};
        });
    if (!o.tls() && c.replica_fetch_port >= 0) {
      // Restores fetch fragments over plain TCP, five times gRPC's speed (benchmarks.md,
      // "Peer replicas"); with TLS every fragment stays on the encrypted gRPC channel.
      CKPT_ASSIGN_OR_RETURN(p.fetch_server,
                            replicate::FetchServer::Start(*p.fragments, o.listen_addr.substr(0, o.listen_addr.rfind(':')),
                                                          faults, c.replica_fetch_port));
      p.replica_service->set_fetch(p.fetch_server.get());
    }
  }
  CKPT_ASSIGN_OR_RETURN(p.group_server,
                        group::StartGroupServer(o, incarnation, p.decision_log.get(), std::move(publish),
                                                &p.announced_uploads, p.replica_service.get()));
  // Node 0 talks to its own coordinator like every other node (one code path), at the
  // address it really bound (the port may have been 0).
  if (o.coordinator_role()) o.coordinator = p.group_server->address();
  CKPT_ASSIGN_OR_RETURN(p.group_client,
                        group::MakeGrpcGroupClient(o, incarnation, p.group_server->address()));
  // Every node but the coordinator relays for the nodes below it in the tree (if any call).
  if (group::RelayUpstream* upstream = p.group_client->relay_upstream()) p.group_server->StartRelay(*upstream);
  return absl::OkStatus();
}

// --replication: the coding group of this node, the replicator that sends its shards there
// once staged, and the restore's way back. The group's view tells who is where.
absl::Status StartReplication(Server::Parts& p) {
  const Config& c = p.config;
  CKPT_ASSIGN_OR_RETURN(replicate::ErasureCode code, replicate::ErasureCode::Make(static_cast<int>(c.replication_k),
                                                                                  static_cast<int>(c.replication_m)));
  replicate::PeerDirectory::Options o;
  o.self = c.node_rank;
  o.num_nodes = c.num_nodes;
  o.k = static_cast<int>(c.replication_k);
  o.m = static_cast<int>(c.replication_m);
  o.token = p.group_options.token;
  o.timeout = std::chrono::milliseconds(c.step_timeout_ms);
  p.peer_directory = std::make_unique<replicate::PeerDirectory>(
      o,
      [parts = &p] {
        std::vector<replicate::PeerNode> nodes;
        if (!parts->group_member) return nodes;  // shutting down
        for (const group::MemberView& m : parts->group_member->state().view.members) {
          nodes.push_back({m.node, m.address, m.domain, m.state == group::MemberState::kAlive});
        }
        return nodes;
      },
      [options = p.group_options](const std::string& address) { return group::MakePeerChannel(options, address); });
  p.replicator = std::make_unique<replicate::Replicator>(*p.peer_directory, code, 2, [priority = &p.copy_priority] {
    priority->YieldToCopies(std::chrono::milliseconds(500));
  });
  // A replacement's survey of its holders waits for the silent ones within a third of the
  // restore's deadline (at most a minute), leaving the rest to fetch and to the ranks' barrier.
  const auto survey_wait = std::min<std::chrono::milliseconds>(std::chrono::milliseconds(c.restore_timeout_ms) / 3,
                                                               std::chrono::minutes(1));
  p.peer_shards = std::make_unique<replicate::PeerShards>(*p.peer_directory, o.k, survey_wait);
  // A job this node's root does not know (a replacement's empty disk) is the peers' to name.
  p.owners->AskPeers(std::make_unique<replicate::PeerOwners>(
      *p.peer_directory,
      [parts = &p] { return parts->group_member && parts->group_member->state().joined; },
      replicate::PeerOwners::Options{}));
  p.board.on_staged = [replicator = p.replicator.get()](const StagedSnapshotPtr& snap, uid_t uid) {
    replicator->Staged(snap->job, snap->step, snap->rank, snap->session_started_unix_ns, uid,
                       std::shared_ptr<const ScatteredBytes>(snap, &snap->shard.region), snap->shard.data_bytes);
  };
  log::Get(log::Component::kGroup)
      .info("peer replicas {}+{}: this node's shards go to {} peers of its coding group; {} bytes held for peers; "
            "restores fetch {}",
            o.k, o.m, o.k + o.m - 1, p.fragments->budget(),
            p.fetch_server ? fmt::format("over TCP port {}", p.fetch_server->port()) : std::string("over gRPC"));
  if (!p.group_options.tls()) {
    log::Get(log::Component::kGroup)
        .warn("--replication without --group-tls-*: fragments of every job's checkpoints cross the network in "
              "plaintext; acceptable only on a private, trusted network");
  }
  return absl::OkStatus();
}

// This node's manifest of a committed step (node 0 holds the whole step's: its part is cut
// from it), sealed with the step's fragments at the holders: as the peers hold the step, each
// rank's staged snapshot (SnapshotManifest: an incremental step's own manifest places pieces
// in files, or in earlier steps' files). `manifest`: of the whole step, this node's scoped
// one, or this node's part of an indexed step.
void ReplicateCommitted(Server::Parts& p, const format::Manifest& manifest, const std::vector<StagedSnapshotPtr>& local) {
  std::vector<uint32_t> ranks;
  for (const StagedSnapshotPtr& snap : local) ranks.push_back(snap->rank);
  std::optional<format::Manifest> cut;
  if (!manifest.scope && !manifest.nodes.empty()) {
    const std::string whole = format::ManifestToJson(manifest);
    cut = group::NodeManifestFromWhole(manifest, format::ChecksumOf(whole.data(), whole.size()), p.config.node_rank);
  }
  absl::StatusOr<format::Manifest> sealed = SnapshotManifest(cut ? *cut : manifest, local);
  if (!sealed.ok()) {
    // Never sealed with a manifest its fragments do not match: the step is not replicated.
    log::Get(log::Component::kGroup)
        .error("[{} s{}] not replicated: {}", manifest.job, manifest.step, Message(sealed.status()));
    p.replicator->Failed(manifest.job, manifest.step);
    return;
  }
  p.replicator->Committed(manifest.job, manifest.step, std::move(ranks), format::ManifestToJson(*sealed),
                          manifest.unix_time);
}

const char* MemberState(group::MemberState s) { return group::MemberStateName(s); }

// Why the daemon is not ready for trainers, or "" when it is: in a group it must have
// joined, and every member must be alive (a step cannot commit without all of them).
std::string NotReadyReason(const Server::Parts& p) {
  if (!p.group_member) return "";
  group::GroupMember::State state = p.group_member->state();
  if (!state.joined) {
    return fmt::format("not joined to the group at {}{}{}", p.group_options.coordinator,
                       state.last_error.empty() ? "" : ": ", state.last_error);
  }
  if (state.view.members.size() < p.config.num_nodes) {
    return fmt::format("{} of {} group members have joined", state.view.members.size(), p.config.num_nodes);
  }
  for (const group::MemberView& m : state.view.members) {
    if (m.state != group::MemberState::kAlive) {
      return fmt::format("group member {} ({}) is {}", m.node, m.address, MemberState(m.state));
    }
  }
  return "";
}

// --replication: how this node's steps stand with its coding group, and what it holds of
// its peers'.
void FillReplicationStatus(Server::Parts& p, ::ckptd::v1::StatusReply* reply) {
  if (!p.replicator) return;
  ::ckptd::v1::GroupStatus* g = reply->mutable_group();
  g->set_replication(fmt::format("{}+{}", p.config.replication_k, p.config.replication_m));
  g->set_failure_domain(p.config.failure_domain);
  if (auto holders = p.peer_directory->Holders(p.config.node_rank); holders.ok()) {
    for (const replicate::Holder& h : *holders) g->add_replica_holders(h.node);
  }
  g->set_placement_warning(p.peer_directory->PlacementWarning());
  g->set_replica_bytes_total(p.fragments->budget());
  g->set_replica_bytes_used(p.fragments->used());
  for (const replicate::HeldStep& h : p.fragments->Held()) {
    ::ckptd::v1::HeldReplica* out = g->add_held_replicas();
    out->set_job(h.job);
    out->set_owner(h.owner);
    out->set_step(h.step);
    out->set_fragments(static_cast<uint32_t>(h.fragments));
    out->set_bytes(h.bytes);
    out->set_sealed(h.sealed);
  }
  const std::vector<replicate::StepReplication> steps = p.replicator->Steps();
  for (auto& job : *reply->mutable_jobs()) {
    for (const replicate::StepReplication& s : steps) {
      if (s.job != job.job()) continue;
      ::ckptd::v1::StepReplication* out = job.add_replication();
      out->set_step(s.step);
      out->set_state(replicate::StateName(s.state));
      out->set_why(s.why);
      out->set_bytes_sent(s.bytes_sent);
      out->set_seconds(s.seconds);
      out->set_unix_time(s.unix_time);
    }
  }
}

void FillGroupStatus(Server::Parts& p, ::ckptd::v1::StatusReply* reply) {
  ::ckptd::v1::GroupStatus* g = reply->mutable_group();
  g->set_enabled(true);
  g->set_node_rank(p.config.node_rank);
  g->set_num_nodes(p.config.num_nodes);
  g->set_coordinator(p.group_options.coordinator);
  g->set_address(p.group_server ? p.group_server->address() : "");
  g->set_tls(p.group_options.tls());
  g->set_relay_parent(group::RelayParent(p.config.node_rank, p.group_options.relay_fanout).value_or(0));
  if (p.group_client) g->set_relay_bypasses(p.group_client->relay_bypasses());
  if (p.group_server) {
    group::Relay::Counters relayed = p.group_server->relayed();
    g->set_relayed_prepares(relayed.prepares);
    g->set_relayed_batches(relayed.batches);
    g->set_relayed_outcome_polls(relayed.outcome_polls);
    g->set_relayed_upstream_polls(relayed.upstream_polls);
    g->set_relayed_heartbeats(relayed.heartbeats);
    g->set_relayed_heartbeat_batches(relayed.heartbeat_batches);
    g->set_relayed_gathers(relayed.gathers);
    g->set_relayed_gather_merges(relayed.gather_merges);
  }
  if (!p.group_member) return;
  group::GroupMember::State state = p.group_member->state();
  g->set_joined(state.joined);
  g->set_last_error(state.last_error);
  g->set_last_contact_age_s(state.last_ok_age_s);
  // The coordinator's own table has every member's heartbeat age; other nodes hear only
  // what changed, without ages.
  const group::Membership* table = p.group_server ? p.group_server->membership() : nullptr;
  for (const group::MemberView& m : table ? table->View() : state.view.members) {
    ::ckptd::v1::GroupMember* out = g->add_members();
    out->set_node_rank(m.node);
    out->set_address(m.address);
    out->set_state(MemberState(m.state));
    out->set_last_heartbeat_age_s(m.last_heartbeat_age_s);
    out->set_failure_domain(m.domain);
  }
  FillReplicationStatus(p, reply);
  for (auto& job : *reply->mutable_jobs()) {
    if (auto it = state.view.committed.find(job.job()); it != state.view.committed.end()) {
      job.set_has_global(true);
      job.set_latest_global_step(it->second);
    }
    for (const group::StepProgress& s : state.view.steps) {
      if (s.job != job.job()) continue;
      ::ckptd::v1::StepInFlight* step = job.add_in_flight();
      step->set_step(s.step);
      step->set_world_size(s.world_size);
      for (uint32_t r : s.missing_ranks) step->add_missing_ranks(r);
      step->set_age_s(s.age_s);
      step->set_state("prepared");
      step->set_scope("group");
    }
  }
}

void FillUploadStatus(Server::Parts& p, ::ckptd::v1::StatusReply* reply) {
  const std::vector<upload::UploadProgress> uploads = p.uploader->InProgress();
  const std::map<std::string, upload::Uploader::Published> uploaded = p.uploader->LastPublished();
  auto job_status = [reply](const std::string& job) {
    for (auto& j : *reply->mutable_jobs()) {
      if (j.job() == job) return &j;
    }
    ::ckptd::v1::JobStatus* j = reply->add_jobs();
    j->set_job(job);
    return j;
  };
  for (const upload::UploadProgress& u : uploads) {
    ::ckptd::v1::UploadInProgress* out = job_status(u.job)->add_uploads();
    out->set_step(u.step);
    out->set_state(u.state);
    out->set_bytes_done(u.bytes_done);
    out->set_bytes_total(u.bytes_total);
    out->set_last_error(u.last_error);
    out->set_age_s(u.age_s);
  }
  for (const auto& [job, published] : uploaded) {
    ::ckptd::v1::JobStatus* j = job_status(job);
    j->set_has_remote(true);
    j->set_latest_remote_step(published.step);
    j->set_latest_remote_unix_time(published.unix_time);
  }
}

// What a scrape reads of status (durability_figures.h): the jobs of `commits` first, then
// those with steps in flight, each with its steps written or committing, and the group's and
// the uploads' sections as `ckptctl status` has them.
void FillScrapeStatus(Server::Parts& p, const std::vector<metrics::LastCommits::Commit>& commits,
                      ::ckptd::v1::StatusReply* reply) {
  reply->set_remote(p.config.remote);
  std::map<std::string, std::set<uint64_t>> in_flight;
  for (const auto& [job, steps] : p.writes->Pending()) in_flight[job].insert(steps.begin(), steps.end());
  for (const commit::StepInFlight& f : p.committer->InFlight()) in_flight[f.job].insert(f.step);
  std::map<std::string, ::ckptd::v1::JobStatus*> jobs;
  auto job_status = [&](const std::string& job) {
    auto [it, added] = jobs.emplace(job, nullptr);
    if (added) {
      it->second = reply->add_jobs();
      it->second->set_job(job);
    }
    return it->second;
  };
  for (const metrics::LastCommits::Commit& c : commits) job_status(c.job);
  for (const auto& [job, steps] : in_flight) {
    ::ckptd::v1::JobStatus* j = job_status(job);
    for (uint64_t step : steps) j->add_pending_steps(step);
  }
  if (p.group_member) FillGroupStatus(p, reply);
  if (p.uploader) FillUploadStatus(p, reply);
}

// Each job's newest committed step on the local tier and its time (its manifest's), so that
// the per-job gauges show a job that stopped committing before this start too.
void SeedLastCommits(format::CheckpointStore& store, metrics::LastCommits& commits) {
  auto& log = log::Get(log::Component::kMain);
  absl::StatusOr<std::vector<std::string>> jobs = store.ListJobs();
  if (!jobs.ok()) {
    log.warn("the jobs' last commits for /metrics: {}", Message(jobs.status()));
    return;
  }
  int found = 0;
  for (const std::string& job : *jobs) {
    absl::StatusOr<std::vector<uint64_t>> steps = store.ListStepsInRunOrder(job);
    if (!steps.ok() || steps->empty()) continue;
    absl::StatusOr<format::Manifest> m =
        store.LoadManifest(job, steps->back(), format::CheckpointStore::Depth::kIndexOnly);
    if (!m.ok()) {
      log.warn("[{} s{}] its time for /metrics: {}", job, steps->back(), Message(m.status()));
      continue;
    }
    const auto at = std::chrono::system_clock::time_point(std::chrono::duration_cast<std::chrono::system_clock::duration>(
        std::chrono::duration<double>(m->unix_time)));
    commits.Record(job, steps->back(), at);
    ++found;
  }
  if (found > 0) log.info("{} jobs have committed steps on {}", found, store.root());
}

}  // namespace

Server::Server(std::unique_ptr<Parts> parts) : parts_(std::move(parts)) {}

Server::~Server() { Shutdown(); }

absl::StatusOr<std::unique_ptr<Server>> Server::Start(const Config& config) {
  auto& log = log::Get(log::Component::kMain);
  auto p = std::make_unique<Parts>();
  p->config = config;
  log.info("ckptd {} starting: {}", kVersion, config.ToJson());

  p->fs = MakePosixFilesystem();
  if (const char* fault = std::getenv("CKPTD_FAULT"); fault != nullptr && std::string(fault).rfind("eio-reading:", 0) == 0) {
    log.warn("CKPTD_FAULT={}: reads of that file fail with EIO past its first 4 KiB (a test's fault)", fault);
    p->fs = MakeReadFaultFilesystem(std::move(p->fs), std::string(fault).substr(12));
  }
  // A root ckptd cannot write fails here, saying why and what to change (a systemd unit's
  // ProtectSystem=strict, a directory that is not ckptd's), not at the first checkpoint.
  if (!storage::IsS3Url(config.root)) CKPT_RETURN_IF_ERROR(CheckRootWritable(config.root));
  CKPT_RETURN_IF_ERROR(Annotate(p->fs->MakeDir(config.root), "--root"));
  // Before anything on the root is touched. On a shared root every node has a lock of its
  // own: one daemon per node rank.
  CKPT_ASSIGN_OR_RETURN(
      p->root_lock,
      RootLock::Acquire(config.root, config.shared_root
                                         ? fmt::format(".ckptd.node-{}.lock", config.node_rank)
                                         : std::string(".ckptd.lock")));
  // The socket is bound (at its path + ".new", accepting nothing until it serves) before the
  // slow parts of the start (a remote tier's first answer, pinning the staging memory): a
  // trainer's load() that finds it waits for this daemon instead of taking the node for one
  // without a ckptd (client/python/src/ckptd/_connection.py).
  CKPT_ASSIGN_OR_RETURN(p->listener,
                        UnixListener::Bind(config.socket, SocketAccess{config.allow_uids, config.allow_gids}));
  const bool grouped = config.num_nodes > 1;
  const bool direct = !config.remote.empty() && config.remote_mode == RemoteMode::kDirect;
  storage::StorePtr remote;
  if (!config.remote.empty()) {
    absl::StatusOr<storage::StorePtr> opened = storage::OpenStore(
        config.remote, p->fs, {config.s3_endpoint, config.s3_credentials_file});
    if (!opened.ok()) return Annotate(opened.status(), "--remote");
    remote = std::move(*opened);
    // Tell a wrong bucket, endpoint or key at start rather than at the first upload: in
    // direct mode by refusing to start; in tiered mode on the log and status, as the
    // daemon starts.
    if (direct) {
      if (absl::Status reachable = remote->List("").status(); !reachable.ok()) {
        return Annotate(reachable, "--remote");
      }
    } else {
      p->remote_check = std::make_unique<RemoteCheck>(
          remote, [url = config.remote, board = &p->board](const absl::Status& unreachable) {
            log::Get(log::Component::kMain).error("--remote {}: {}; uploads will be retried", url, Message(unreachable));
            board->RecordError(fmt::format("--remote {}: {}", url, Message(unreachable)));
          });
    }
  }
  if (direct) {
    // No local tier: shards go from staging memory straight into uploads.
    p->store = std::make_unique<format::CheckpointStore>(remote, config.remote);
    p->shared_store = grouped;
    log.info("checkpoints go straight to {} (--remote-mode direct)", config.remote);
  } else {
    // A job directory deleted under ckptd gets its owner's record and access back before its
    // next step is written there (JobOwners exists by then: the first write is a snapshot's).
    p->store = std::make_unique<format::CheckpointStore>(
        p->fs, config.root, [owners = &p->owners](const std::string& job) {
          if (*owners) (*owners)->Restore(job);
        });
    p->shared_store = config.shared_root;
    if (remote) p->remote = std::make_unique<format::CheckpointStore>(remote, config.remote);
  }
  p->store->set_shared(p->shared_store);
  // Before any stage that could write a job's files (the uploader's thread starts below).
  p->owners = std::make_unique<JobOwners>(
      *p->fs, config.root,
      JobOwners::Options{.daemon_uid = ::geteuid(),
                         .job_gids = config.job_gids,
                         .remote = p->remote ? p->remote->objects_ptr() : direct ? p->store->objects_ptr() : nullptr,
                         .remote_only = direct});
  if (!direct && (config.user_quota_bytes != 0 || config.job_quota_bytes != 0)) {
    // Before any other thread uses the store: what retention, deletes and aborts remove is
    // measured again before the job's next write.
    p->quota = std::make_unique<persist::DiskQuota>(
        *p->fs, config.root, persist::DiskQuota::Limits{config.user_quota_bytes, config.job_quota_bytes},
        [owners = p->owners.get()](const std::string& job) -> std::optional<uint32_t> {
          return owners->LocalOwner(job);
        });
    p->store->set_removed_hook([quota = p->quota.get()](const std::string& job) { quota->Changed(job); });
  }
  if (int closed = p->owners->CloseAll(); closed > 0) {
    log::Get(log::Component::kMain).info("{} job directories readable by their owners alone", closed);
  }
  std::vector<std::pair<std::string, uint64_t>> in_doubt;
  // On a shared store only the coordinator looks after step directories.
  const bool own_steps = !p->shared_store || config.node_rank == 0;
  if (grouped && own_steps) {
    // Unfinished steps may have been committed by the group meanwhile: ask, don't remove.
    CKPT_ASSIGN_OR_RETURN(in_doubt, p->store->ListTempSteps());
  }
  CKPT_ASSIGN_OR_RETURN(int stale, p->store->RemoveStaleTemp(/*keep_step_tmp=*/grouped));
  if (stale > 0) log.info("removed {} unfinished directories left by an earlier run", stale);
  // Not in direct mode: a remote tier that does not answer would hold the start.
  if (!direct) SeedLastCommits(*p->store, p->last_commits);

  CKPT_ASSIGN_OR_RETURN(p->pool, cuda::StagingPool::Create(config.staging_bytes,
                                                           config.prefault_staging));
  p->engine = cuda::MakeHostCopyEngine(config.copy_threads);
  // CUDA is detected once. Without a usable device the host path serves everything and
  // GPU tensors are refused at registration with this reason.
  const cuda::DeviceInfo& device = cuda::DetectDevices();
  std::string no_gpu_reason = device.reason;
  if (device.available()) {
    // One engine (4 streams) per GPU, so that each GPU's copies use its own DMA engines.
    absl::Status usable = p->pool->PinForCuda();
    for (int d = 0; usable.ok() && d < device.device_count; ++d) {
      auto engine = cuda::MakeCudaCopyEngine({.device = d, .streams = 4});
      if (engine.ok()) {
        p->device_engines.push_back(std::move(*engine));
      } else {
        usable = engine.status();
      }
    }
    if (usable.ok()) {
      p->gpu_memory = std::make_unique<cuda::IpcMemoryCache>();
      log.info("CUDA: the driver supports CUDA {} (ckptd needs {} or newer); {} device(s); staging memory pinned; "
               "a copy engine of 4 streams per device",
               cuda::CudaVersionName(cuda::Driver()->version), cuda::kMinDriverName, device.device_count);
    } else {
      p->device_engines.clear();
      no_gpu_reason = Message(usable);
      log.error("CUDA: device present but unusable ({}); host copy engine only", no_gpu_reason);
    }
  } else {
    log.info("CUDA: no usable device ({}); host copy engine only, GPU tensors refused", device.reason);
  }
  // Between a writer's large writes: staging copies, which trainers wait for, go first.
  auto yield_to_copies = [priority = &p->copy_priority] { priority->YieldToCopies(std::chrono::milliseconds(500)); };
  p->writer = persist::MakeShardWriter(p->store->objects_ptr(), yield_to_copies);
  p->hot = std::make_unique<HotCache>(p->progress);
  p->retention = std::make_unique<persist::RetentionKeeper>(
      *p->store, persist::RetentionPolicy{config.keep_last, config.keep_every},
      [hot = p->hot.get()](const std::string& job, uint64_t step) { hot->Drop(job, step); },
      [board = &p->board](const std::string& message) { board->RecordError(message); });
  // A held step whose last referrer went in a retention pass ckptd died in goes now, not at
  // its job's next commit (a job that never commits again would keep it).
  if (absl::StatusOr<std::vector<std::string>> jobs = p->store->ListJobs(); own_steps && jobs.ok()) {
    for (const std::string& job : *jobs) {
      absl::StatusOr<std::vector<format::StepRun>> held = p->store->ListHeld(job);
      if (held.ok() && !held->empty()) p->retention->ScheduleSweep(job);
    }
  }
  if (config.increments) {
    p->increment_bases = std::make_unique<persist::IncrementBases>();
    persist::IncrementOptions increment_options{config.increment_chunk_bytes, config.full_every};
    // Test-only fault (CKPTD_FAULT=header-limit:N): headers over N bytes are too large, so that
    // a test reaches with kilobytes what takes a 100 MB header (tests/integration/increment_test.cc).
    if (const char* fault = std::getenv("CKPTD_FAULT"); fault != nullptr && std::string(fault).rfind("header-limit:", 0) == 0) {
      increment_options.max_header_bytes = std::stoull(std::string(fault).substr(13));
      log.warn("CKPTD_FAULT={}: safetensors headers over {} bytes are refused (a test's fault)", fault,
               increment_options.max_header_bytes);
    }
    p->increment_writer = std::make_unique<persist::IncrementWriter>(*p->store, *p->increment_bases, *p->retention,
                                                                     increment_options, yield_to_copies);
    log.info("increments on: each rank writes what changed since its previous step (chunks of about {} bytes; a "
             "rebase every {} saves)",
             config.increment_chunk_bytes, config.full_every);
  }
  p->upload_policies = std::make_shared<upload::UploadPolicies>(upload::UploadPolicy{
      config.upload_every_steps, std::chrono::milliseconds(config.upload_interval_ms)});
  if (p->remote) {
    // In a group with node-local disks every node uploads its own ranks' files and the
    // coordinator writes the manifest; on a shared root the coordinator uploads it all.
    const bool publishes = !grouped || config.node_rank == 0;
    if (publishes) {
      p->remote_retention = std::make_unique<persist::RetentionKeeper>(
          *p->remote, persist::RetentionPolicy{config.remote_keep_last, config.remote_keep_every},
          [](const std::string&, uint64_t) {},
          [board = &p->board](const std::string& message) { board->RecordError(message); });
    }
    if (own_steps) {
      upload::Uploader::Options o;
      o.policies = p->upload_policies;
      o.publishes = publishes;
      if (grouped && !p->shared_store) {
        o.node = config.node_rank;
        // Every node uploads its part of the step node 0 uploads.
        if (publishes) {
          o.announce = [t = &p->announced_uploads](const std::string& job, uint64_t step) { t->Set(job, step); };
        } else {
          o.follow = [t = &p->heard_uploads](const std::string& job) { return t->Get(job); };
        }
      }
      o.wait_for_parts = std::chrono::milliseconds(config.upload_wait_ms);
      o.remote_retention = p->remote_retention.get();  // an incremental step's origins pinned there
      // A job's owner record goes to the bucket before its first step does.
      o.before_upload = [owners = p->owners.get()](const std::string& job) {
        return owners->PublishRemote(job);
      };
      p->uploader = std::make_unique<upload::Uploader>(
          *p->store, *p->remote, *p->retention, o,
          [keeper = p->remote_retention.get()](const std::string& job) {
            if (keeper) keeper->Schedule(job);
          },
          [board = &p->board](const std::string& message) { board->RecordError(message); });
    }
    log.info("remote tier {}: uploading steps that are multiples of {}{}{}", config.remote,
             config.upload_every_steps,
             config.upload_interval_ms ? fmt::format(", the first of each {} ms", config.upload_interval_ms) : "",
             publishes ? "; this node writes the remote manifests" : "");
  }
  commit::CommitHooks hooks;
  hooks.committed = [parts = p.get(), own_steps](const format::Manifest& manifest,
                                                 const std::vector<StagedSnapshotPtr>& local) {
    parts->board.checkpoints_committed++;
    metrics::Metrics().checkpoints.With({"committed"}).Add();
    parts->last_commits.Record(manifest.job, manifest.step, std::chrono::system_clock::now());
    // An index (a step too large for one manifest, on a shared root) lists no pieces: this
    // node's ranks are in its part, read back once.
    std::optional<format::Manifest> part;
    if (manifest.index && !local.empty() && (parts->increment_bases || parts->replicator)) {
      bool from_index = false;
      auto mine = parts->store->LoadManifestForRank(manifest.job, manifest.step, local.front()->rank, &from_index);
      if (mine.ok()) part = std::move(*mine);
    }
    if (parts->increment_bases) {
      // The next save of each of these ranks' sessions references this step.
      std::vector<std::pair<uint32_t, uint64_t>> ranks;
      for (const StagedSnapshotPtr& snap : local) ranks.emplace_back(snap->rank, snap->session_started_unix_ns);
      parts->increment_bases->Committed(part ? *part : manifest, ranks);
    }
    parts->hot->Insert(local);
    if (parts->replicator) ReplicateCommitted(*parts, part ? *part : manifest, local);
    // On a shared store retention and uploads are the coordinator's (every node would
    // delete, or upload, the same).
    if (own_steps) {
      // The uploader pins the step first: local retention never deletes it unuploaded.
      if (parts->uploader) {
        // The data regions go up from staging memory while the hot cache keeps them.
        std::map<uint32_t, upload::InMemoryShard> in_memory;
        for (const StagedSnapshotPtr& snap : local) {
          in_memory[snap->rank] = {std::shared_ptr<const ScatteredBytes>(snap, &snap->shard.region),
                                   snap->shard.data_bytes};
        }
        parts->uploader->Committed(manifest, std::move(in_memory));
      }
      parts->retention->Schedule(manifest.job);
    }
  };
  hooks.failed = [parts = p.get(), board = &p->board](const std::string& job, uint64_t step, const std::string& m) {
    if (parts->replicator) parts->replicator->Failed(job, step);
    board->checkpoints_failed++;
    metrics::Metrics().checkpoints.With({"failed"}).Add();
    board->RecordError(fmt::format("[{} s{}] {}", job, step, m));
  };
  hooks.progress = [progress = &p->progress] { progress->Notify(); };
  commit::CommitOptions commit_options{std::chrono::milliseconds(config.step_timeout_ms)};
  if (grouped) {
    CKPT_RETURN_IF_ERROR(StartGroup(*p));
    auto committer = std::make_unique<commit::GroupCommitter>(
        *p->store, hooks, commit_options, *p->group_client, config.node_rank);
    committer->AdoptInDoubt(in_doubt);
    p->committer = std::move(committer);
    p->agreement = MakeGroupStepAgreement(*p->group_client);
    p->save_clock = MakeGroupSaveClock(*p->group_client);
    if (config.replication_k != 0) CKPT_RETURN_IF_ERROR(StartReplication(*p));
  } else {
    p->committer = std::make_unique<commit::SingleNodeCommitter>(*p->store, hooks, commit_options);
    p->agreement = MakeLocalStepAgreement();
    p->save_clock = MakeLocalSaveClock();
  }
  persist::WriteQueue::Options write_options{config.io_threads, storage::IsS3Url(config.root) ? "remote" : "local"};
  write_options.quota = p->quota.get();
  write_options.increments = p->increment_writer.get();
  p->writes = std::make_unique<persist::WriteQueue>(
      *p->writer, *p->committer, p->progress, write_options,
      [board = &p->board](uint64_t bytes) { board->bytes_persisted += bytes; });
  if (grouped) {
    p->group_member = std::make_unique<group::GroupMember>(
        p->group_options, *p->group_client, [] {},
        [t = &p->heard_uploads](const group::GroupViewData& view) { t->Replace(view.uploading); });
  }
  std::vector<cuda::CopyEngine*> device_engines;
  for (const auto& e : p->device_engines) device_engines.push_back(e.get());
  Stager::Options staging;
  staging.when_busy = config.when_busy;
  staging.busy_wait = std::chrono::milliseconds(config.busy_wait_ms);
  staging.chunk_bytes = config.staging_chunk_bytes;
  p->ledger = std::make_unique<StagingLedger>(p->pool->capacity(),
                                              [parts = p.get()] { return ActiveUsers(parts->sessions); });
  staging.ledger = p->ledger.get();
  p->stager = std::make_unique<Stager>(*p->pool, *p->engine, *p->hot, p->progress, staging,
                                       &p->copy_priority, device_engines);
  p->restorer = std::make_unique<Restorer>(
      *p->store, p->remote.get(), *p->hot, *p->retention, *p->agreement,
      std::chrono::milliseconds(config.restore_timeout_ms), *p->engine, &p->copy_priority,
      device_engines, p->pool.get(), p->peer_shards.get());

  Session::Limits limits;
  limits.staging_bytes = p->pool->capacity();
  limits.gpu_memory = p->gpu_memory.get();
  limits.no_gpu_reason = no_gpu_reason;
  limits.cuda_ipc = config.cuda_ipc;
  p->arena_budget = std::make_unique<ArenaBudget>(
      ArenaBudget::Options{.bytes_per_uid = 4 * p->pool->capacity()});
  limits.arena_budget = p->arena_budget.get();
  limits.daemon_uid = ::geteuid();
  limits.allow_uids = config.allow_uids;
  limits.deposits = &p->arenas;
  limits.frozen_check_every = config.frozen_check_every;
  limits.local_ranks = [parts = p.get()](const std::string& job) { return parts->sessions.RanksOf(job); };
  p->trainer_service = std::make_unique<TrainerService>(
      p->sessions, *p->stager, *p->writes, *p->retention, *p->restorer, p->board, limits,
      p->peers, *p->owners, p->arenas, *p->save_clock, *p->upload_policies,
      DescriptorSocketPath(config.socket));
  if (p->increment_bases) {
    p->trainer_service->set_restored_hook([parts = p.get()](const std::string& job, uint32_t rank, uint64_t session,
                                                            uint64_t step, RestoreResult::Source source) {
      // Rebuilt from peers: this node lacks the rank's file of the step (a replacement, a
      // disk that lost files), and maybe the files it references. Its manifest, if this root
      // still has one, is no base: the next save is written whole.
      if (source == RestoreResult::Source::kPeer) return;
      // Its rank's part of the step as this node holds it (what the writer may reference).
      bool from_index = false;
      absl::StatusOr<format::Manifest> manifest = parts->store->LoadManifestForRank(job, step, rank, &from_index);
      if (manifest.ok()) parts->increment_bases->Restored(*manifest, rank, session);
    });
  }
  AdminSources sources{*p->store,    *p->hot,     *p->retention, *p->committer,
                       *p->writes,   p->sessions, *p->pool,      p->board,
                       {}};
  if (grouped) sources.group_status = [parts = p.get()](auto* reply) { FillGroupStatus(*parts, reply); };
  if (p->replicator) {
    sources.replicated = [replicator = p->replicator.get()](const std::string& job, uint64_t step) {
      return replicator->Replicated(job, step);
    };
  }
  sources.remote = p->remote.get();
  if (p->uploader) sources.upload_status = [parts = p.get()](auto* reply) { FillUploadStatus(*parts, reply); };

  AdminExposure on_socket;
  on_socket.peers = &p->peers;
  on_socket.owners = p->owners.get();
  p->admin_service = std::make_unique<AdminService>(p->config, sources, on_socket);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  // The Unix socket's server has no port of its own: the listener hands it each connection
  // whose peer it has checked. Trainers are served only here.
  grpc::ServerBuilder builder;
  builder.SetMaxReceiveMessageSize(64 << 20);
  builder.SetMaxSendMessageSize(64 << 20);
  // Bounded threads and memory for everything this server reads and runs: a call beyond
  // them is RESOURCE_EXHAUSTED, never a daemon out of memory or threads. Wait and Restore,
  // which hold a thread for long, have per-user bounds of their own (TrainerService) well
  // below the thread bound, so short calls always find a thread.
  grpc::ResourceQuota quota("ckptd-unix");
  quota.SetMaxThreads(kUnixServerThreads);
  quota.Resize(kUnixServerMemoryBytes);
  builder.SetResourceQuota(quota);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, 64);  // per connection
  builder.RegisterService(p->trainer_service.get());
  builder.RegisterService(p->admin_service.get());
  p->grpc_server = builder.BuildAndStart();
  if (!p->grpc_server) return absl::InternalError("gRPC server failed to start");
  if (!config.admin_addr.empty()) {
    // A server of its own with only the admin service: nothing a trainer calls is
    // reachable over TCP, where peers cannot be checked.
    AdminExposure tcp;
    tcp.over_tcp = true;
    if (!config.admin_token_file.empty()) {
      CKPT_ASSIGN_OR_RETURN(tcp.token, ReadToken(config.admin_token_file,
                                                 "--admin-token-file"));
    }
    p->tcp_admin_service = std::make_unique<AdminService>(p->config, sources, std::move(tcp));
    grpc::ServerBuilder tcp_builder;
    int admin_port = 0;
    tcp_builder.AddListeningPort(config.admin_addr, grpc::InsecureServerCredentials(), &admin_port);
    tcp_builder.SetMaxReceiveMessageSize(1 << 20);
    tcp_builder.RegisterService(p->tcp_admin_service.get());
    p->tcp_admin_server = tcp_builder.BuildAndStart();
    if (!p->tcp_admin_server || admin_port == 0) {
      return absl::UnavailableError(fmt::format("cannot listen on --admin-addr {}", config.admin_addr));
    }
    log.info("admin API on {} (port {}); delete {}", config.admin_addr, admin_port,
             config.admin_token_file.empty() ? "refused over TCP (no --admin-token-file)"
                                             : "needs the admin token");
  }
  std::vector<grpc::Server*> servers = {p->grpc_server.get()};
  if (p->tcp_admin_server) servers.push_back(p->tcp_admin_server.get());
  p->health = std::make_unique<HealthReporter>(servers, [parts = p.get()] { return NotReadyReason(*parts); });
  PeerPolicy policy{::geteuid(), ::getegid(), config.allow_uids, config.allow_gids, config.max_connections_per_uid};
  CKPT_ASSIGN_OR_RETURN(p->control_fds, ControlFdServer::Start(DescriptorSocketPath(config.socket),
                                                               p->sessions, p->arenas, policy));
  if (!config.metrics_addr.empty()) {
    NodeFigureSources figures{*p->pool, *p->ledger, p->sessions, p->last_commits,
                              [parts = p.get()](const auto& commits, auto* reply) {
                                FillScrapeStatus(*parts, commits, reply);
                              },
                              p->quota.get()};
    CKPT_ASSIGN_OR_RETURN(p->metrics_http,
                          metrics::HttpExporter::Start(config.metrics_addr, [figures] {
                            metrics::Exposition out;
                            metrics::Metrics().registry.Render(out);
                            CollectNodeFigures(figures, out);
                            return out.Take();
                          }));
    log.info("metrics at http://{}:{}/metrics", config.metrics_addr.substr(0, config.metrics_addr.rfind(':')),
             p->metrics_http->port());
  }
  CKPT_RETURN_IF_ERROR(p->listener->Serve(p->grpc_server.get(), policy, p->peers));
  if (const char* fault = std::getenv("CKPTD_FAULT");
      fault != nullptr && std::string(fault).rfind("wedge-sessions-while:", 0) == 0) {
    log.warn("CKPTD_FAULT={}: the sessions are wedged while that file exists (a test's fault)", fault);
    p->wedge = std::make_unique<WedgeFault>(p->sessions, std::string(fault).substr(21));
  }
  log.info("listening on {} (mode 0660); checkpoints under {}", config.socket, config.root);
  return std::unique_ptr<Server>(new Server(std::move(p)));
}

bool Server::WaitReady(std::chrono::milliseconds timeout, std::string* waiting_for) const {
  const Parts& p = *parts_;
  if (!p.group_member) return true;
  if (p.group_member->WaitJoined(timeout)) return true;
  if (waiting_for != nullptr) {
    group::GroupMember::State state = p.group_member->state();
    *waiting_for = fmt::format("joining the group at {} as node {} of {}{}{}", p.config.coordinator,
                               p.config.node_rank, p.config.num_nodes, state.last_error.empty() ? "" : ": ",
                               state.last_error);
  }
  return false;
}

void Server::StartWatchdog(std::chrono::microseconds interval, Watchdog::Notify notify) {
  Parts& p = *parts_;
  // A sessions' ticker that has not beaten this long is stalled (it beats every 100 ms).
  const auto ticker_bound = std::max<std::chrono::nanoseconds>(interval, std::chrono::seconds(2));
  std::vector<LivenessProbe> probes;
  probes.push_back({"sessions", [&p, ticker_bound]() -> absl::Status {
                      (void)p.sessions.All();  // the lock registrations and snapshots take
                      const auto since = p.sessions.SinceLastTick();
                      if (since > ticker_bound) {
                        return absl::UnavailableError(fmt::format(
                            "the sessions' heartbeat ticker has not run for {} ms",
                            std::chrono::duration_cast<std::chrono::milliseconds>(since).count()));
                      }
                      return absl::OkStatus();
                    }});
  probes.push_back({"staging", [&p] {
                      (void)p.hot->Steps();  // the hot copies' lock, which staging and restores take
                      return absl::OkStatus();
                    }});
  probes.push_back({"persist", [&p] {
                      (void)p.writes->Pending();  // the write queue's lock
                      return absl::OkStatus();
                    }});
  probes.push_back({"commit", [&p] {
                      (void)p.committer->InFlight();  // the committer's lock
                      return absl::OkStatus();
                    }});
  // The trainers' socket as a trainer reaches it: accepted, its peer checked, a gRPC thread
  // to answer. Any answer counts (a node waiting for its group says NOT_SERVING).
  auto channel = grpc::CreateChannel("unix:" + p.config.socket, grpc::InsecureChannelCredentials());
  auto health = std::shared_ptr<grpc::health::v1::Health::Stub>(grpc::health::v1::Health::NewStub(channel));
  probes.push_back({"control", [health, interval]() -> absl::Status {
                      grpc::ClientContext context;
                      context.set_deadline(std::chrono::system_clock::now() + interval);
                      grpc::health::v1::HealthCheckResponse response;
                      grpc::Status s = health->Check(&context, grpc::health::v1::HealthCheckRequest(), &response);
                      if (!s.ok()) {
                        return absl::UnavailableError(
                            fmt::format("the trainers' socket did not answer a health check: {}", s.error_message()));
                      }
                      return absl::OkStatus();
                    }});
  log::Get(log::Component::kMain)
      .info("systemd watchdog: WATCHDOG=1 every {} ms while the sessions, staging, persist, commit and the "
            "trainers' socket answer",
            std::chrono::duration_cast<std::chrono::milliseconds>(interval).count());
  p.watchdog = std::make_unique<Watchdog>(interval, std::move(probes), std::move(notify));
}

void Server::Shutdown() {
  Parts& p = *parts_;
  if (p.shut_down) return;
  p.shut_down = true;
  // The stages are going: the watchdog stops asking them, and pings until the end.
  if (p.watchdog) p.watchdog->StopProbing();
  // What reads the other parts from threads of its own (scrapes, the health thread) stops
  // before any of them goes.
  p.metrics_http.reset();
  p.health.reset();
  auto& log = log::Get(log::Component::kMain);
  log.info("shutting down: new snapshots are refused; finishing in-flight writes (up to {} ms)",
           p.config.shutdown_timeout_ms);
  p.sessions.RefuseNewSnapshots();
  p.listener->Stop();
  p.control_fds->Stop();
  // A restore waiting at the barrier for ranks that never come would hold the gRPC
  // shutdown for up to --restore-timeout.
  p.agreement->Cancel("ckptd is shutting down");
  if (p.tcp_admin_server) {
    p.tcp_admin_server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  }
  p.grpc_server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  p.writes->Shutdown(std::chrono::milliseconds(p.config.shutdown_timeout_ms));
  p.committer->Shutdown();
  // Before the group's view goes: the replicator asks it who its holders are.
  if (p.replicator) p.replicator->Stop();
  p.group_member.reset();
  if (p.group_server) p.group_server->Shutdown();
  if (p.fetch_server) p.fetch_server->Stop();
  // Direct mode: writes to the bucket that outlived their shutdown timeout above end now
  // rather than wait out a gateway that stopped answering.
  p.store->objects().Cancel();
  if (p.uploader) p.uploader->Stop();  // an upload in progress resumes at the next start
  // Questions about owners and listings still waiting on a store or the peers end (the
  // remote tier is cancelled first), before either goes.
  p.owners->Stop();
  p.admin_service->Stop();
  if (p.tcp_admin_service) p.tcp_admin_service->Stop();
  p.retention->Stop();
  if (p.remote_retention) p.remote_retention->Stop();
  p.hot->Clear();
  p.sessions.Clear();
  p.watchdog.reset();
  log.info("shut down cleanly");
}

}  // namespace ckpt::daemon
