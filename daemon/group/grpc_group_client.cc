// GroupClient over gRPC: one channel to the coordinator, one to the parent relay.
#include <fmt/format.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include "common/log.h"
#include "common/status.h"
#include "daemon/group/gather_merger.h"
#include "daemon/group/group_client.h"
#include "daemon/group/grpc_util.h"
#include "daemon/group/part_values_proto.h"
#include "daemon/group/relay.h"
#include "daemon/group/relay_tree.h"
#include "format/part_structure.h"
#include "proto/group.grpc.pb.h"

namespace ckpt::group {
namespace {

namespace pb = ckptd::group::v1;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

spdlog::logger& Log() { return log::Get(log::Component::kGroup); }

constexpr int kMaxMessageBytes = 64 << 20;
constexpr milliseconds kFirstBackoff{100};
constexpr milliseconds kPeerConnectTimeout{5'000};
constexpr milliseconds kMaxBackoff{2'000};

Outcome FromProto(pb::Outcome outcome) {
  switch (outcome) {
    case pb::OUTCOME_PENDING: return Outcome::kPending;
    case pb::OUTCOME_COMMITTED: return Outcome::kCommitted;
    case pb::OUTCOME_ABORTED: return Outcome::kAborted;
    default: return Outcome::kUnknown;
  }
}

MemberState FromProto(pb::MemberState state) {
  switch (state) {
    case pb::MEMBER_ALIVE: return MemberState::kAlive;
    case pb::MEMBER_LOST: return MemberState::kLost;
    default: return MemberState::kWaiting;
  }
}

// The members as this node last heard them: heartbeat replies carry only the changes.
class KnownMembers {
 public:
  // Applies the members of `view` (all of them, or the changes) and returns every member.
  // One not in this reply has no age (-1): only the coordinator knows how fresh it is.
  std::vector<MemberView> Apply(const pb::GroupView& view) {
    std::lock_guard lock(mu_);
    if (view.members_complete()) members_.clear();
    for (auto& [node, m] : members_) m.last_heartbeat_age_s = -1;
    for (const pb::Member& m : view.members()) {
      members_[m.node_rank()] = {m.node_rank(), m.address(), FromProto(m.state()), m.last_heartbeat_age_s(),
                                 m.incarnation(), m.failure_domain()};
    }
    version_ = view.members_version();
    std::vector<MemberView> out;
    out.reserve(members_.size());
    for (const auto& [node, m] : members_) out.push_back(m);
    return out;
  }
  uint64_t version() const {
    std::lock_guard lock(mu_);
    return version_;
  }
  // Where `node` listens, while it is alive as far as this node knows; empty otherwise.
  std::string AliveAddress(uint32_t node) const {
    std::lock_guard lock(mu_);
    auto it = members_.find(node);
    if (it == members_.end() || it->second.state != MemberState::kAlive) return "";
    return it->second.address;
  }

 private:
  mutable std::mutex mu_;
  std::map<uint32_t, MemberView> members_;
  uint64_t version_ = 0;
};

GroupViewData FromProto(const pb::GroupView& view, KnownMembers& known) {
  GroupViewData data;
  data.members = known.Apply(view);
  for (const pb::StepInFlight& s : view.steps()) {
    data.steps.push_back({s.job(), s.step(), s.world_size(),
                          {s.missing_ranks().begin(), s.missing_ranks().end()}, s.age_s()});
  }
  for (const pb::JobCommitted& c : view.committed()) data.committed[c.job()] = c.step();
  for (const pb::JobUploading& u : view.uploading()) data.uploading[u.job()] = u.step();
  return data;
}

std::shared_ptr<grpc::ChannelCredentials> Credentials(const GroupOptions& options) {
  if (!options.tls()) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = options.tls_ca_pem;
  ssl.pem_private_key = options.tls_key_pem;
  ssl.pem_cert_chain = options.tls_cert_pem;
  return grpc::SslCredentials(ssl);
}

grpc::ChannelArguments ChannelArgs(const GroupOptions& options) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  args.SetMaxSendMessageSize(kMaxMessageBytes);
  // Pings find a dead coordinator (or a silently dropped connection) within about the
  // group timeout even between calls. The server accepts pings this frequent.
  int keepalive_ms = static_cast<int>(
      std::max<milliseconds>(options.group_timeout / 2, milliseconds(1'000)).count());
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, keepalive_ms);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, keepalive_ms);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  // Reconnect quickly once the coordinator is back (the default backs off to 2 min).
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, static_cast<int>(kMaxBackoff.count()));
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, static_cast<int>(kFirstBackoff.count()));
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, static_cast<int>(kFirstBackoff.count()));
  // A private connection: two clients in one process (tests, or a node that is also the
  // coordinator) must not share a subchannel's fate.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return args;
}

}  // namespace

std::shared_ptr<grpc::Channel> MakePeerChannel(const GroupOptions& options, const std::string& address) {
  grpc::ChannelArguments args = ChannelArgs(options);
  // gRPC's minimum reconnect backoff is also how long one connection attempt may take: the
  // group's 100 ms cut first handshakes short on a loaded machine (seen under TSan). A peer
  // is called rarely and for long; give its handshake time.
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, static_cast<int>(kPeerConnectTimeout.count()));
  return grpc::CreateCustomChannel(address, Credentials(options), args);
}

namespace {

// Calls in flight that shutdown must be able to end (long polls, gathers, forwards).
class CallSet {
 public:
  // False once cancelled: the call must not start.
  bool Add(grpc::ClientContext* ctx) {
    std::lock_guard lock(mu_);
    if (!cancelled_.empty()) return false;
    calls_.insert(ctx);
    return true;
  }
  // The reason, once cancelled (the call's own status is then only "cancelled").
  std::string Remove(grpc::ClientContext* ctx) {
    std::lock_guard lock(mu_);
    calls_.erase(ctx);
    return cancelled_;
  }
  std::string cancelled() const {
    std::lock_guard lock(mu_);
    return cancelled_;
  }
  void CancelAll(const std::string& why) {
    std::lock_guard lock(mu_);
    cancelled_ = why.empty() ? "cancelled" : why;
    for (grpc::ClientContext* ctx : calls_) ctx->TryCancel();
    cancel_cv_.notify_all();
  }
  // Waits `pause` between two tries of a call; false (at once) once cancelled.
  bool Pause(Clock::duration pause) {
    std::unique_lock lock(mu_);
    return !cancel_cv_.wait_for(lock, pause, [&] { return !cancelled_.empty(); });
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable cancel_cv_;
  std::set<grpc::ClientContext*> calls_;
  std::string cancelled_;
};

// A parent relay that failed a call is passed over for this long: its nodes call the
// coordinator meanwhile, and try it again after.
constexpr std::chrono::seconds kParentRetryAfter{30};

class GrpcGroupClient final : public GroupClient, public RelayUpstream {
 public:
  GrpcGroupClient(const GroupOptions& options, uint64_t incarnation, std::string address)
      : options_(options),
        incarnation_(incarnation),
        address_(std::move(address)),
        parent_(RelayParent(options.node_rank, options.relay_fanout).value_or(0)),
        stub_(pb::Group::NewStub(grpc::CreateCustomChannel(options.coordinator,
                                                           Credentials(options),
                                                           ChannelArgs(options)))) {}
  ~GrpcGroupClient() override {
    gathers_.CancelAll("the group client is closing");
    own_gathers_.Stop("the group client is closing");
  }

  absl::StatusOr<GroupViewData> Join(Clock::time_point deadline) override {
    pb::JoinRequest request;
    request.set_node_rank(options_.node_rank);
    request.set_num_nodes(options_.num_nodes);
    request.set_address(address_);
    request.set_incarnation(incarnation_);
    request.set_failure_domain(options_.failure_domain);
    milliseconds backoff = kFirstBackoff;
    while (true) {
      grpc::ClientContext ctx;
      StartCall(ctx, std::min(deadline, Clock::now() + options_.rpc_timeout));
      pb::JoinReply reply;
      grpc::Status status = stub_->Join(&ctx, request, &reply);
      if (status.ok()) return FromProto(reply.view(), members_);
      bool unreachable = status.error_code() == grpc::StatusCode::UNAVAILABLE ||
                         status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
      if (!unreachable) return Describe("join", status);
      if (Clock::now() + backoff >= deadline) {
        return absl::UnavailableError(fmt::format(
            "could not reach the group coordinator at {} to join: {}", options_.coordinator,
            status.error_message()));
      }
      std::this_thread::sleep_for(backoff);
      backoff = std::min(backoff * 2, kMaxBackoff);
    }
  }

  absl::StatusOr<GroupViewData> Heartbeat() override {
    pb::HeartbeatRequest request;
    request.set_node_rank(options_.node_rank);
    request.set_incarnation(incarnation_);
    request.set_known_members_version(members_.version());
    pb::HeartbeatReply reply;
    CKPT_RETURN_IF_ERROR(Describe("heartbeat", CallHeartbeat(request, &reply)));
    return FromProto(reply.view(), members_);
  }

  absl::StatusOr<Decision> Prepare(const format::Manifest& part, uint64_t attempt) override {
    format::SplitResult split = format::SplitPart(part);
    const std::string& digest = split.structure->digest;
    // Once the coordinator holds this part's structure, only the step's values go: a
    // coordinator that lost it (restarted, or dropped it) asks, and the whole part follows.
    bool known = KnowsStructure(digest);
    for (int asked = 0;; ++asked) {
      pb::PrepareRequest request;
      request.set_node_rank(options_.node_rank);
      request.set_incarnation(incarnation_);
      request.set_job(part.job);
      request.set_step(part.step);
      request.set_world_size(part.world_size);
      for (const format::ManifestShard& s : part.shards) request.add_ranks(s.rank);
      if (!known) {
        std::string text = format::ManifestToJson(part);
        if (text.size() > options_.inline_part_bytes) {
          // Too large for one message (or a relay's batch): the part goes first, in chunks.
          CKPT_RETURN_IF_ERROR(PutStructure(digest, text));
          known = true;
        } else {
          request.set_manifest_part_json(std::move(text));
        }
      }
      const bool withheld = known && WithholdsChecksums(part.job);
      if (known) {
        request.set_structure_digest(digest);
        ToProto(withheld ? split.values.WithChecksumsWithheld() : split.values, request.mutable_values());
      }
      request.set_attempt(attempt);
      pb::PrepareReply reply;
      CKPT_RETURN_IF_ERROR(Describe("prepare", CallPrepare(request, &reply)));
      if (reply.need_structure()) {
        // Asked again after an upload: the structure was dropped in between (a new
        // combination met a summary); once more, then the step is retried later.
        if (!request.manifest_part_json().empty() || asked > 1) {
          return absl::InternalError("group prepare: the coordinator asked for a structure it was sent");
        }
        ForgetStructure(digest);
        known = false;
        continue;
      }
      RememberStructure(digest);
      NoteChecksumsUse(part.job, reply.outcome(), reply.committed());
      // Refused without them (a coordinator restarted on a shared root, or older): the
      // next attempt sends every checksum.
      if (withheld && reply.outcome() == pb::OUTCOME_ABORTED) SetWithholding(part.job, false);
      return FromReply(reply.outcome(), reply.reason(), reply.manifest_json(), reply.committed());
    }
  }

  absl::Status Abort(const std::string& job, uint64_t step, uint64_t attempt, uint64_t run,
                     const std::string& reason) override {
    pb::AbortRequest request;
    request.set_node_rank(options_.node_rank);
    request.set_incarnation(incarnation_);
    request.set_attempt(attempt);
    request.set_run(run);
    request.set_job(job);
    request.set_step(step);
    request.set_reason(reason);
    grpc::ClientContext ctx;
    StartCall(ctx, Clock::now() + options_.rpc_timeout);
    pb::AbortReply reply;
    return Describe("abort", stub_->Abort(&ctx, request, &reply));
  }

  absl::StatusOr<Decision> GetOutcome(const std::string& job, uint64_t step, milliseconds wait,
                                      bool whole_manifest, uint64_t attempt) override {
    pb::OutcomeRequest request;
    request.set_job(job);
    request.set_step(step);
    request.set_attempt(attempt);
    request.set_wait_ms(static_cast<uint32_t>(std::clamp<int64_t>(wait.count(), 0, UINT32_MAX)));
    request.set_node_rank(options_.node_rank);
    request.set_whole_manifest(whole_manifest);
    pb::OutcomeReply reply;
    CKPT_RETURN_IF_ERROR(Describe("outcome", CallOutcome(request, &reply)));
    NoteChecksumsUse(job, reply.outcome(), reply.committed());
    return FromReply(reply.outcome(), reply.reason(), reply.manifest_json(), reply.committed());
  }

  absl::StatusOr<std::vector<std::string>> Gather(const std::string& key, uint32_t participant,
                                                  uint32_t participants, std::string payload,
                                                  milliseconds timeout) override {
    CKPT_ASSIGN_OR_RETURN(pb::GatherReply reply,
                          CallGather(key, participant, participants, std::move(payload), timeout, false));
    return std::vector<std::string>(reply.payloads().begin(), reply.payloads().end());
  }

  // This node's ranks' arrivals are merged (GatherMerger) and go up through the relay tree.
  absl::StatusOr<GatherTable::Distinct> GatherDistinct(const std::string& key, uint32_t participant,
                                                       uint32_t participants, std::string payload,
                                                       milliseconds timeout) override {
    struct Waiting {
      std::mutex mu;
      std::condition_variable cv;
      std::optional<absl::StatusOr<GatherTable::Distinct>> answer;
    };
    auto waiting = std::make_shared<Waiting>();
    std::vector<GatherTable::Sent> sent;
    sent.push_back({payload, {participant}});
    absl::Status merged = own_gathers_.Arrive(
        key, participants, std::move(sent), Clock::now() + timeout,
        [waiting](absl::StatusOr<GatherTable::Distinct> answer) {
          std::lock_guard lock(waiting->mu);
          waiting->answer = std::move(answer);
          waiting->cv.notify_all();
        });
    if (!merged.ok()) {
      // Stopping, or too many merges held: the rank's own call, straight to the coordinator.
      if (std::string why = gathers_.cancelled(); !why.empty()) return absl::UnavailableError(why);
      CKPT_ASSIGN_OR_RETURN(pb::GatherReply reply,
                            CallGather(key, participant, participants, std::move(payload), timeout, true));
      return DistinctOf(key, reply);
    }
    // The merge answers by the gather's deadline and the call's; the margin is for a merger
    // that could not (it is stopping, or its thread was starved).
    std::unique_lock lock(waiting->mu);
    const auto bound = Clock::now() + timeout + 2 * options_.rpc_timeout + std::chrono::seconds(5);
    if (!waiting->cv.wait_until(lock, bound, [&] { return waiting->answer.has_value(); })) {
      return absl::DeadlineExceededError(fmt::format("group gather {}: no answer from this node's merge", key));
    }
    return std::move(*waiting->answer);
  }

  absl::StatusOr<bool> DecideSave(const daemon::SaveQuestion& question) override {
    pb::SaveDecisionRequest request;
    request.set_job(question.job);
    request.set_run(question.run);
    request.set_step(question.step);
    request.set_interval_ms(
        static_cast<uint32_t>(std::clamp<int64_t>(question.interval.count(), 0, UINT32_MAX)));
    request.set_node_rank(options_.node_rank);
    grpc::ClientContext ctx;
    StartCall(ctx, Clock::now() + options_.rpc_timeout);
    pb::SaveDecisionReply reply;
    CKPT_RETURN_IF_ERROR(Describe("save decision", stub_->DecideSave(&ctx, request, &reply)));
    return reply.save();
  }

  void CancelGathers(const std::string& why) override { gathers_.CancelAll(why); }

  // ---- RelayUpstream: this node's relay forwards through its own parent ----

  absl::StatusOr<pb::PrepareBatchReply> ForwardPrepares(const pb::PrepareBatchRequest& batch) override {
    return ForwardBatch(batch, &pb::Group::Stub::PrepareBatch, "relayed prepares", ForwardBudget(options_.rpc_timeout));
  }

  absl::StatusOr<pb::HeartbeatBatchReply> ForwardHeartbeats(const pb::HeartbeatBatchRequest& batch) override {
    return ForwardBatch(batch, &pb::Group::Stub::HeartbeatBatch, "relayed heartbeats",
                        ForwardBudget(HeartbeatDeadline()));
  }

  absl::StatusOr<pb::OutcomeReply> ForwardOutcome(const pb::OutcomeRequest& request) override {
    pb::OutcomeReply reply;
    grpc::Status status = Forward([&](pb::Group::Stub& stub, grpc::ClientContext& ctx) {
      reply.Clear();  // nothing of a failed try
      StartCall(ctx, Clock::now() + milliseconds(request.wait_ms()) + ForwardBudget(options_.rpc_timeout));
      return stub.GetOutcome(&ctx, request, &reply);
    });
    CKPT_RETURN_IF_ERROR(Describe("relayed outcome", status));
    return reply;
  }

  absl::StatusOr<GatherTable::Distinct> ForwardGather(const std::string& key, uint32_t participants,
                                                      const std::vector<GatherTable::Sent>& sent,
                                                      Clock::time_point deadline) override {
    return SendGather(forwards_, key, participants, sent, deadline);
  }

  void CancelForwards(const std::string& why) override { forwards_.CancelAll(why); }
  RelayUpstream* relay_upstream() override { return this; }
  uint64_t relay_bypasses() const override { return relay_bypasses_.load(std::memory_order_relaxed); }

 private:
  // Every call: a deadline and the token.
  void StartCall(grpc::ClientContext& ctx, Clock::time_point deadline) const {
    // gRPC takes wall-clock deadlines only.
    auto left = std::chrono::duration_cast<std::chrono::system_clock::duration>(deadline - Clock::now());
    ctx.set_deadline(std::chrono::system_clock::now() + left);
    ctx.AddMetadata(kTokenMetadata, options_.token);
  }

  // The coordinator's status with the call named; codes are kept so that callers can
  // tell "join again" (FailedPrecondition) from "unreachable" (Unavailable).
  absl::Status Describe(const std::string& call, const grpc::Status& status) const {
    if (status.ok()) return absl::OkStatus();
    if (status.error_code() == grpc::StatusCode::UNAUTHENTICATED) {
      return absl::UnauthenticatedError(fmt::format(
          "group {}: the coordinator at {} refused this node's group token ({})", call,
          options_.coordinator, status.error_message()));
    }
    return Annotate(FromGrpc(status), fmt::format("group {} at {}", call, options_.coordinator));
  }

  // A decision as this node heard it: a commit's header and this node's share, and the
  // whole manifest when it was sent.
  Decision FromReply(pb::Outcome outcome, const std::string& reason, const std::string& manifest_json,
                     const pb::CommittedStep& c) const {
    Decision d{FromProto(outcome), reason, nullptr};
    if (d.outcome != Outcome::kCommitted) return d;
    auto step = std::make_shared<CommittedStep>();
    step->manifest_json = manifest_json;
    step->header = {c.world_size(), c.nodes(), c.step_bytes(), c.step_tensors(), c.digest(), c.run(),
                    c.unix_time(), c.wall_time(), {c.metadata().begin(), c.metadata().end()},
                    c.incremental(), c.own_bytes(), c.referenced_bytes()};
    step->shares[options_.node_rank] = {c.node_ranks(), c.node_bytes(), c.node_attempt(), c.node_run()};
    d.committed = std::move(step);
    return d;
  }

  // Sends a part's text to the coordinator in chunks, straight (not through a relay: it
  // happens once per structure, and a relay would hold it whole).
  absl::Status PutStructure(const std::string& digest, const std::string& text) {
    // One upload at a time from this daemon: the coordinator takes few per node.
    std::lock_guard uploading(upload_mu_);
    const size_t chunk = std::max<size_t>(options_.structure_chunk_bytes, 1);
    for (size_t offset = 0; offset < text.size(); offset += chunk) {
      pb::StructureChunk request;
      request.set_node_rank(options_.node_rank);
      request.set_incarnation(incarnation_);
      request.set_structure_digest(digest);
      request.set_total_bytes(text.size());
      request.set_offset(offset);
      request.set_data(text.substr(offset, chunk));
      grpc::ClientContext ctx;
      StartCall(ctx, Clock::now() + options_.rpc_timeout);
      pb::StructureChunkReply reply;
      CKPT_RETURN_IF_ERROR(Describe("prepare: sending the part's structure", stub_->PutStructure(&ctx, request, &reply)));
      if (offset + chunk >= text.size() && !reply.complete()) {
        return absl::InternalError("group prepare: the coordinator did not take the part's last chunk as its last");
      }
    }
    return absl::OkStatus();
  }

  std::mutex upload_mu_;

  bool KnowsStructure(const std::string& digest) const {
    std::lock_guard lock(structures_mu_);
    return std::find(structures_.begin(), structures_.end(), digest) != structures_.end();
  }
  void RememberStructure(const std::string& digest) {
    std::lock_guard lock(structures_mu_);
    if (std::find(structures_.begin(), structures_.end(), digest) != structures_.end()) return;
    structures_.push_back(digest);
    if (structures_.size() > kKnownStructures) structures_.pop_front();
  }
  void ForgetStructure(const std::string& digest) {
    std::lock_guard lock(structures_mu_);
    std::erase(structures_, digest);
  }

  // Jobs whose checksums the coordinator said it keeps none of (CommittedStep
  // .checksums_unused), as its last commit of each said: their prepares send only a count.
  bool WithholdsChecksums(const std::string& job) const {
    std::lock_guard lock(structures_mu_);
    return std::find(checksums_unused_.begin(), checksums_unused_.end(), job) != checksums_unused_.end();
  }
  void NoteChecksumsUse(const std::string& job, pb::Outcome outcome, const pb::CommittedStep& c) {
    if (outcome == pb::OUTCOME_COMMITTED) SetWithholding(job, c.checksums_unused());
  }
  void SetWithholding(const std::string& job, bool withhold) {
    std::lock_guard lock(structures_mu_);
    std::erase(checksums_unused_, job);
    if (!withhold) return;
    checksums_unused_.push_back(job);
    if (checksums_unused_.size() > kKnownStructures) checksums_unused_.pop_front();
  }
  std::deque<std::string> checksums_unused_;  // guarded by structures_mu_

  // Structures of this node's parts the coordinator acknowledged, newest last: a job's
  // part has one; a few jobs, or a changed layout, a few more.
  static constexpr size_t kKnownStructures = 16;
  mutable std::mutex structures_mu_;
  std::deque<std::string> structures_;

  absl::StatusOr<pb::GatherReply> CallGather(const std::string& key, uint32_t participant, uint32_t participants,
                                             std::string payload, milliseconds timeout, bool distinct) {
    pb::GatherRequest request;
    request.set_key(key);
    request.set_participant(participant);
    request.set_participants(participants);
    request.set_payload(std::move(payload));
    request.set_distinct(distinct);
    pb::GatherReply reply;
    const auto deadline = Clock::now() + timeout;
    CKPT_RETURN_IF_ERROR(ToCoordinator(gathers_, key, deadline, [&](grpc::ClientContext& ctx) {
      reply.Clear();  // nothing of a failed try
      request.set_timeout_ms(static_cast<uint32_t>(std::clamp<int64_t>(Left(deadline).count(), 1, UINT32_MAX)));
      // The coordinator expires the round first and names who is missing; our deadline is
      // only for a coordinator that does not answer at all.
      StartCall(ctx, deadline + options_.rpc_timeout);
      return Tracked(gathers_, ctx, [&] { return stub_->Gather(&ctx, request, &reply); });
    }));
    return reply;
  }

  static milliseconds Left(Clock::time_point deadline) {
    return std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
  }

  // Whether a call failed because the coordinator is not there: no connection, one lost
  // mid-call (it was killed), or a coordinator shutting down (it fails the gathers it holds
  // with UNAVAILABLE, its server cancels the calls left).
  static bool CoordinatorAway(const grpc::Status& status) {
    return status.error_code() == grpc::StatusCode::UNAVAILABLE || status.error_code() == grpc::StatusCode::CANCELLED;
  }

  // A gather's call to the coordinator, `attempt(ctx)` being one try, tried again while the
  // coordinator is away (CoordinatorAway) until the gather's `deadline`: a coordinator that
  // restarts has forgotten the arrivals it held, so each try arrives anew, and the round
  // completes once every participant reached the coordinator that is up. At the deadline it
  // fails with one message, the same on every rank and node, so that the ranks of a job
  // (a restore's) fail together and alike rather than one at once and the others after
  // waiting out the gather. Ends early, with the reason, when `calls` are cancelled.
  template <typename Attempt>
  absl::Status ToCoordinator(CallSet& calls, const std::string& key, Clock::time_point deadline, Attempt attempt) {
    milliseconds backoff = kFirstBackoff;
    for (int tries = 1;; ++tries) {
      grpc::ClientContext ctx;
      grpc::Status status = attempt(ctx);
      if (std::string why = calls.cancelled(); !why.empty()) return absl::UnavailableError(why);
      if (status.ok() || !CoordinatorAway(status)) return Describe("gather " + key, status);
      const milliseconds left = Left(deadline);
      if (left.count() <= 0) {
        Log().warn("node {}: gather {}: the coordinator at {} was still away at the gather's deadline, after {} tries "
                   "(last: {})", options_.node_rank, key, options_.coordinator, tries, status.error_message());
        return absl::UnavailableError(fmt::format(
            "group gather {}: the coordinator at {} could not be reached before the gather's deadline (it is down "
            "or restarting)", key, options_.coordinator));
      }
      if (tries == 1) {
        Log().warn("node {}: gather {}: the coordinator at {} is away ({}); trying again for up to {} ms",
                   options_.node_rank, key, options_.coordinator, status.error_message(), left.count());
      }
      if (!calls.Pause(std::min(backoff, left))) return absl::UnavailableError(calls.cancelled());
      backoff = std::min(backoff * 2, kMaxBackoff);
    }
  }

  static absl::StatusOr<GatherTable::Distinct> DistinctOf(const std::string& key, const pb::GatherReply& reply) {
    GatherTable::Distinct d{{reply.payloads().begin(), reply.payloads().end()},
                            {reply.senders().begin(), reply.senders().end()},
                            {reply.counts().begin(), reply.counts().end()}};
    if (d.senders.size() != d.payloads.size() || d.counts.size() != d.payloads.size()) {
      return absl::DataLossError(fmt::format("group gather {}: the distinct reply is malformed", key));
    }
    return d;
  }

  // Merged arrivals of a distinct gather (this node's ranks, or a relay's subtree) up to the
  // parent relay, and to the coordinator when there is none, it refused the arrival itself
  // (full, stopping) or it failed the call (then it is passed over for kParentRetryAfter, as
  // for prepares). An answer the relay passes on from the coordinator (a timeout naming who
  // is missing) is final: asking the coordinator again would only wait as long once more.
  // A gather waits for every participant, so no try has a shorter deadline than the
  // gather's: a relay that stalls rather than fails makes its subtree's ranks wait for the
  // gather's timeout (docs/architecture.md).
  absl::StatusOr<GatherTable::Distinct> SendGather(CallSet& calls, const std::string& key, uint32_t participants,
                                                   const std::vector<GatherTable::Sent>& sent,
                                                   Clock::time_point deadline) {
    pb::GatherRequest request;
    request.set_key(key);
    request.set_participants(participants);
    // Out of range for a coordinator older than merged arrivals, which then refuses the
    // call instead of reading it as participant 0's empty payload.
    request.set_participant(participants);
    request.set_distinct(true);
    for (const GatherTable::Sent& s : sent) {
      pb::GatherArrivals* a = request.add_merged();
      a->set_payload(s.payload);
      a->mutable_participants()->Add(s.participants.begin(), s.participants.end());
    }
    pb::GatherReply reply;
    // One try on `stub`, within what is left of the gather's deadline.
    auto call = [&](pb::Group::Stub& stub, grpc::ClientContext& ctx) {
      reply.Clear();  // nothing of a failed try
      request.set_timeout_ms(static_cast<uint32_t>(std::clamp<int64_t>(Left(deadline).count(), 1, UINT32_MAX)));
      StartCall(ctx, deadline + options_.rpc_timeout);
      return Tracked(calls, ctx, [&] { return stub.Gather(&ctx, request, &reply); });
    };
    if (auto parent = Parent()) {
      grpc::ClientContext ctx;
      grpc::Status status = call(*parent, ctx);
      if (std::string why = calls.cancelled(); !why.empty()) return absl::UnavailableError(why);
      if (status.ok()) return DistinctOf(key, reply);
      const auto& trailing = ctx.GetServerTrailingMetadata();
      if (trailing.count(kRelayedAnswerMetadata)) {
        // Final: node 0's answer, or the relay's own verdict that node 0 stayed away until the
        // deadline (ToCoordinator's, worded alike on every node: passed on as it is).
        return CoordinatorAway(status) ? FromGrpc(status) : Describe("gather " + key, status);
      }
      // The relay refused the arrival itself (full, stopping): node 0 takes it, and the relay
      // stays in use for the rest. Otherwise the relay failed the call.
      if (!trailing.count(kRelayRefusedMetadata)) ParentFailed(status);
    }
    CountBypass();
    CKPT_RETURN_IF_ERROR(ToCoordinator(calls, key, deadline, [&](grpc::ClientContext& ctx) { return call(*stub_, ctx); }));
    return DistinctOf(key, reply);
  }

  // ---- the relay tree ----

  // This node's parent relay, unless it has none (a child of node 0, or no tree), is not
  // alive as this node last heard, or failed a call in the last kParentRetryAfter.
  std::shared_ptr<pb::Group::Stub> Parent() {
    if (parent_ == 0) return nullptr;
    std::string address = members_.AliveAddress(parent_);
    std::lock_guard lock(parent_mu_);
    if (address.empty() || Clock::now() < parent_down_until_) return nullptr;
    if (address != parent_address_ || !parent_stub_) {
      parent_address_ = address;
      parent_stub_ = pb::Group::NewStub(grpc::CreateCustomChannel(address, Credentials(options_),
                                                                  ChannelArgs(options_)));
    }
    return parent_stub_;
  }

  // A call that went to the coordinator although this node has a parent relay (not known
  // alive yet, passed over after a failure, or refusing): what status reports as the calls
  // the tree did not carry.
  void CountBypass() {
    if (parent_ != 0) relay_bypasses_.fetch_add(1, std::memory_order_relaxed);
  }

  void ParentFailed(const grpc::Status& status) {
    std::string address;
    {
      std::lock_guard lock(parent_mu_);
      parent_down_until_ = Clock::now() + kParentRetryAfter;
      address = parent_address_;
    }
    Log().warn("node {}: its relay, node {} at {}, failed a call ({}): calling the coordinator for {} s",
               options_.node_rank, parent_, address, status.error_message(), kParentRetryAfter.count());
  }

  // `call(stub, ctx)` on the parent relay, and on the coordinator if the parent has none,
  // does not answer or fails: every relayed call is idempotent. Ends early on shutdown.
  template <typename Call>
  grpc::Status Forward(Call call) {
    if (auto parent = Parent()) {
      grpc::ClientContext ctx;
      grpc::Status status = Tracked(forwards_, ctx, [&] { return call(*parent, ctx); });
      if (status.ok() || !forwards_.cancelled().empty()) return status;
      ParentFailed(status);
    }
    CountBypass();
    grpc::ClientContext ctx;
    return Tracked(forwards_, ctx, [&] { return call(*stub_, ctx); });
  }

  // How long a relay's call up may take, per try (its parent, then the coordinator), when
  // the nodes below it wait `theirs` for it: both tries, and the batch in flight before
  // this one, within their deadline, so that a stalled parent does not make the nodes
  // below give up on a relay that is well.
  static milliseconds ForwardBudget(milliseconds theirs) { return std::max<milliseconds>(theirs / 4, milliseconds(50)); }
  // A heartbeat must reach the coordinator within the group timeout even when a relay
  // stalls: it waits for its relay a quarter of it at most.
  milliseconds HeartbeatDeadline() const {
    return std::min<milliseconds>(options_.rpc_timeout, options_.group_timeout / 4);
  }

  // A batch up through Forward, each try within `budget`.
  template <typename Request, typename Reply>
  absl::StatusOr<Reply> ForwardBatch(const Request& batch,
                                     grpc::Status (pb::Group::Stub::*method)(grpc::ClientContext*, const Request&, Reply*),
                                     const char* what, milliseconds budget) {
    Reply reply;
    grpc::Status status = Forward([&](pb::Group::Stub& stub, grpc::ClientContext& ctx) {
      reply.Clear();  // nothing of a failed try
      StartCall(ctx, Clock::now() + budget);
      return (stub.*method)(&ctx, batch, &reply);
    });
    CKPT_RETURN_IF_ERROR(Describe(what, status));
    return reply;
  }

  template <typename Fn>
  static grpc::Status Tracked(CallSet& set, grpc::ClientContext& ctx, Fn fn) {
    if (!set.Add(&ctx)) return grpc::Status(grpc::StatusCode::UNAVAILABLE, set.cancelled());
    grpc::Status status = fn();
    if (std::string why = set.Remove(&ctx); !why.empty()) return grpc::Status(grpc::StatusCode::UNAVAILABLE, why);
    return status;
  }

  // `item` as a batch of one to the parent relay, within `timeout`: the relayed status (a
  // refusal of the item included) once `take` found the item's answer in the reply; nullopt
  // when there is no parent, or it failed or answered malformed (it is then passed over,
  // and the caller asks the coordinator). A relayed answer is the coordinator's answer.
  template <typename BatchRequest, typename BatchReply, typename Item, typename Take>
  std::optional<grpc::Status> AsBatchOfOneToParent(
      const Item& item, Item* (BatchRequest::*add)(),
      grpc::Status (pb::Group::Stub::*method)(grpc::ClientContext*, const BatchRequest&, BatchReply*),
      milliseconds timeout, Take take) {
    auto parent = Parent();
    if (!parent) return std::nullopt;
    BatchRequest batch;
    *(batch.*add)() = item;
    BatchReply results;
    grpc::ClientContext ctx;
    StartCall(ctx, Clock::now() + timeout);
    grpc::Status status = ((*parent).*method)(&ctx, batch, &results);
    if (status.ok() && results.results_size() == 1) {
      const auto& result = results.results(0);
      if (result.code() != 0) return grpc::Status(static_cast<grpc::StatusCode>(result.code()), result.message());
      if (take(results)) return grpc::Status::OK;
    }
    ParentFailed(status.ok() ? grpc::Status(grpc::StatusCode::INTERNAL, "a malformed batch reply") : status);
    return std::nullopt;
  }

  // A prepare through the parent relay, or to the coordinator.
  grpc::Status CallPrepare(const pb::PrepareRequest& request, pb::PrepareReply* reply) {
    if (auto relayed = AsBatchOfOneToParent(request, &pb::PrepareBatchRequest::add_prepares,
                                            &pb::Group::Stub::PrepareBatch, options_.rpc_timeout,
                                            [&](pb::PrepareBatchReply& results) {
                                              reply->Swap(results.mutable_results(0)->mutable_reply());
                                              return true;
                                            })) {
      return *relayed;
    }
    CountBypass();
    grpc::ClientContext ctx;
    StartCall(ctx, Clock::now() + options_.rpc_timeout);
    return stub_->Prepare(&ctx, request, reply);
  }

  // A heartbeat through the parent relay, or to the coordinator. A stalled relay must not
  // cost this node its membership: it waits for its relay at most HeartbeatDeadline.
  grpc::Status CallHeartbeat(const pb::HeartbeatRequest& request, pb::HeartbeatReply* reply) {
    if (auto relayed = AsBatchOfOneToParent(
            request, &pb::HeartbeatBatchRequest::add_heartbeats, &pb::Group::Stub::HeartbeatBatch,
            HeartbeatDeadline(), [&](pb::HeartbeatBatchReply& results) {
              const uint32_t view = results.results(0).view();
              if (view >= static_cast<uint32_t>(results.views_size())) return false;
              reply->mutable_view()->Swap(results.mutable_views(static_cast<int>(view)));
              return true;
            })) {
      return *relayed;
    }
    CountBypass();
    grpc::ClientContext ctx;
    StartCall(ctx, Clock::now() + options_.rpc_timeout);
    return stub_->Heartbeat(&ctx, request, reply);
  }

  // An outcome poll through the parent relay, or to the coordinator (a whole manifest
  // always comes from the coordinator).
  grpc::Status CallOutcome(const pb::OutcomeRequest& request, pb::OutcomeReply* reply) {
    const auto deadline = Clock::now() + milliseconds(request.wait_ms()) + options_.rpc_timeout;
    if (auto parent = request.whole_manifest() ? nullptr : Parent()) {
      grpc::ClientContext ctx;
      StartCall(ctx, deadline);
      grpc::Status status = parent->GetOutcome(&ctx, request, reply);
      if (status.ok()) return status;
      ParentFailed(status);
      reply->Clear();
    }
    if (!request.whole_manifest()) CountBypass();
    grpc::ClientContext ctx;
    StartCall(ctx, deadline);
    return stub_->GetOutcome(&ctx, request, reply);
  }

  const GroupOptions options_;
  const uint64_t incarnation_;
  const std::string address_;
  const uint32_t parent_;  // 0: the coordinator itself
  std::atomic<uint64_t> relay_bypasses_{0};
  const std::unique_ptr<pb::Group::Stub> stub_;
  KnownMembers members_;
  CallSet gathers_;   // in flight, for CancelGathers
  CallSet forwards_;  // the relay's, for CancelForwards
  std::mutex parent_mu_;
  std::string parent_address_;
  std::shared_ptr<pb::Group::Stub> parent_stub_;
  Clock::time_point parent_down_until_{};
  // This node's ranks' distinct gathers, merged on their way up; last, so that it stops
  // (after the destructor cancelled its calls) before what its calls use is gone.
  GatherMerger own_gathers_{
      "this node's gathers",
      [this](const std::string& key, uint32_t participants, const std::vector<GatherTable::Sent>& sent,
             Clock::time_point deadline) { return SendGather(gathers_, key, participants, sent, deadline); },
      GatherMerger::Limits{}};
};

}  // namespace

absl::StatusOr<GroupClientPtr> MakeGrpcGroupClient(const GroupOptions& options,
                                                   uint64_t incarnation,
                                                   std::string advertised_address) {
  if (options.coordinator.empty()) {
    return absl::InvalidArgumentError("the group needs the coordinator's address");
  }
  if (options.token.empty()) {
    return absl::InvalidArgumentError("the group needs a group token (--group-token-file)");
  }
  if (options.tls() && (options.tls_key_pem.empty() || options.tls_ca_pem.empty())) {
    return absl::InvalidArgumentError(
        "group TLS needs a certificate, its key and the CA, all three");
  }
  if (incarnation == 0) return absl::InvalidArgumentError("incarnation 0 is reserved");
  return GroupClientPtr(
      std::make_unique<GrpcGroupClient>(options, incarnation, std::move(advertised_address)));
}

absl::Status Barrier(GroupClient& client, const std::string& key, uint32_t participant,
                     uint32_t participants, std::chrono::milliseconds timeout) {
  return client.Gather(key, participant, participants, "", timeout).status();
}

absl::StatusOr<std::string> Broadcast(GroupClient& client, const std::string& key,
                                      uint32_t participant, uint32_t participants, uint32_t root,
                                      std::string payload, std::chrono::milliseconds timeout) {
  if (root >= participants) {
    return absl::InvalidArgumentError(
        fmt::format("broadcast {}: root {} is not a participant (0..{})", key, root,
                    participants == 0 ? 0 : participants - 1));
  }
  // Only the root's payload travels: the others send nothing.
  CKPT_ASSIGN_OR_RETURN(std::vector<std::string> all,
                        client.Gather(key, participant, participants,
                                      participant == root ? std::move(payload) : std::string(),
                                      timeout));
  return std::move(all.at(root));
}

}  // namespace ckpt::group
