#include "daemon/group/group_service.h"

#include <fmt/format.h>

#include <algorithm>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <string_view>
#include <utility>
#include <vector>

#include "common/log.h"
#include "common/names.h"
#include "storage/secret.h"
#include "common/status.h"
#include "daemon/group/grpc_util.h"
#include "daemon/group/part_values_proto.h"
#include "daemon/group/relay_tree.h"
#include "format/manifest.h"
#include "format/part_structure.h"

namespace ckpt::group {
namespace {

namespace pb = ckptd::group::v1;
using Clock = std::chrono::steady_clock;

spdlog::logger& Log() { return log::Get(log::Component::kGroup); }

// Bounds on what a request may ask for: a hostile or confused peer cannot make the
// coordinator hold unbounded memory or time.
constexpr uint32_t kMaxWorldSize = 1u << 20;
constexpr uint32_t kMaxParticipants = 1u << 20;
constexpr size_t kMaxKeyBytes = 512;
constexpr size_t kMaxPayloadBytes = 1u << 20;
// Of a gather's merged arrivals, in all (GatherMerger's merges are at most 8 MiB, but for
// a single arrival larger than that).
constexpr size_t kMaxMergedBytes = size_t{16} << 20;
constexpr size_t kMaxAddressBytes = 256;
constexpr size_t kMaxReasonBytes = 4096;
constexpr std::chrono::milliseconds kMaxOutcomeWait{30'000};
constexpr size_t kMaxBatchItems = 1u << 16;
constexpr std::chrono::milliseconds kMaxGatherTimeout{600'000};

// Runs `fn` (returning absl::Status), turning any exception into INTERNAL: nothing may
// escape into gRPC's threads.
template <typename Fn>
grpc::Status Guarded(const char* method, Fn&& fn) {
  try {
    return ToGrpc(fn());
  } catch (const std::exception& e) {
    Log().error("{}: unexpected exception: {}", method, e.what());
    return grpc::Status(grpc::StatusCode::INTERNAL, fmt::format("{}: {}", method, e.what()));
  } catch (...) {
    Log().error("{}: unexpected exception", method);
    return grpc::Status(grpc::StatusCode::INTERNAL, fmt::format("{}: unexpected exception", method));
  }
}

// A call answered later, by whichever thread decides it (a waiter callback, the ticker,
// shutdown). Finishes the reactor exactly once and fills the reply only then, so that a
// late second answer can never touch a reply gRPC has already freed.
class Completion {
 public:
  explicit Completion(grpc::ServerUnaryReactor* reactor) : reactor_(reactor) {}

  void Finish(const char* method, const std::function<absl::Status()>& fill) {
    if (done_.exchange(true)) return;
    reactor_->Finish(Guarded(method, fill));
  }

 private:
  grpc::ServerUnaryReactor* const reactor_;
  std::atomic<bool> done_{false};
};

// Finishes the call with what a relay answers: `reply` takes it, or the call fails with
// its status (the node below then calls the coordinator itself).
template <typename Reply>
std::function<void(absl::StatusOr<Reply>)> AnswerFromRelay(std::shared_ptr<Completion> completion, Reply* reply,
                                                            const char* method) {
  return [completion = std::move(completion), reply, method](absl::StatusOr<Reply> answer) {
    completion->Finish(method, [&]() -> absl::Status {
      if (!answer.ok()) return answer.status();
      reply->Swap(&*answer);
      return absl::OkStatus();
    });
  };
}

// A gather's arrivals: its one participant's payload, or those merged on the way.
absl::StatusOr<std::vector<GatherTable::Sent>> ArrivalsOf(const pb::GatherRequest& request) {
  std::vector<GatherTable::Sent> sent;
  size_t bytes = 0;
  if (request.merged_size() == 0) {
    if (request.participant() >= request.participants()) {
      return absl::InvalidArgumentError(
          fmt::format("participant {} is not in 0..{}", request.participant(), request.participants() - 1));
    }
    bytes = request.payload().size();
    sent.push_back({request.payload(), {request.participant()}});
  } else {
    if (!request.distinct()) return absl::InvalidArgumentError("merged arrivals are for distinct gathers only");
    // participant = participants: out of range for a coordinator that predates merged
    // arrivals, which refuses the call rather than read it as participant 0's.
    if (!request.payload().empty() || request.participant() != request.participants()) {
      return absl::InvalidArgumentError(
          "a gather carries merged arrivals (with participant = participants) or a participant's payload, not both");
    }
    size_t named = 0;
    for (const pb::GatherArrivals& a : request.merged()) {
      if (a.payload().size() > kMaxPayloadBytes) {
        return absl::InvalidArgumentError(
            fmt::format("a payload of {} bytes is over the {} byte limit", a.payload().size(), kMaxPayloadBytes));
      }
      bytes += a.payload().size();
      named += static_cast<size_t>(a.participants_size());
      sent.push_back({a.payload(), {a.participants().begin(), a.participants().end()}});
    }
    // Out of range and twice-named participants are the gather table's to refuse.
    if (named > request.participants()) {
      return absl::InvalidArgumentError(
          fmt::format("merged arrivals name {} participants, the gather has {}", named, request.participants()));
    }
  }
  const size_t limit = request.merged_size() == 0 ? kMaxPayloadBytes : kMaxMergedBytes;
  if (bytes > limit) {
    return absl::InvalidArgumentError(fmt::format("payloads of {} bytes are over the {} byte limit", bytes, limit));
  }
  return sent;
}

pb::Outcome ToProto(Outcome outcome) {
  switch (outcome) {
    case Outcome::kUnknown: return pb::OUTCOME_UNKNOWN;
    case Outcome::kPending: return pb::OUTCOME_PENDING;
    case Outcome::kCommitted: return pb::OUTCOME_COMMITTED;
    case Outcome::kAborted: return pb::OUTCOME_ABORTED;
  }
  return pb::OUTCOME_UNKNOWN;
}

pb::MemberState ToProto(MemberState state) {
  switch (state) {
    case MemberState::kWaiting: return pb::MEMBER_WAITING;
    case MemberState::kAlive: return pb::MEMBER_ALIVE;
    case MemberState::kLost: return pb::MEMBER_LOST;
  }
  return pb::MEMBER_UNKNOWN;
}

absl::Status CheckJob(const std::string& job) { return Annotate(ValidateJobName(job), "job"); }

// A committed decision as `node` hears it: the header and its own share, and the whole
// manifest only when `whole` (node 0 publishes it; a node in doubt asks for it).
void FillCommitted(const Decision& decision, uint32_t node, bool whole, std::string* manifest_json,
                   pb::CommittedStep* out) {
  if (decision.outcome != Outcome::kCommitted || !decision.committed) return;
  const CommittedStep& c = *decision.committed;
  if (whole) *manifest_json = c.manifest_json;
  out->set_world_size(c.header.world_size);
  out->set_nodes(c.header.nodes);
  out->set_step_bytes(c.header.step_bytes);
  out->set_step_tensors(c.header.step_tensors);
  out->set_digest(c.header.digest);
  out->set_run(c.header.run);
  out->set_unix_time(c.header.unix_time);
  out->set_wall_time(c.header.wall_time);
  out->mutable_metadata()->insert(c.header.metadata.begin(), c.header.metadata.end());
  out->set_checksums_unused(c.checksums_unused);
  out->set_incremental(c.header.incremental);
  out->set_own_bytes(c.header.own_bytes);
  out->set_referenced_bytes(c.header.referenced_bytes);
  if (auto share = c.shares.find(node); share != c.shares.end()) {
    out->set_node_ranks(share->second.ranks);
    out->set_node_bytes(share->second.bytes);
    out->set_node_attempt(share->second.attempt);
    out->set_node_run(share->second.run);
  }
}

// The shares a relay asked for, of a commit: it answers those nodes itself. Every node
// asked for gets one, empty if the commit gives it no ranks (as FillCommitted leaves it).
void FillShares(const Decision& decision, const std::vector<uint32_t>& nodes, pb::OutcomeReply* reply) {
  if (decision.outcome != Outcome::kCommitted || !decision.committed) return;
  for (uint32_t n : nodes) {
    pb::NodeShare* out = reply->add_shares();
    out->set_node_rank(n);
    auto share = decision.committed->shares.find(n);
    if (share == decision.committed->shares.end()) continue;
    out->set_ranks(share->second.ranks);
    out->set_bytes(share->second.bytes);
    out->set_attempt(share->second.attempt);
    out->set_run(share->second.run);
  }
}

// The part a node prepared must say what its request says.
absl::Status CheckPartMatches(const pb::PrepareRequest& request, const PreparedPart& prepared) {
  const format::Manifest& part = prepared.shape();
  const char* what = request.structure_digest().empty() ? "manifest_part_json" : "structure_digest";
  if (part.job != request.job() || prepared.values.step != request.step() ||
      part.world_size != request.world_size()) {
    return absl::InvalidArgumentError(fmt::format(
        "{} is for job {} step {} world size {}, the request for job {} step {} world size {}", what,
        part.job, prepared.values.step, part.world_size, request.job(), request.step(), request.world_size()));
  }
  const std::vector<uint32_t>& ranks = prepared.structure->ranks;
  const bool same_ranks = std::equal(ranks.begin(), ranks.end(), request.ranks().begin(), request.ranks().end());
  if (!same_ranks) return absl::InvalidArgumentError(fmt::format("ranks differ from the shards of {}", what));
  return absl::OkStatus();
}

// A node's part as text (inline in a prepare, or uploaded in chunks), parsed; InvalidArgument
// naming `field` when it is not a part.
absl::StatusOr<format::Manifest> ParsePartText(const std::string& text, const std::string& source,
                                               const char* field) {
  absl::StatusOr<format::Manifest> part = format::ParseManifest(text, source, format::ManifestScope::kPart);
  if (!part.ok()) return absl::InvalidArgumentError(fmt::format("{}: {}", field, Message(part.status())));
  return part;
}

std::string Truncated(const std::string& text, size_t limit) {
  return text.size() <= limit ? text : text.substr(0, limit) + "...";
}

}  // namespace

GroupService::GroupService(const GroupOptions& options, uint64_t incarnation,
                           CoordinatorState* coordinator)
    : options_(options), incarnation_(incarnation), coordinator_(coordinator) {
  SetMessageAllocatorFor_PrepareBatch(&prepare_batch_messages_);
  SetMessageAllocatorFor_HeartbeatBatch(&heartbeat_batch_messages_);
  SetMessageAllocatorFor_GetOutcome(&outcome_messages_);
}

absl::Status GroupService::Admit(grpc::CallbackServerContext* ctx, const char* method, Role role) {
  const auto& metadata = ctx->client_metadata();
  auto it = metadata.find(kTokenMetadata);
  std::string_view given;
  if (it != metadata.end()) given = std::string_view(it->second.data(), it->second.size());
  if (!SecretEquals(given, options_.token)) {
    WarnRefused(ctx->peer(), method);
    return absl::UnauthenticatedError("the group token is missing or wrong");
  }
  if (role == Role::kCoordinatorOnly && coordinator_ == nullptr) {
    return absl::FailedPreconditionError(fmt::format(
        "node {} is not the coordinator (node 0 is)", options_.node_rank));
  }
  return absl::OkStatus();
}

void GroupService::WarnRefused(const std::string& peer, const char* method) {
  auto now = Clock::now();
  {
    std::lock_guard lock(warn_mu_);
    // Bounded: a scan from many addresses must not grow this map without limit.
    if (last_warned_.size() > 1024) last_warned_.clear();
    auto [it, inserted] = last_warned_.try_emplace(peer, now);
    if (!inserted) {
      if (now - it->second < std::chrono::seconds(1)) return;
      it->second = now;
    }
  }
  Log().warn("refused a {} call from {}: the group token is missing or wrong", method, peer);
}

absl::Status GroupService::CheckNode(const char* field, uint32_t node) const {
  if (node >= options_.num_nodes) {
    return absl::InvalidArgumentError(
        fmt::format("{} {} is not in 0..{}", field, node, options_.num_nodes - 1));
  }
  return absl::OkStatus();
}

namespace {

void AddMember(const MemberView& m, pb::GroupView* view) {
  pb::Member* member = view->add_members();
  member->set_node_rank(m.node);
  member->set_address(m.address);
  member->set_state(ToProto(m.state));
  member->set_last_heartbeat_age_s(m.last_heartbeat_age_s);
  member->set_incarnation(m.incarnation);
  member->set_failure_domain(m.domain);
}

}  // namespace

void GroupService::FillView(pb::GroupView* view, uint64_t known_members_version) const {
  uint64_t version = 0;
  for (const MemberView& m : coordinator_->membership.Changes(known_members_version, &version)) AddMember(m, view);
  view->set_members_version(version);
  view->set_members_complete(known_members_version == 0 || known_members_version > version);
  FillProgress(view);
}

void GroupService::FillJoinView(pb::GroupView* view, uint32_t node) const {
  const std::optional<uint32_t> parent = RelayParent(node, options_.relay_fanout);
  if (!parent || *parent == 0) {
    FillView(view, 0);  // no relay above it (no tree, or a child of node 0): every member
    return;
  }
  // Only the joiner's relay, and no version: its first heartbeat, which its relay batches
  // with its subtree's, asks for the whole membership. Every join of a starting group
  // brought the whole table (10,000 joins, 2.5 GB of replies and 30 s of node 0's CPU).
  if (std::optional<MemberView> relay = coordinator_->membership.MemberOf(*parent)) AddMember(*relay, view);
  view->set_members_version(0);
  view->set_members_complete(false);
  FillProgress(view);
}

void GroupService::FillProgress(pb::GroupView* view) const {
  for (const StepProgress& s : coordinator_->commits.InFlight()) {
    pb::StepInFlight* step = view->add_steps();
    step->set_job(s.job);
    step->set_step(s.step);
    step->set_world_size(s.world_size);
    for (uint32_t r : s.missing_ranks) step->add_missing_ranks(r);
    step->set_age_s(s.age_s);
  }
  for (const auto& [job, step] : coordinator_->commits.LatestCommitted()) {
    pb::JobCommitted* committed = view->add_committed();
    committed->set_job(job);
    committed->set_step(step);
  }
  if (coordinator_->uploading != nullptr) {
    for (const auto& [job, step] : coordinator_->uploading->All()) {
      pb::JobUploading* uploading = view->add_uploading();
      uploading->set_job(job);
      uploading->set_step(step);
    }
  }
}

// A node bound to every interface ("0.0.0.0:PORT") is shown at the host it called from.
static std::string AdvertisedAddress(const std::string& advertised, const std::string& peer) {
  auto colon = advertised.rfind(':');
  if (colon == std::string::npos) return advertised;
  std::string host = advertised.substr(0, colon);
  if (host != "0.0.0.0" && host != "[::]" && host != "::") return advertised;
  // gRPC peers look like "ipv4:10.0.0.7:51234" or "ipv6:[fd00::7]:51234".
  auto kind = peer.find(':');
  auto port = peer.rfind(':');
  if (kind == std::string::npos || port == kind) return advertised;
  return peer.substr(kind + 1, port - kind - 1) + advertised.substr(colon);
}

grpc::ServerUnaryReactor* GroupService::Join(grpc::CallbackServerContext* ctx,
                                             const pb::JoinRequest* request, pb::JoinReply* reply) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(Guarded("Join", [&]() -> absl::Status {
    CKPT_RETURN_IF_ERROR(Admit(ctx, "Join", Role::kCoordinatorOnly));
    CKPT_RETURN_IF_ERROR(CheckNode("node_rank", request->node_rank()));
    if (request->address().size() > kMaxAddressBytes) {
      return absl::InvalidArgumentError(
          fmt::format("address is longer than {} bytes", kMaxAddressBytes));
    }
    if (request->failure_domain().size() > kMaxAddressBytes) {
      return absl::InvalidArgumentError(
          fmt::format("failure_domain is longer than {} bytes", kMaxAddressBytes));
    }
    bool restarted = false;
    std::string address = AdvertisedAddress(request->address(), ctx->peer());
    CKPT_RETURN_IF_ERROR(coordinator_->membership.Join(request->node_rank(), request->num_nodes(),
                                                       address, request->incarnation(),
                                                       &restarted, request->failure_domain()));
    Log().info("node {} joined from {} (incarnation {:x}{}{})", request->node_rank(),
               address, request->incarnation(),
               request->version().empty() ? "" : ", ckptd ",
               Truncated(request->version(), 64));
    coordinator_->commits.MemberBack(request->node_rank(), coordinator_->membership.VersionOf(request->node_rank()));
    if (restarted) {
      // Its trainers' ranks of any undecided step died with the old daemon.
      std::string why = fmt::format("node {} restarted", request->node_rank());
      Log().warn("{}: aborting undecided steps", why);
      coordinator_->commits.AbortIncomplete(why);
    }
    FillJoinView(reply->mutable_view(), request->node_rank());
    return absl::OkStatus();
  }));
  return reactor;
}

grpc::ServerUnaryReactor* GroupService::Heartbeat(grpc::CallbackServerContext* ctx,
                                                  const pb::HeartbeatRequest* request,
                                                  pb::HeartbeatReply* reply) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(Guarded("Heartbeat", [&]() -> absl::Status {
    CKPT_RETURN_IF_ERROR(Admit(ctx, "Heartbeat", Role::kCoordinatorOnly));
    CKPT_RETURN_IF_ERROR(CheckNode("node_rank", request->node_rank()));
    CKPT_RETURN_IF_ERROR(
        coordinator_->membership.Heartbeat(request->node_rank(), request->incarnation()));
    if (request->known_members_version() == 0) {
      // Straight from a node that knows no member: one whose relay has not joined yet, or
      // that just joined. The whole table goes through its relay, batched with its
      // subtree's; a node without a relay hears it here.
      FillJoinView(reply->mutable_view(), request->node_rank());
    } else {
      FillView(reply->mutable_view(), request->known_members_version());
    }
    return absl::OkStatus();
  }));
  return reactor;
}

absl::StatusOr<Relay*> GroupService::AdmitBatch(grpc::CallbackServerContext* ctx, const char* method,
                                                const char* what, int size) {
  CKPT_RETURN_IF_ERROR(Admit(ctx, method, Role::kAnyNode));
  if (size > static_cast<int>(kMaxBatchItems)) {
    return absl::InvalidArgumentError(fmt::format("a batch of {} {} is over the {} limit", size, what, kMaxBatchItems));
  }
  if (coordinator_ != nullptr) return nullptr;
  Relay* relay = relay_;
  if (relay == nullptr) return absl::FailedPreconditionError(fmt::format("node {} does not relay", options_.node_rank));
  return relay;
}

grpc::ServerUnaryReactor* GroupService::HeartbeatBatch(grpc::CallbackServerContext* ctx,
                                                       const pb::HeartbeatBatchRequest* request,
                                                       pb::HeartbeatBatchReply* reply) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  auto completion = std::make_shared<Completion>(reactor);
  absl::StatusOr<Relay*> relay = AdmitBatch(ctx, "HeartbeatBatch", "heartbeats", request->heartbeats_size());
  if (!relay.ok()) {
    completion->Finish("HeartbeatBatch", [&] { return relay.status(); });
    return reactor;
  }
  if (*relay != nullptr) {
    (*relay)->Heartbeat(*request, AnswerFromRelay(completion, reply, "HeartbeatBatch"));
    return reactor;
  }
  // Each heartbeat is checked on its own. The view is filled at most twice per batch: all
  // members for nodes that know none, and for the rest the changes since the oldest
  // version any of them knows (changes a node already has are harmless to hear again). A
  // view per distinct version would be O(nodes²) bytes after the joins of a group's start.
  completion->Finish("HeartbeatBatch", [&]() -> absl::Status {
    uint64_t oldest = 0;
    for (const pb::HeartbeatRequest& h : request->heartbeats()) {
      if (h.known_members_version() != 0 && (oldest == 0 || h.known_members_version() < oldest)) {
        oldest = h.known_members_version();
      }
    }
    std::map<uint64_t, uint32_t> view_of_version;
    for (const pb::HeartbeatRequest& h : request->heartbeats()) {
      pb::HeartbeatResult* result = reply->add_results();
      absl::Status status = CheckNode("node_rank", h.node_rank());
      if (status.ok()) status = coordinator_->membership.Heartbeat(h.node_rank(), h.incarnation());
      if (!status.ok()) {
        result->set_code(static_cast<int32_t>(status.code()));
        result->set_message(std::string(status.message()));
        continue;
      }
      const uint64_t known = h.known_members_version() == 0 ? 0 : oldest;
      auto [it, added] = view_of_version.try_emplace(known, static_cast<uint32_t>(reply->views_size()));
      if (added) FillView(reply->add_views(), known);
      result->set_view(it->second);
    }
    return absl::OkStatus();
  });
  return reactor;
}

grpc::ServerUnaryReactor* GroupService::Prepare(grpc::CallbackServerContext* ctx,
                                                const pb::PrepareRequest* request,
                                                pb::PrepareReply* reply) {
  // DefaultReactor() constructs the reactor: call it once per call.
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  auto completion = std::make_shared<Completion>(reactor);
  if (absl::Status admitted = Admit(ctx, "Prepare", Role::kCoordinatorOnly); !admitted.ok()) {
    completion->Finish("Prepare", [&] { return admitted; });
    return reactor;
  }
  PrepareOne(*request, reply, [completion](const Fill& fill) { completion->Finish("Prepare", fill); });
  return reactor;
}

grpc::ServerUnaryReactor* GroupService::PrepareBatch(grpc::CallbackServerContext* ctx,
                                                     const pb::PrepareBatchRequest* request,
                                                     pb::PrepareBatchReply* reply) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  auto completion = std::make_shared<Completion>(reactor);
  absl::StatusOr<Relay*> relay = AdmitBatch(ctx, "PrepareBatch", "prepares", request->prepares_size());
  if (!relay.ok()) {
    completion->Finish("PrepareBatch", [&] { return relay.status(); });
    return reactor;
  }
  if (*relay != nullptr) {
    // A relay: the batch goes on up with what else is queued.
    (*relay)->Prepare(*request, AnswerFromRelay(completion, reply, "PrepareBatch"));
    return reactor;
  }
  // Every prepare is answered on its own; the call ends with the last.
  const int n = request->prepares_size();
  if (n == 0) {
    completion->Finish("PrepareBatch", [] { return absl::OkStatus(); });
    return reactor;
  }
  for (int i = 0; i < n; ++i) reply->add_results();
  // The batch's structures, looked up under one lock rather than one each.
  std::vector<const std::string*> digests(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) digests[i] = &request->prepares(i).structure_digest();
  std::vector<std::shared_ptr<const format::PartStructure>> found = coordinator_->structures.FindMany(digests);
  struct Items {
    std::atomic<int> left;
    std::unique_ptr<std::atomic<bool>[]> done;
  };
  auto items = std::make_shared<Items>();
  items->left = n;
  items->done = std::make_unique<std::atomic<bool>[]>(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    pb::PrepareResult* result = reply->mutable_results(i);
    PrepareOne(request->prepares(i), result->mutable_reply(), [completion, items, result, i](const Fill& fill) {
      if (items->done[i].exchange(true)) return;
      grpc::Status status = Guarded("PrepareBatch", fill);
      if (!status.ok()) {
        result->Clear();
        result->set_code(static_cast<int32_t>(status.error_code()));
        result->set_message(status.error_message());
      }
      if (--items->left == 0) completion->Finish("PrepareBatch", [] { return absl::OkStatus(); });
    }, std::move(found[i]));
  }
  return reactor;
}

void GroupService::PrepareOne(const pb::PrepareRequest& request_ref, pb::PrepareReply* reply,
                              std::function<void(const Fill&)> finish,
                              std::shared_ptr<const format::PartStructure> found) {
  const pb::PrepareRequest* request = &request_ref;
  absl::Status early = FromGrpc(Guarded("Prepare", [&]() -> absl::Status {
    uint32_t node = request->node_rank();
    CKPT_RETURN_IF_ERROR(CheckNode("node_rank", node));
    CKPT_RETURN_IF_ERROR(CheckJob(request->job()));
    if (request->world_size() == 0 || request->world_size() > kMaxWorldSize) {
      return absl::InvalidArgumentError(fmt::format("world_size {} is not in 1..{}",
                                                    request->world_size(), kMaxWorldSize));
    }
    if (request->ranks_size() == 0) return absl::InvalidArgumentError("ranks is empty");
    for (uint32_t rank : request->ranks()) {
      if (rank >= request->world_size()) {
        return absl::InvalidArgumentError(
            fmt::format("ranks: {} is outside world_size {}", rank, request->world_size()));
      }
    }
    // Only a member in good standing may vote: a prepare from an old incarnation (sent
    // before a restart) or from a node marked lost must not count. Counts as a heartbeat.
    CKPT_RETURN_IF_ERROR(coordinator_->membership.Heartbeat(node, request->incarnation()));
    PreparedPart part;
    if (!request->structure_digest().empty()) {
      // Only this step's values, of a structure sent before.
      if (!request->manifest_part_json().empty()) {
        return absl::InvalidArgumentError("a prepare carries manifest_part_json or structure_digest, not both");
      }
      // A summary found with the batch may have been dropped since by an earlier prepare's
      // decision (its node must send the part whole): looked up again.
      part.structure = found && !found->summary ? std::move(found)
                                                 : coordinator_->structures.Find(request->structure_digest());
      if (!part.structure) {
        finish([&] {
          reply->set_outcome(pb::OUTCOME_PENDING);
          reply->set_need_structure(true);
          return absl::OkStatus();
        });
        return absl::OkStatus();
      }
      absl::StatusOr<format::PartValues> values = FromProto(request->values(), request->step());
      CKPT_RETURN_IF_ERROR(Annotate(values.status(), "values"));
      part.values = std::move(*values);
      CKPT_RETURN_IF_ERROR(Annotate(format::CheckValuesFit(*part.structure, part.values), "values"));
    } else {
      CKPT_ASSIGN_OR_RETURN(format::Manifest whole_part,
                            ParsePartText(request->manifest_part_json(), fmt::format("prepare from node {}", node),
                                          "manifest_part_json"));
      format::SplitResult split = format::SplitPart(whole_part);
      part = {std::move(split.structure), std::move(split.values)};
    }
    CKPT_RETURN_IF_ERROR(CheckPartMatches(*request, part));
    // Kept once it proved to be this node's part: its next prepares send only values.
    if (request->structure_digest().empty()) coordinator_->structures.Add(part.structure);
    Decision decision = coordinator_->commits.Prepare(node, request->attempt(), std::move(part));
    // `reply` lives until the call finishes, which only `finish` does.
    auto answer = [finish, reply, node](const Decision& d) {
      finish([&]() -> absl::Status {
        reply->set_outcome(ToProto(d.outcome));
        reply->set_reason(d.reason);
        FillCommitted(d, node, /*whole=*/node == 0, reply->mutable_manifest_json(), reply->mutable_committed());
        return absl::OkStatus();
      });
    };
    if (node == 0 && decision.outcome == Outcome::kCommitted && decision.committed->manifest_json.empty()) {
      // Node 0 publishes the whole step: it hears once the manifest is assembled, after
      // every other node has heard.
      coordinator_->commits.Await(request->job(), request->step(), Clock::now() + kMaxOutcomeWait, answer,
                                  /*whole_manifest=*/true);
    } else {
      answer(decision);
    }
    return absl::OkStatus();
  }));
  if (!early.ok()) finish([&] { return early; });
}

grpc::ServerUnaryReactor* GroupService::PutStructure(grpc::CallbackServerContext* ctx,
                                                     const pb::StructureChunk* request,
                                                     pb::StructureChunkReply* reply) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(Guarded("PutStructure", [&]() -> absl::Status {
    CKPT_RETURN_IF_ERROR(Admit(ctx, "PutStructure", Role::kCoordinatorOnly));
    const uint32_t node = request->node_rank();
    CKPT_RETURN_IF_ERROR(CheckNode("node_rank", node));
    // Only a member in good standing may make the coordinator hold bytes.
    CKPT_RETURN_IF_ERROR(coordinator_->membership.Heartbeat(node, request->incarnation()));
    absl::StatusOr<std::optional<std::string>> text = coordinator_->uploads.Add(
        node, request->structure_digest(), request->total_bytes(), request->offset(), request->data(), Clock::now());
    if (!text.ok()) return Annotate(text.status(), "structure chunk");
    if (!*text) return absl::OkStatus();
    std::lock_guard parsing(coordinator_->parse_mu);
    CKPT_ASSIGN_OR_RETURN(format::Manifest part,
                          ParsePartText(**text, fmt::format("structure from node {}", node), "the uploaded part"));
    text->reset();  // up to 256 MiB, not needed for the split
    format::SplitResult split = format::SplitPart(part);
    if (split.structure->digest != request->structure_digest()) {
      return absl::InvalidArgumentError(fmt::format("the uploaded part's structure digest is {}, not {} as named",
                                                    split.structure->digest, request->structure_digest()));
    }
    coordinator_->structures.Add(std::move(split.structure));
    reply->set_complete(true);
    return absl::OkStatus();
  }));
  return reactor;
}

grpc::ServerUnaryReactor* GroupService::Abort(grpc::CallbackServerContext* ctx,
                                              const pb::AbortRequest* request, pb::AbortReply*) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(Guarded("Abort", [&]() -> absl::Status {
    CKPT_RETURN_IF_ERROR(Admit(ctx, "Abort", Role::kCoordinatorOnly));
    CKPT_RETURN_IF_ERROR(CheckNode("node_rank", request->node_rank()));
    CKPT_RETURN_IF_ERROR(CheckJob(request->job()));
    // As for a prepare: a node's old incarnation, or a node marked lost, has no say.
    CKPT_RETURN_IF_ERROR(coordinator_->membership.Heartbeat(request->node_rank(), request->incarnation()));
    std::string reason = request->reason().empty() ? "no reason given" : request->reason();
    coordinator_->commits.Abort(
        request->job(), request->step(), request->node_rank(), request->attempt(),
        fmt::format("node {}: {}", request->node_rank(), Truncated(reason, kMaxReasonBytes)), request->run());
    return absl::OkStatus();
  }));
  return reactor;
}

grpc::ServerUnaryReactor* GroupService::GetOutcome(grpc::CallbackServerContext* ctx,
                                                   const pb::OutcomeRequest* request,
                                                   pb::OutcomeReply* reply) {
  // DefaultReactor() constructs the reactor: call it once per call.
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  auto completion = std::make_shared<Completion>(reactor);
  grpc::Status early = Guarded("GetOutcome", [&]() -> absl::Status {
    Relay* relay = relay_;
    CKPT_RETURN_IF_ERROR(Admit(ctx, "GetOutcome", relay == nullptr ? Role::kCoordinatorOnly : Role::kAnyNode));
    CKPT_RETURN_IF_ERROR(CheckNode("node_rank", request->node_rank()));
    CKPT_RETURN_IF_ERROR(CheckJob(request->job()));
    if (static_cast<uint32_t>(request->shares_for_size()) > options_.num_nodes) {
      return absl::InvalidArgumentError(fmt::format("shares_for names {} nodes, the group has {}",
                                                    request->shares_for_size(), options_.num_nodes));
    }
    // A relay asks for the shares of its own subtree only (and a relay is asked only by the
    // nodes below it): what a poll makes a relay or node 0 hold stays within the tree.
    for (uint32_t n : request->shares_for()) {
      CKPT_RETURN_IF_ERROR(CheckNode("shares_for", n));
      if (!RelayBelow(n, request->node_rank(), options_.relay_fanout)) {
        return absl::InvalidArgumentError(fmt::format("shares_for {} is not below node {} in the relay tree (fan-out {})",
                                                      n, request->node_rank(), options_.relay_fanout));
      }
    }
    if (coordinator_ == nullptr && !RelayBelow(request->node_rank(), options_.node_rank, options_.relay_fanout)) {
      return absl::InvalidArgumentError(fmt::format("node {} is not below node {} in the relay tree (fan-out {})",
                                                    request->node_rank(), options_.node_rank, options_.relay_fanout));
    }
    auto wait = std::min<std::chrono::milliseconds>(
        std::chrono::milliseconds(request->wait_ms()), kMaxOutcomeWait);
    if (stop_waiting_) wait = std::chrono::milliseconds(0);
    if (coordinator_ == nullptr) {
      relay->GetOutcome(*request, Clock::now() + wait, AnswerFromRelay(completion, reply, "GetOutcome"));
      return absl::OkStatus();
    }
    // `reply` lives until the reactor finishes, which only the completion does.
    const uint32_t node = request->node_rank();
    const bool whole = node == 0 || request->whole_manifest();
    std::vector<uint32_t> shares_for(request->shares_for().begin(), request->shares_for().end());
    coordinator_->commits.Await(
        request->job(), request->step(), Clock::now() + wait,
        [completion, reply, node, whole, shares_for = std::move(shares_for)](const Decision& decision) {
          completion->Finish("GetOutcome", [&]() -> absl::Status {
            reply->set_outcome(ToProto(decision.outcome));
            reply->set_reason(decision.reason);
            FillCommitted(decision, node, whole, reply->mutable_manifest_json(), reply->mutable_committed());
            FillShares(decision, shares_for, reply);
            return absl::OkStatus();
          });
        },
        whole);
    return absl::OkStatus();
  });
  if (!early.ok()) completion->Finish("GetOutcome", [&] { return FromGrpc(early); });
  return reactor;
}

grpc::ServerUnaryReactor* GroupService::Gather(grpc::CallbackServerContext* ctx,
                                               const pb::GatherRequest* request,
                                               pb::GatherReply* reply) {
  // DefaultReactor() constructs the reactor: call it once per call.
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  auto completion = std::make_shared<Completion>(reactor);
  grpc::Status early = Guarded("Gather", [&]() -> absl::Status {
    Relay* relay = relay_;
    CKPT_RETURN_IF_ERROR(Admit(ctx, "Gather", relay == nullptr ? Role::kCoordinatorOnly : Role::kAnyNode));
    if (request->key().empty() || request->key().size() > kMaxKeyBytes) {
      return absl::InvalidArgumentError(
          fmt::format("key must be 1..{} bytes, not {}", kMaxKeyBytes, request->key().size()));
    }
    if (request->participants() == 0 || request->participants() > kMaxParticipants) {
      return absl::InvalidArgumentError(fmt::format("participants {} is not in 1..{}",
                                                    request->participants(), kMaxParticipants));
    }
    if (request->timeout_ms() == 0) return absl::InvalidArgumentError("timeout_ms is 0");
    CKPT_ASSIGN_OR_RETURN(std::vector<GatherTable::Sent> sent, ArrivalsOf(*request));
    if (stop_waiting_) return absl::UnavailableError("the coordinator is shutting down");
    auto timeout = std::min<std::chrono::milliseconds>(
        std::chrono::milliseconds(request->timeout_ms()), kMaxGatherTimeout);
    if (request->distinct()) {
      auto answer = [completion, reply](absl::StatusOr<GatherTable::Distinct> distinct) {
        completion->Finish("Gather", [&]() -> absl::Status {
          if (!distinct.ok()) return distinct.status();
          for (std::string& p : distinct->payloads) reply->add_payloads(std::move(p));
          reply->mutable_senders()->Add(distinct->senders.begin(), distinct->senders.end());
          reply->mutable_counts()->Add(distinct->counts.begin(), distinct->counts.end());
          return absl::OkStatus();
        });
      };
      if (relay != nullptr) {
        // A relay: merged with the other arrivals of the key that come within its linger.
        // Its answer is marked node 0's, a refusal its own (grpc_util.h).
        absl::Status merged = relay->Gather(
            request->key(), request->participants(), std::move(sent), Clock::now() + timeout,
            [ctx, answer = std::move(answer)](absl::StatusOr<GatherTable::Distinct> distinct) {
              ctx->AddTrailingMetadata(kRelayedAnswerMetadata, "1");
              answer(std::move(distinct));
            });
        if (!merged.ok()) ctx->AddTrailingMetadata(kRelayRefusedMetadata, "1");
        return merged;
      }
      coordinator_->gathers.ArriveMerged(request->key(), request->participants(), std::move(sent),
                                         Clock::now() + timeout, std::move(answer));
      return absl::OkStatus();
    }
    if (relay != nullptr) return absl::InvalidArgumentError("a relay takes distinct gathers only: call the coordinator");
    coordinator_->gathers.Arrive(
        request->key(), request->participant(), request->participants(), request->payload(),
        Clock::now() + timeout,
        [completion, reply](absl::StatusOr<std::vector<std::string>> payloads) {
          completion->Finish("Gather", [&]() -> absl::Status {
            if (!payloads.ok()) return payloads.status();
            for (std::string& p : *payloads) reply->add_payloads(std::move(p));
            return absl::OkStatus();
          });
        });
    return absl::OkStatus();
  });
  if (!early.ok()) completion->Finish("Gather", [&] { return FromGrpc(early); });
  return reactor;
}

grpc::ServerUnaryReactor* GroupService::DecideSave(grpc::CallbackServerContext* ctx,
                                                   const pb::SaveDecisionRequest* request,
                                                   pb::SaveDecisionReply* reply) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(Guarded("DecideSave", [&]() -> absl::Status {
    CKPT_RETURN_IF_ERROR(Admit(ctx, "DecideSave", Role::kCoordinatorOnly));
    CKPT_RETURN_IF_ERROR(CheckNode("node_rank", request->node_rank()));
    CKPT_RETURN_IF_ERROR(CheckJob(request->job()));
    daemon::SaveQuestion question{request->job(), request->run(), request->step(),
                                  std::chrono::milliseconds(request->interval_ms())};
    CKPT_ASSIGN_OR_RETURN(bool save, coordinator_->saves.Decide(question, Clock::now()));
    reply->set_save(save);
    return absl::OkStatus();
  }));
  return reactor;
}

grpc::ServerUnaryReactor* GroupService::Ping(grpc::CallbackServerContext* ctx,
                                             const pb::PingRequest*, pb::PingReply* reply) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(Guarded("Ping", [&]() -> absl::Status {
    CKPT_RETURN_IF_ERROR(Admit(ctx, "Ping", Role::kAnyNode));
    reply->set_node_rank(options_.node_rank);
    reply->set_incarnation(incarnation_);
    reply->set_coordinator(coordinator_ != nullptr);
    return absl::OkStatus();
  }));
  return reactor;
}

}  // namespace ckpt::group
